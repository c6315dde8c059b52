"""Placement on models nobody here wrote: the block spec and module groups read from the module tree and the
captured dataflow (GPT-style blocks at `transformer.h` with a fused qkv; Hugging Face Llama at `model.layers`)."""
import sys
from pathlib import Path

import pytest
import torch

from static_dist.graph import capture
from static_dist.placement import (MEGATRON, NoRepeatedBlocksError, block_spec, brute_force_plan, check_sharding_plan,
                                   llama_block_spec, megatron_styles, module_groups, search_plan)
from static_dist.topology import MeshSpec, op_seconds, preset
from static_dist.errors import StaticDistError
from static_dist.zoo import get_model

sys.path.insert(0, str(Path(__file__).parent))
from gpt_model import build_gpt, gpt_loss  # noqa: E402

X = torch.randint(0, 512, (2, 64))
TOPO, MESH = preset("cpu-2socket", ranks_per_socket=2), MeshSpec((2, 2), ("dp", "tp"))


@pytest.fixture(scope="module")
def gpt_graph():
    return capture(build_gpt(3), X, loss_fn=gpt_loss, targets=X, optimizer="adamw")


@pytest.fixture(scope="module")
def hf_graph():
    import transformers   # the `hf` extra (a dev dependency)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, use_cache=False)
    with torch.device("meta"): m = transformers.LlamaForCausalLM(cfg)
    return capture(m, example_kwargs=dict(input_ids=X, labels=X), loss_fn=lambda o: o.loss, optimizer="adamw")


def test_zoo_llama_spec_equals_the_config_one():
    zm = get_model("tiny")
    m = zm.build(device="meta")
    x, y = zm.batch(2, 64)
    g = capture(m, x, loss_fn=zm.loss, targets=y, optimizer="adamw")
    spec = block_spec(g, TOPO)
    assert spec == llama_block_spec(g, m.cfg, TOPO)
    assert megatron_styles(spec) == MEGATRON


