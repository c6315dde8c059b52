import os

import pytest
import torch
from hf_configs import hf_source

# Triton kernels run on CPU only under the interpreter, which must be chosen before triton is first imported
# (torch.compile imports it); decide once for the whole session.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    "Tests marked gpu are skipped where no CUDA device exists (they are never the only test of a feature)."
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def offload_tiny():
    """The offload tests' real tiny Llama step (once per test module: the tests mutate its gradients): model, batch,
    captured graph, `step()` returning the gradients, the no-offload reference gradients, and a plan moving every saved
    tensor to a disk tier."""
    import math
    from types import SimpleNamespace
    from static_dist.graph import capture
    from static_dist.offload import Tier, plan_offload
    from static_dist.zoo import get_model
    zm = get_model("tiny")
    m = zm.build("cpu")
    (x,), y = zm.batch(4, 128)
    g = capture(m, (x,), loss_fn=zm.loss, targets=y)
    def step():
        m.zero_grad(set_to_none=True)
        zm.loss(m(x), y).backward()
        return {n: p.grad.clone() for n, p in m.named_parameters()}
    disk = plan_offload(g, (Tier("nvme", 1e9, 1e-5, math.inf, "disk"),), min_bytes=0)
    return SimpleNamespace(zm=zm, m=m, x=x, y=y, g=g, step=step, ref=step(), disk=disk)


@pytest.fixture(scope="session")
def hf_tiny_llama(tmp_path_factory):
    "A tiny Hugging Face Llama config, as an `hf:` workload source."
    return hf_source(tmp_path_factory, "LlamaConfig", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=128, vocab_size=256, max_position_embeddings=256)


OWN_LOSS_MODEL = '''
import torch, torch.nn as nn, torch.nn.functional as F
from static_dist.workload import Workload, module_builder

class TinyGPT(nn.Module):
    "nanoGPT's convention: forward(idx, targets) returns (logits, loss) when given targets."
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(64, 32), nn.Linear(32, 64)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32)) for _ in range(2))
    def forward(self, idx, targets=None):
        x = self.emb(idx)
        for b in self.blocks: x = x + torch.tanh(b(x))
        logits = self.head(x)
        return logits if targets is None else (logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten()))

def workload():
    "The model with its targets as a keyword input and its own loss: no loss function given."
    def make_inputs(b, s, device="cpu"):
        t = torch.randint(64, (b, s + 1), generator=torch.Generator().manual_seed(0)).to(device)
        return (t[:, :-1],), {"targets": t[:, 1:]}, None
    return Workload(source="own-loss", build=module_builder(TinyGPT), batch=2, seq=16, make_inputs=make_inputs,
                    loss=lambda out: out[1])
'''


@pytest.fixture(scope="session")
def own_loss_model(tmp_path_factory):
    "A file with a nanoGPT-style model that returns its own loss, and the `file.py:workload` source of it."
    f = tmp_path_factory.mktemp("own_loss") / "own_loss.py"
    f.write_text(OWN_LOSS_MODEL)
    return f"{f}:workload"
