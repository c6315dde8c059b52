"""The tests' GPT is `examples/gpt.py`, the model the README tours (blocks at `transformer.h`, a fused qkv linear
`attn.qkv`, learned positions, tied input/output embeddings): builders and its loss, for tests that check
structure-driven code on a model whose names nobody here chose."""
from pathlib import Path

import torch
import torch.nn.functional as F

from static_dist.util import import_file

_gpt = import_file(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")
GPT, GPTConfig = _gpt.GPT, _gpt.GPTConfig


def gpt_loss(logits, targets): return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build_gpt(n_layer: int = 3, device="meta", dtype=torch.float32, **kw) -> GPT:
    "examples/gpt.py's GPT with `n_layer` blocks (vocab 512, width 128, 4 heads, 256 positions unless given in `kw`)."
    with torch.device(device): return GPT(GPTConfig(n_layer=n_layer, **kw)).to(dtype)
