import os

import pytest
import torch

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
