"""A GPT-2-style model written for the tests (not a zoo entry): blocks at `transformer.h`, a fused qkv linear
(`attn.c_attn`), learned positions, tied input/output embeddings. Used to check that structure-driven code works on
a model whose names nobody here chose."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head, self.head_dim = n_head, d // n_head
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x): return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(d), CausalSelfAttention(d, n_head)
        self.ln_2, self.mlp = nn.LayerNorm(d), MLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 512, n_layer: int = 3, n_head: int = 4, d: int = 128, block_size: int = 256,
                 tie: bool = True):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, d), wpe=nn.Embedding(block_size, d),
            h=nn.ModuleList(Block(d, n_head) for _ in range(n_layer)), ln_f=nn.LayerNorm(d)))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tie: self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx):
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for b in self.transformer.h: x = b(x)
        return self.lm_head(self.transformer.ln_f(x))


def gpt_loss(logits, targets): return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build_gpt(n_layer: int = 3, device="meta", dtype=torch.float32, **kw) -> GPT:
    with torch.device(device): return GPT(n_layer=n_layer, **kw).to(dtype)