def test_gpt_fused_qkv_at_transformer_h(gpt_graph):
    spec = block_spec(gpt_graph, TOPO)
    assert (spec.prefix, spec.n_layers) == ("transformer.h", 3)
    assert spec.chains == ((("attn.qkv",), "attn.proj"), (("mlp.fc",), "mlp.proj"))
    qkv, proj, fc, out = (spec.linear(n) for n in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"))
    d, B, T = 128, 2, 64
    assert (qkv.in_features, qkv.out_features, qkv.fused, qkv.out_heads) == (d, 3 * d, 3, 12)
    assert (proj.in_heads, fc.out_heads, fc.out_features, out.in_features) == (4, 0, 4 * d, 4 * d)
    assert (qkv.in_bytes, qkv.out_bytes, fc.out_bytes) == (B * T * d * 4, B * T * 3 * d * 4, B * T * 4 * d * 4)
    # its time: the time model's seconds of its forward ops and of the backward ops on its weight, bias or their
    # gradients (autograd runs those outside the module's backward scope); among them the three matmuls
    fqn = "transformer.h.0.attn.qkv"
    ids = {s.id for s in gpt_graph.storages if s.name.removesuffix(".grad") in (f"{fqn}.weight", f"{fqn}.bias")}
    ops = [i for i, o in enumerate(gpt_graph.ops) if (o.phase == "forward" and o.module == fqn)
           or (o.phase == "backward" and {gpt_graph.tensors[t].storage for t in o.inputs + o.outputs} & ids)]
    assert [gpt_graph.ops[i].flops for i in ops if gpt_graph.ops[i].flops] == [2 * (B * T) * d * (3 * d)] * 3
    assert qkv.seconds == pytest.approx(sum(op_seconds(gpt_graph, TOPO)[i] for i in ops), rel=1e-12)
    naive = {"attn.qkv": "colwise", "attn.proj": "rowwise", "mlp.fc": "colwise", "mlp.proj": "rowwise"}
    vs = check_sharding_plan(spec, naive, MESH)  # column shards of a fused qkv split q, k and v apart
    assert [v.check for v in vs] == ["fused projections"]
    meg = megatron_styles(spec)                                 # so Megatron's rule keeps that chain whole
    assert meg == {"attn.qkv": "replicate", "attn.proj": "replicate", "mlp.fc": "colwise", "mlp.proj": "rowwise"}
    assert check_sharding_plan(spec, meg, MESH) == []
    found = search_plan(spec, TOPO, MESH, allow_dp_shard=False)
    assert found.style("attn.qkv") not in ("colwise", "colwise_gather")
    assert check_sharding_plan(spec, {n: s for n, s, _ in found.styles}, MESH) == []
    assert found.seconds == pytest.approx(brute_force_plan(spec, TOPO, MESH).seconds, rel=1e-9)
    assert set(found.parallelize_plan()) <= {f"transformer.h.{i}.{l.name}" for i in range(3) for l in spec.linears}


def test_hf_llama_at_model_layers(hf_graph):
    spec = block_spec(hf_graph, TOPO)
    assert (spec.prefix, spec.n_layers) == ("model.layers", 3)
    assert spec.chains == ((("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn.o_proj"),
                           (("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj"))
    heads = {l.name: (l.in_heads, l.out_heads) for l in spec.linears}
    assert heads == {
        "self_attn.q_proj": (0, 4),
        "self_attn.k_proj": (0, 2),
        "self_attn.v_proj": (0, 2),
        "self_attn.o_proj": (4, 0),
        "mlp.gate_proj": (0, 0),
        "mlp.up_proj": (0, 0),
        "mlp.down_proj": (0, 0),
    }
    assert check_sharding_plan(spec, megatron_styles(spec), MESH) == []
    found = search_plan(spec, TOPO, MESH, allow_dp_shard=False)
    assert found.seconds == pytest.approx(brute_force_plan(spec, TOPO, MESH).seconds, rel=1e-9)
    # 2 kv heads over tp=4 cannot be split: column-sharding k/v is refused
    vs = check_sharding_plan(spec, megatron_styles(spec), MeshSpec((1, 4), ("dp", "tp")))
    assert {v.module for v in vs if v.check == "divisibility"} == {"model.layers.*.self_attn.k_proj",
                                                                     "model.layers.*.self_attn.v_proj"}


def test_module_groups_split_nested_stacks(gpt_graph, hf_graph):
    mg = module_groups(gpt_graph, TOPO)
    assert mg.names == ("transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1", "transformer.h.2",
                        "transformer.ln_f", "lm_head")
    hidden = 2 * (2 * 64 * 128 * 4)                               # the hidden state and its gradient
    assert [(a, b) for a, b, _ in mg.edges][1:] == [(2, 3), (3, 4), (4, 5), (5, 6)]
    assert {n for *_, n in mg.edges} == {hidden}
    hf = module_groups(hf_graph, TOPO)
    assert [n for n in hf.names if n.startswith("model.layers")] == [f"model.layers.{i}" for i in range(3)]
    assert len(hf.names) > 5


def test_no_repeated_blocks_is_a_typed_one_line_error():
    zm = get_model("mlp")
    x, y = zm.batch(4)
    g = capture(zm.build(device="meta"), x, loss_fn=zm.loss, targets=y)
    with pytest.raises(NoRepeatedBlocksError) as e:
        block_spec(g)
    assert isinstance(e.value, StaticDistError) and isinstance(e.value, ValueError)
    assert str(e.value).startswith("no repeated blocks: placement needs a model with a stack of identical blocks")
    assert "\n" not in str(e.value)


# ---- sharding plan files: a typed error or exactly what the file says
from hypothesis import Phase, given, settings, strategies as st  # noqa: E402

from static_dist.placement import PlacementError, ShardingPlan  # noqa: E402

_VALID = dict(prefix="model.layers", n_layers=3, mesh=dict(shape=[2, 2], names=["dp", "tp"]), tp_dim="tp",
              styles=[["self_attn.q_proj", "colwise", False], ["self_attn.o_proj", "rowwise", True]], seconds=0.5,
              comm_bytes=1024, memory=2048.0, method="ilp", solve_seconds=0.01)
_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(["tp", "dp", "colwise", "diagonal"]),
    st.just([]),
    st.just({}),
    st.lists(st.integers(-1, 4), max_size=3),
    st.just([["a", "colwise", 1]]),
    st.just(dict(shape=[4], names=["tp"])),
    st.just(dict(shape=[2.0, 2], names=["dp", "tp"])),
)


def _same(given, loaded, path=""):
    if isinstance(given, dict):
        for k, v in given.items(): _same(v, loaded[k], f"{path}.{k}")
    elif isinstance(given, (list, tuple)):
        assert len(given) == len(loaded), path
        for i, (a, b) in enumerate(zip(given, loaded)): _same(a, b, f"{path}[{i}]")
    else:
        assert given == loaded and type(given) is type(loaded), (path, given, loaded)


@settings(max_examples=300, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(data=st.data())
def test_mutated_sharding_plans(data):
    import json
    d = json.loads(json.dumps(_VALID))
    for _ in range(data.draw(st.integers(1, 3))):
        target = d["mesh"] if isinstance(d.get("mesh"), dict) and data.draw(st.booleans()) else d
        key = data.draw(st.sampled_from(sorted(target) + ["extra"]))
        if data.draw(st.integers(0, 4)) == 0: target.pop(key, None)
        else:
            target[key] = json.loads(
                json.dumps(data.draw(_VALUES))
            )  # a copy: st.just's dict is shared by every example
    try:
        plan = ShardingPlan.from_dict(d)
    except PlacementError as e:
        assert str(e) and isinstance(e, StaticDistError)
        return
    _same(d, json.loads(json.dumps(plan.to_dict())))


def test_hf_gpt2_conv1d_is_never_tensor_parallel(tmp_path):
    "transformers' GPT-2 uses Conv1D, which ColwiseParallel/RowwiseParallel refuse: the styles keep it replicated."
    transformers = pytest.importorskip("transformers")
    from static_dist.workload import load_workload
    transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=128).save_pretrained(tmp_path)
    spec = block_spec(load_workload(f"hf:{tmp_path / 'config.json'}", batch=2, seq=32).graph())
    assert spec.linears and not any(l.shardable for l in spec.linears)
    assert set(megatron_styles(spec).values()) == {"replicate"}
    assert "module type" in [v.check for v in check_sharding_plan(spec, {spec.linears[-1].name: "rowwise"}, MESH)]
