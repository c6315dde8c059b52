"""`compiled_saved_bytes` (the partitioner on fake tensors) against what autograd keeps for a block compiled by Inductor
on CPU, and `compile_effects`' eager side against the same block run eagerly."""
import os
import tempfile
from pathlib import Path

import pytest
import torch

from static_dist.compile.saved import block_call, compile_effects, compiled_saved, compiled_saved_bytes
from static_dist.graph import capture
from static_dist.zoo import get_model

CACHE = Path(tempfile.gettempdir()) / "static_dist_inductor_cache"


def _measured(fn, model, args, kwargs) -> int:
    """Bytes of the distinct storages autograd saves while `fn(*args, **kwargs)` runs forward and backward, the model's
    parameters and buffers aside (a pack hook sees every tensor `save_for_backward` keeps)."""
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen = {}
    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip: seen[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t): out = fn(*args, **kwargs)
    out.float().sum().backward()
    return sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)])
def test_compiled_block_saves_what_the_partitioner_predicts(monkeypatch, dtype):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(CACHE))
    z = get_model("tiny")
    real, meta = z.build("cpu", dtype=dtype), z.build("meta", dtype=dtype)
    (tokens,), targets = z.batch(2, 64)
    ra, rk = block_call(real, "layers.0", (tokens,))
    predicted = compiled_saved_bytes(meta, "layers.0", *block_call(meta, "layers.0", (tokens.to("meta"),)))
    eager = _measured(real.layers[0], real, ra, rk)
    torch._dynamo.reset()
    compiled = _measured(torch.compile(real.layers[0], backend="inductor"), real, ra, rk)
    torch._dynamo.reset()
    assert compiled == predicted, (compiled, predicted, eager)
    assert compiled < eager, (compiled, eager)       # compile recomputes cheap chains that eager saves
    g = capture(meta, (tokens,), loss_fn=z.loss, targets=targets)
    fx = compile_effects(g, meta, (tokens.to("meta"),))
    assert [(b.block, b.eager, b.compiled) for b in fx] == [("layers.0", eager, compiled), ("layers.1", eager, compiled)]


def test_saved_values_are_the_compiled_forwards_outputs():
    "Every saved value's shape is one the block makes, and parameter views are told apart from activations."
    z = get_model("tiny")
    meta = z.build("meta")
    (tokens,), _ = z.batch(1, 16)
    sv = compiled_saved(meta, "layers.1", *block_call(meta, "layers.1", (tokens.to("meta"),)))
    params = {tuple(p.shape) for p in meta.layers[1].parameters()}
    assert all(tuple(reversed(s.shape)) in params or s.shape in params for s in sv if s.kind == "parameter"), sv
    assert {s.shape for s in sv if s.kind == "input"} == {(16, 8)}        # the RoPE tables: no grad, held once
    assert (1, 16, 64) in {s.shape for s in sv if s.kind == "activation"}  # the residual stream coming in
