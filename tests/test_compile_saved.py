"""`compiled_saved_bytes` (the partitioner on fake tensors) against what autograd keeps for a block compiled by Inductor
on CPU, and `compile_effects`' eager side against the same block run eagerly."""
import os

import pytest
import torch

from static_dist.compile.apply import block_inputs
from static_dist.compile.saved import block_call, compile_effects, compiled_saved, compiled_saved_bytes
from static_dist.graph import capture
from static_dist.zoo import get_model
from saved_bytes import CACHE, measured_saved



@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)])
def test_compiled_block_saves_what_the_partitioner_predicts(monkeypatch, dtype):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(CACHE))
    z = get_model("tiny")
    real, meta = z.build("cpu", dtype=dtype), z.build("meta", dtype=dtype)
    (tokens,), targets = z.batch(2, 64)
    ra, rk = block_inputs(real, ["layers.0"], (tokens,))["layers.0"]
    ra = (ra[0].requires_grad_(True), *ra[1:])                   # the residual stream needs grad, as in training
    predicted = compiled_saved_bytes(meta, "layers.0", *block_call(meta, "layers.0", (tokens.to("meta"),)))
    eager = measured_saved(real.layers[0], real, ra, rk)
    torch._dynamo.reset()
    compiled = measured_saved(torch.compile(real.layers[0], backend="inductor"), real, ra, rk)
    torch._dynamo.reset()
    assert compiled == predicted, (compiled, predicted, eager)
    assert compiled < eager, (compiled, eager)       # compile recomputes cheap chains that eager saves
    g = capture(meta, (tokens,), loss_fn=z.loss, targets=targets)
    fx = compile_effects(g, meta, (tokens.to("meta"),))
    want = [("layers.0", eager, compiled), ("layers.1", eager, compiled)]
    assert [(b.block, b.eager, b.compiled) for b in fx] == want


def test_saved_values_are_the_compiled_forwards_outputs():
    "Every saved value's shape is one the block makes, and parameter views are told apart from activations."
    z = get_model("tiny")
    meta = z.build("meta")
    (tokens,), _ = z.batch(1, 16)
    sv = compiled_saved(meta, "layers.1", *block_call(meta, "layers.1", (tokens.to("meta"),)))
    params = {tuple(p.shape) for p in meta.layers[1].parameters()}
    assert all(tuple(reversed(s.shape)) in params or s.shape in params for s in sv if s.kind == "parameter"), sv
    assert {s.shape for s in sv if s.kind == "constant"} == {(16, 8)}     # the RoPE tables: no grad, held once
    assert [s.shape for s in sv if s.kind == "input"] == [(1, 16, 64)]     # the residual stream coming in


@pytest.mark.slow
def test_hf_block_saves_what_the_partitioner_predicts(monkeypatch):
    """A Hugging Face Llama layer (RoPE tables and position ids as keyword inputs, computed in the forward): predicted
    from `block_call` on the real model, measured on its Inductor-compiled layer."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(CACHE))
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, use_cache=False)
    torch.manual_seed(0)
    model, tokens = transformers.LlamaForCausalLM(cfg), torch.randint(0, 256, (2, 32))
    args, kwargs = block_call(model, "model.layers.0", (tokens,))
    predicted = compiled_saved_bytes(model, "model.layers.0", args, kwargs)
    layer = model.model.layers[0]
    eager = measured_saved(lambda *a, **k: layer(*a, **k), model, args, kwargs)
    torch._dynamo.reset()
    compiled = measured_saved(torch.compile(layer, backend="inductor"), model, args, kwargs)
    torch._dynamo.reset()
    assert compiled == predicted < eager, (compiled, predicted, eager)
