"""A small GPT-style decoder written for the "Bring your own model" chapter (not a zoo entry).

    static-dist audit --model examples/gpt.py:GPT --batch 4 --seq 256

Token + learned position embeddings, pre-norm blocks in `transformer.h` (fused-qkv causal attention and a GELU MLP),
a final LayerNorm and an lm_head tied to the token embedding. `GPTConfig(checkpoint=(0, 2))` recomputes those blocks'
activations in backward. `GPT()` needs no arguments; `gpt_small()` and `gpt_checkpointed()` are factories. All three
are sources `static_dist.workload.load_workload` accepts (`examples/gpt.py:gpt_checkpointed`).
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class GPTConfig:
    "Shape of the model."
    vocab_size: int = 512
    "Number of token ids."
    n_layer: int = 4
    "Number of transformer blocks."
    n_embd: int = 128
    "Width of the residual stream."
    n_head: int = 4
    "Attention heads; must divide `n_embd`."
    max_seq_len: int = 256
    "Longest sequence the learned position embedding covers."
    checkpoint: tuple[int, ...] = ()
    "Blocks whose activations are recomputed in backward (activation checkpointing), e.g. (0, 2)."

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)   # fused q, k, v projection
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(cfg.n_embd), CausalSelfAttention(cfg)
        self.ln_2, self.mlp = nn.LayerNorm(cfg.n_embd), MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    "GPT-style decoder: `forward(tokens (B, T) int64) -> logits (B, T, vocab_size)`."
    def __init__(self, cfg: GPTConfig | None = None):
        super().__init__()
        self.config = cfg = cfg or GPTConfig()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.max_seq_len, cfg.n_embd),
            h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
            ln_f=nn.LayerNorm(cfg.n_embd)))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight   # tied: one matrix, counted once

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len {self.config.max_seq_len}")
        pos = torch.arange(T, device=tokens.device)
        x = self.transformer.wte(tokens) + self.transformer.wpe(pos)
        for i, block in enumerate(self.transformer.h):
            x = checkpoint(block, x, use_reentrant=False) if i in self.config.checkpoint else block(x)
        return self.lm_head(self.transformer.ln_f(x))


def gpt_small() -> GPT:
    "The default GPT (vocab 512, 4 layers, width 128, 4 heads, 256 positions) through a factory."
    return GPT(GPTConfig())


def gpt_checkpointed() -> GPT:
    "The default GPT with activation checkpointing on blocks 0 and 2 (half of them)."
    return GPT(GPTConfig(checkpoint=(0, 2)))
