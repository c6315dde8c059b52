"""Expert parallelism (issue 32, items 2, 3 and the gloo part of 5). The `ep` row of the axes table borrows its ranks
from dp_shard x cp (torchtitan's ParallelDims), so it is a ParallelDims field, a plan-file key and a CLI pin that adds
no ranks. Applied to the zoo's tiny-moe, each mixture's expert weights are DTensors split on dim 0 over ep, the
routed slots go to the ranks that keep their experts by all-to-all, and FSDP shards the experts over the ranks left
(efsdp). On 4 gloo ranks it trains as one process trains the same global batch, with every all-to-all counted."""
import dataclasses
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from static_dist.fsdp import FSDPPlan, FSDPUnit
from static_dist.launch import launch
from static_dist.parallel import ParallelDims, ParallelPlan, ParallelPlanError
from static_dist.parallel.experts import check_experts
from static_dist.parallel.search import layout_dims
from static_dist.app.layout import layout_pins
from static_dist.zoo import get_model

SOURCE = f"{Path(__file__).parent / 'moe_no_drop.py'}:tiny_moe_no_drop"   # capacity E / top_k: no token dropped
LAYERS = 2                                                                 # tiny-moe: a mixture in each of 2 blocks


def test_ep_borrows_ranks_and_is_checked():
    d = ParallelDims(dp_shard=4, ep=2)
    assert d.world == 4 and d.mesh == ((4,), ("dp_shard",))               # no rank and no mesh dim of its own
    assert ParallelPlan.from_json(ParallelPlan(d).to_json()).dims == d    # the plan file keeps it
    with pytest.raises(ParallelPlanError, match="ep=3 does not divide dp_shard x cp = 4"):
        ParallelDims(dp_shard=2, cp=2, ep=3)
    with pytest.raises(ParallelPlanError, match="not over tp ranks, not with pipeline stages yet"):
        ParallelPlan(ParallelDims(dp_shard=2, tp=2, ep=2))
    pins = dict(dp_replicate=None, dp_shard=4, cp=None, tp=None, pp=None, ep=2)
    assert layout_pins(Namespace(world=4, **pins)) == {"dp_shard": 4, "ep": 2}   # --ep 2 is not 2 more ranks
    with pytest.raises(ParallelPlanError, match="ep=2: the model has no mixture of experts"):
        layout_dims(4, n_blocks=2, node=4, pins={"ep": 2})                   # a dense model (experts=0)
    units = FSDPPlan(4, (4,), (FSDPUnit(""), FSDPUnit("layers.0"), FSDPUnit("layers.1.moe.router")))
    with pytest.raises(ParallelPlanError, match="unit 'layers.1.moe.router' is the experts module layers.1.moe"):
        check_experts(ParallelPlan(d, fsdp=units), get_model("tiny-moe").build("meta"))


_APPLY = r"""
from torch.distributed.device_mesh import init_device_mesh
from static_dist.launch import process_group
from static_dist.parallel import ParallelDims, ParallelPlan, ParallelPlanError, apply_parallel_plan
from static_dist.zoo import get_model

def refused(model, dims, world):
    with process_group(fake_world=world):
        try: apply_parallel_plan(get_model(model).build("meta"), ParallelPlan(dims), seq=32)
        except ParallelPlanError as e: return str(e)

print(refused("tiny", ParallelDims(dp_shard=2, ep=2), 2))
print(refused("tiny-moe", ParallelDims(dp_shard=3, ep=3), 3))
with process_group(fake_world=4, fake_rank=1):
    m = get_model("tiny-moe").build("meta")
    apply_parallel_plan(m, ParallelPlan(ParallelDims(dp_shard=4, ep=2)), seq=32)
    ref = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))   # torchtitan's sparse mesh, by hand
    w, r = m.layers[0].moe.w1, m.layers[0].moe.router.weight
    assert w.device_mesh.mesh_dim_names == ("efsdp", "ep") and w.device_mesh.mesh.tolist() == ref.mesh.tolist()
    assert tuple(w.shape) == (4, 64, 192) and tuple(w.to_local().shape) == (1, 64, 192)   # 4 experts / ep 2 / efsdp 2
    assert r.device_mesh.mesh_dim_names == ("dp_shard_cp",) and tuple(r.to_local().shape) == (1, 64)
print("ok")
"""


def test_apply_refusals_and_layout_under_a_fake_group():
    "ep on a dense model and an ep that splits no mixture evenly are refused in one line; else the experts' layout."
    p = subprocess.run([sys.executable, "-c", _APPLY], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    dense, uneven, ok = p.stdout.strip().splitlines()
    assert dense.startswith("ep=2: the model has no mixture of experts"), dense
    assert uneven.startswith("ep=3 does not divide the 4 experts of layers.0.moe"), uneven
    assert ok == "ok"


def _as_one_process(reps: list, want: list) -> None:
    """Each `run_plans` report of a 3-step gloo run against the single process: losses within 1e-5 relative, trained
    (the loss fell), every rank's parameters close and its collectives per step those of `want` (counted by hand)."""
    for rep, counts in zip(reps, want, strict=True):
        for a, b in zip(rep["losses"], rep["ref_losses"]): assert abs(a - b) <= 1e-5 * abs(b), rep["losses"]
        assert len(rep["losses"]) == 3 and rep["losses"][-1] < rep["losses"][0] - 0.3      # it trained
        for r in rep["ranks"]:
            assert r["error"] is None and r["close"], (r["error"], r.get("max_abs"))
            for c in r["counts"]: assert c == counts, (c, counts)


def test_gloo_ep2_equals_one_process():
    """ep 2 on 4 gloo ranks, with the experts' FSDP over efsdp 2 (dp_shard 4) and over efsdp 1 with HSDP (dp_replicate 2
    x dp_shard 2): 3 SGD steps (plain SGD, so a gradient off by the ep factor shows; Adam would normalise it away)
    give the single process's losses within 1e-5 relative and its parameters, and each step issues 2 all-to-alls
    forward and 2 backward per MoE layer."""
    plans = [ParallelPlan(ParallelDims(dp_shard=4, ep=2)), ParallelPlan(ParallelDims(dp_replicate=2, dp_shard=2, ep=2))]
    reps = launch("static_dist.parallel.run:run_plans", 4, [[SOURCE, p.to_json()] for p in plans],
                  optimizer="sgd", lr=0.5, timeout=600)
    # FSDP units by hand: the root, and per layer the router (dense mesh) and the mixture (experts' mesh)
    units = 1 + 2 * LAYERS
    want = [
        # efsdp 2: each non-root unit gathered in forward and again in backward, the root once; each reduce-scattered
        {"ep.all_to_all": 4 * LAYERS, "dp.all_gather": 1 + 2 * (units - 1), "dp.reduce_scatter": units},
        # efsdp 1: the mixtures are whole on their rank (nothing to gather or scatter), every unit all-reduced
        # over dp_replicate
        {"ep.all_to_all": 4 * LAYERS, "dp.all_gather": 1 + 2 * LAYERS, "dp.reduce_scatter": 1 + LAYERS,
         "dp.all_reduce": units},
    ]
    _as_one_process(reps, want)


def _mixtral(path, **kw):
    "A transformers MixtralConfig (2 layers, top-2) saved to `path`, for an `hf:` source."
    import transformers
    fields = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=256,
                  max_position_embeddings=128)
    transformers.MixtralConfig(**{**fields, **kw}).save_pretrained(path)
    return f"hf:{path}"


def test_gloo_transformers_mixtral_ep_equals_one_process(tmp_path):
    """transformers' Mixtral (dropless: real routing, so uneven all-to-all splits) under ep on 4 gloo ranks, each block
    one FSDP unit with its experts as a second parameter group over efsdp (torchtitan's layout): ep 2 × efsdp 2, HSDP
    dp_replicate 2 × dp_shard 2 with ep 2 (efsdp 1), and ep 4 (efsdp 1). 3 plain-SGD steps give the single process's
    losses within 1e-5 relative and its parameters; per step 5 all-to-alls per mixture (counts, dispatch and combine,
    and backward's two), and FSDP's collectives group by group, counted by hand."""
    units = (FSDPUnit("model.layers.0"), FSDPUnit("model.layers.1"), FSDPUnit(""))
    plans = [ParallelPlan(ParallelDims(dp_shard=4, ep=2), fsdp=FSDPPlan(4, (4,), units)),
             ParallelPlan(ParallelDims(dp_replicate=2, dp_shard=2, ep=2), fsdp=FSDPPlan(4, (2, 2), units)),
             ParallelPlan(ParallelDims(dp_shard=4, ep=4), fsdp=FSDPPlan(4, (4,), units))]
    reps = launch("static_dist.parallel.run:run_plans", 4, [[_mixtral(tmp_path), p.to_json()] for p in plans],
                  optimizer="sgd", lr=0.5, timeout=600)
    a2a = 5 * 2                                                                  # 2 mixtures
    want = [
        # groups: the root's, and per block its dense one and its experts' (over efsdp 2): each gathered forward,
        # the blocks' again backward (the root is not resharded), each reduce-scattered
        {"ep.all_to_all": a2a, "dp.all_gather": 1 + 2 * 2 + 2 * 2, "dp.reduce_scatter": 1 + 2 * 2},
        # efsdp 1: the experts whole on their rank (nothing gathered or scattered); every group all-reduced over
        # dp_replicate
        {"ep.all_to_all": a2a, "dp.all_gather": 1 + 2 + 2, "dp.reduce_scatter": 1 + 2, "dp.all_reduce": 1 + 2 * 2},
        {"ep.all_to_all": a2a, "dp.all_gather": 1 + 2 + 2, "dp.reduce_scatter": 1 + 2},
    ]
    _as_one_process(reps, want)


class _StackedExperts(torch.nn.Module):
    "A mixture not from the zoo: a router and experts stored as 3-D parameters, read from the module tree."
    def __init__(self, dim=16, hidden=32, n_experts=4):
        super().__init__()
        self.top_k, self.gate = 2, torch.nn.Linear(dim, n_experts, bias=False)
        self.w_in = torch.nn.Parameter(torch.zeros(n_experts, dim, hidden))
        self.w_out = torch.nn.Parameter(torch.zeros(n_experts, hidden, dim))


def test_a_mixture_apply_ep_cannot_split_is_named():
    "ep on a mixture of experts other than the zoo's names the mixture (moe.find_moe) and what apply_ep splits."
    m = torch.nn.Sequential(torch.nn.Linear(16, 16), _StackedExperts())
    with pytest.raises(ParallelPlanError, match=r"^ep=2: 1 is a mixture of experts that apply_ep cannot lay out yet"):
        check_experts(ParallelPlan(ParallelDims(dp_shard=2, ep=2)), m)


# Memory and collectives of ep predicted from one capture without it (issue 32, the fake-process-group part of item
# 5): the experts' weights split over ep and FSDP-sharded over the other data-parallel ranks (units of their own, as
# apply_expert_fsdp shards them), the experts step's input slots held beside the all-to-all's copy, and 4 all-to-alls
# per mixture per micro-batch (2 more where a checkpointed block recomputes it). Measured by FSDPMemTracker and
# CommDebugMode on the model apply_parallel_plan lays out under a fake process group of 4 ranks.
@pytest.fixture(scope="module")
def tiny_moe():
    from static_dist.workload import load_workload
    w = load_workload("tiny-moe", batch=2, seq=64)
    return w, {dt: w.graph(dtype=dt) for dt in ("float32", "bfloat16")}


@pytest.mark.parametrize("ep, ac, replicate, dtype", [(2, "none", 1, "float32"), (4, "none", 1, "float32"),
                                                      (2, "none", 1, "bfloat16"), (2, "full", 1, "bfloat16"),
                                                      (2, "selective", 1, "bfloat16"), (2, "none", 2, "bfloat16")])
def test_ep_peak_and_collectives_under_a_fake_group(tiny_moe, ep, ac, replicate, dtype):
    from static_dist.fsdp import block_units
    from static_dist.parallel import verify_parallel
    from static_dist.parallel.reserved import predict_parallel_reserved
    w, graphs = tiny_moe
    g, shard = graphs[dtype], 4 // replicate
    blocks = g.structure.main.blocks
    fsdp = FSDPPlan(4, (replicate, shard) if replicate > 1 else (4,), block_units(blocks),
                    param_dtype=None if dtype == "float32" else dtype)
    plan = ParallelPlan(ParallelDims(dp_replicate=replicate, dp_shard=shard, ep=ep), ac=(ac,) * len(blocks), fsdp=fsdp)
    v = verify_parallel(w, plan, g, master_dtype="float32")
    assert abs(v.predicted_bytes / v.measured_bytes - 1) < 0.01, v
    assert v.predicted_counts == v.measured_counts, v
    # the allocator's replay holds the same expert shards and dispatch buffers; 2%: it frees a prefetched forward
    # all-gather's output at its copy-out (fsdp.reserved), which the allocation model keeps to the next unit's
    st, = predict_parallel_reserved(g, plan, "float32")
    assert abs(st.peak_requested / v.measured_bytes - 1) < 0.02, (st, v)
    assert v.measured_counts["ep.all_to_all"] == 2 * (4 + 2 * (ac != "none"))     # 2 mixtures
    one = verify_parallel(w, dataclasses.replace(plan, dims=dataclasses.replace(plan.dims, ep=1)), g, "float32")
    assert v.measured_bytes < one.measured_bytes                                  # the experts gathered 1/ep


# transformers' mixtures laid out by apply_parallel_plan under a fake process group of 4, the routing forced to the
# balanced split the prediction assumes (RoutedExpertParallel sends each rank its share on fake tensors), each layer an
# FSDP unit, bf16 on fp32 masters: FSDPMemTracker's peak (GroupsMemTracker: a block's two parameter groups) and
# CommDebugMode's counts against the prediction from one capture without ep. The shapes:
# - Mixtral: dim 256, 8 experts of width 512, top-2, 2 layers (written: ep 1 1.0028, ep 2 0.9999, ep 4 0.9941);
# - DeepSeek-V3 16B (deepseek-moe-16b's: dim 2048, MLA, 64 routed experts of width 1408, top-6, 2 shared), its dense
#   first layer and 2 mixtures, captured with the CPU's attention, as the measurement runs it (written: ep 1 1.0000,
#   ep 2 0.9959, ep 4 0.9928).
HF_EP = {
    "mixtral": ("MixtralConfig", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                      num_experts_per_tok=2, vocab_size=512, max_position_embeddings=256)),
    "deepseek-v3-16b": ("DeepseekV3Config", dict(hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                                                 num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=64,
                                                 n_shared_experts=2, num_experts_per_tok=6, n_group=1, topk_group=1,
                                                 num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None,
                                                 kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                                                 v_head_dim=128, vocab_size=102400, max_position_embeddings=4096)),
}


@pytest.fixture(scope="module")
def hf_ep_graphs(tmp_path_factory):
    "{name: (workload, its bf16 capture with the CPU's attention)} of `HF_EP`, captured on first use."
    import transformers
    from static_dist.graph import capture
    from static_dist.workload import load_workload
    made = {}
    def get(name):
        if name not in made:
            cls, fields = HF_EP[name]
            d = tmp_path_factory.mktemp(name)
            getattr(transformers, cls)(**fields).save_pretrained(d)
            w = load_workload(f"hf:{d}", batch=2, seq=64)
            args, kwargs, targets = w.inputs(device="meta", dtype="bfloat16")
            made[name] = w, capture(w.build(device="meta", dtype=torch.bfloat16), args, example_kwargs=kwargs or None,
                                    loss_fn=w.loss, targets=targets, optimizer=w.optimizer, attention="cpu")
        return made[name]
    return get


@pytest.mark.parametrize("name, ep", [("mixtral", 2), ("mixtral", 4), ("deepseek-v3-16b", 2)])
def test_transformers_mixtures_ep_under_a_fake_group(hf_ep_graphs, name, ep):
    from static_dist.parallel import verify_parallel
    w, g = hf_ep_graphs(name)
    n = HF_EP[name][1]["num_hidden_layers"]
    units = (*(FSDPUnit(f"model.layers.{i}") for i in range(n)), FSDPUnit(""))
    plan = ParallelPlan(ParallelDims(dp_shard=4, ep=ep), ac=("none",) * len(g.structure.main.blocks),
                        fsdp=FSDPPlan(4, (4,), units, param_dtype="bfloat16"))
    v = verify_parallel(w, plan, g, master_dtype="float32")
    assert abs(v.ratio - 1) < 0.01, v
    assert v.predicted_counts == v.measured_counts and v.measured_counts["ep.all_to_all"] == 5 * len(g.meta["moe"]), v


def test_a_unit_over_fewer_ranks_is_only_eps():
    from static_dist.fsdp import PlanError, apply_plan
    f = FSDPPlan(4, (4,), (FSDPUnit(""), FSDPUnit("layers.0.moe", shard_size=2)))
    assert FSDPPlan.from_json(f.to_json()) == f                                   # the plan file keeps it
    with pytest.raises(PlanError, match="unit 'layers.0.moe' shards over 2 of the plan's 4 ranks"):
        apply_plan(get_model("tiny-moe").build("meta"), f)


# The ep term of the step time (issue 32, item 4's time), against a hand computation: each mixture dispatches its
# experts step's slots (E x capacity x dim) and combines them back, forward and backward, and once more in a
# checkpointed block's recompute; one all-to-all over p ranks on a link of latency a and bandwidth b takes
# (p - 1)·a + (p - 1)/p · bytes / b (every rank sends a 1/p share to each other rank), on the slowest link the group
# spans (ep 4 over nodes of 2 GPUs: the network).
@pytest.mark.parametrize("ep, ac", [(2, "none"), (2, "full"), (4, "none"), (4, "selective")])
def test_ep_all_to_all_seconds_by_hand(tiny_moe, ep, ac):
    import math
    from static_dist.fsdp import block_units
    from static_dist.parallel import predict_step_time, rank_work
    from static_dist.topology import preset
    _, graphs = tiny_moe
    g = graphs["bfloat16"]
    topo = preset("cluster", n_nodes=4, gpus_per_node=2)
    blocks = g.structure.main.blocks
    plan = lambda e: ParallelPlan(ParallelDims(dp_shard=8, ep=e), ac=(ac,) * len(blocks),
                                  fsdp=FSDPPlan(8, (8,), block_units(blocks)))
    t = predict_step_time(rank_work(g, plan(ep), topo), plan(ep), topo)
    moe = g.meta["moe"]
    link = topo.levels[0 if ep <= 2 else 1].link
    total = 0.0
    for r in moe:
        capacity = math.ceil(r["capacity_factor"] * r["tokens"] * r["top_k"] / r["n_experts"])
        slots = r["n_experts"] * capacity * r["expert_shapes"]["w1"][0] * 2              # bfloat16
        one = (ep - 1) * link.latency + (ep - 1) / ep * slots / link.bandwidth
        total += (4 + 2 * (ac != "none")) * one
    assert t.terms["ep"] == pytest.approx(total, rel=1e-6)
    assert t.comm["ep"] == t.terms["ep"]
    base = predict_step_time(rank_work(g, plan(1), topo), plan(1), topo)
    assert base.terms["ep"] == 0.0
    # E/ep experts over 8/ep ranks: each rank's optimizer updates as many expert bytes as without ep
    assert t.terms["optimizer"] == pytest.approx(base.terms["optimizer"], rel=1e-12)
    assert t.terms["forward"] == base.terms["forward"]                      # balanced routing: the same expert work


def test_the_search_draws_ep_from_dp_shard_and_cp():
    import itertools
    from static_dist.parallel import layout_dims
    got = {(d.dp_replicate, d.dp_shard, d.cp, d.tp, d.pp, d.ep)
           for d in layout_dims(8, n_blocks=4, node=8, heads=4, seq=64, experts=4)}
    want = set()
    for rep, shard, cp, tp, pp in itertools.product(*(range(1, 9),) * 5):
        if rep * shard * cp * tp * pp != 8 or 8 % tp or 4 % tp or pp > 4 or (cp > 1 and (64 % (2 * cp) or pp > 1)):
            continue
        if rep > 1 and shard * cp * tp < 8: continue
        for ep in (1, 2, 4):
            if ep == 1 or (tp == pp == 1 and (shard * cp) % ep == 0): want.add((rep, shard, cp, tp, pp, ep))
    assert got == want
    with pytest.raises(Exception, match="ep=3 does not divide the 4 experts"):
        layout_dims(8, n_blocks=4, node=8, experts=4, pins={"ep": 3})
    with pytest.raises(Exception, match="no mixture of experts"):
        layout_dims(8, n_blocks=4, node=8, pins={"ep": 2})
    assert all(d.ep == 2 and d.tp == d.pp == 1 for d in layout_dims(8, n_blocks=4, node=8, experts=4, pins={"ep": 2}))


# DeepSeek's shape: dense layers before the mixture-of-experts stack (`first_k_dense_replace`), so the stack's blocks
# start at model.layers.1. Capturing 3 of its blocks keeps the dense layer before them and expands the rest; the
# reference is the whole model captured, for ep 1, 2 and 4 under each checkpointing policy.
def test_a_stack_after_dense_layers_expands_as_the_whole_capture(tmp_path):
    import transformers
    from static_dist.fsdp import block_units
    from static_dist.parallel import predict_layout
    from static_dist.parallel.search import layout_reserved_peak, search_graph
    from static_dist.topology import preset
    from static_dist.workload import load_workload
    transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=16,
        q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=1, topk_group=1,
        num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=128).save_pretrained(tmp_path)
    w = load_workload(f"hf:{tmp_path}", batch=2, seq=32, dtype="bfloat16")
    few, n, how = search_graph(w)
    whole = w.graph()
    assert (how, n) == ("3 of 7 blocks captured, the others identical", 7)
    assert few.structure.main.blocks == ("model.layers.1", "model.layers.2", "model.layers.3")
    assert whole.structure.main.blocks == tuple(f"model.layers.{i}" for i in range(1, 8))
    # multi-head latent attention (query head dim 24, value 16): recorded as the GPU's memory-efficient kernel, once
    # per block and pass, not the CPU's math path with its (seq, seq) scores
    att = [o.op for o in whole.ops if "attention" in o.op]
    assert att == ["aten._scaled_dot_product_efficient_attention.default"] * 8 + \
        ["aten._scaled_dot_product_efficient_attention_backward.default"] * 8, att
    assert not any(o.op.startswith("aten._softmax") for o in whole.ops)
    topo = preset("cluster", n_nodes=1, gpus_per_node=4)
    for ep, ac in ((1, "none"), (2, "none"), (4, "full"), (2, "selective")):
        plan = ParallelPlan(ParallelDims(dp_shard=4, ep=ep), ac=(ac,) * n,
                            fsdp=FSDPPlan(4, (4,), block_units(whole.structure.main.blocks)))
        a, b = predict_layout(whole, plan, topo), predict_layout(few, plan, topo, n_blocks=n)
        assert abs(b.memory_bytes / a.memory_bytes - 1) < 1e-4, (ep, ac, a.memory_bytes, b.memory_bytes)
        assert b.time.step_seconds == pytest.approx(a.time.step_seconds, rel=1e-9)
        assert b.time.terms["ep"] == pytest.approx(a.time.terms["ep"], rel=1e-9)
        assert (ep == 1) == (a.time.terms["ep"] == 0)
        ra, rb = layout_reserved_peak(whole, plan), layout_reserved_peak(few, plan, n)   # the allocator's replay too
        assert abs(rb.peak_requested / a.memory_bytes - 1) < 1e-3, (ep, ac, rb.peak_requested, a.memory_bytes)
        assert abs(rb.peak_reserved / ra.peak_reserved - 1) < 0.02, (ep, ac, ra.peak_reserved, rb.peak_reserved)


# Load imbalance (issue 32, item 4): a dropless mixture (transformers' Mixtral, grouped-matmul experts) restated
# at imbalance 2 (`moe.rerouted`). With ep 4 each rank holds one of the 4 experts, so the busiest rank runs twice the
# balanced rows: its all-to-alls move twice the bytes, and the others wait for its experts' matmuls once more. The
# reference: the all-to-all by hand on the node's link, the experts' matmuls found by name (every grouped matmul of
# the step is an expert's) and priced by the one op-time function.
def test_imbalance_by_hand(tmp_path):
    import transformers
    from static_dist.fsdp import block_units
    from static_dist.moe import RoutingError, rerouted
    from static_dist.parallel import predict_layout, predict_parallel_memory
    from static_dist.topology import op_seconds, preset
    from static_dist.workload import load_workload
    transformers.MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=256,
                               max_position_embeddings=128).save_pretrained(tmp_path)
    g = load_workload(f"hf:{tmp_path}", batch=2, seq=64, dtype="bfloat16").graph()
    g2 = dataclasses.replace(g, meta=rerouted(g.meta, "imbalance=2"))
    topo = preset("cluster", n_nodes=1, gpus_per_node=8)
    blocks = g.structure.main.blocks
    plan = lambda ep: ParallelPlan(ParallelDims(dp_shard=8, ep=ep), fsdp=FSDPPlan(8, (8,), block_units(blocks)))
    even, busy = predict_layout(g, plan(4), topo), predict_layout(g2, plan(4), topo)
    link = topo.levels[0].link
    rows = g.meta["moe"][0]["routed"] * 64 * 2                                    # routed rows x dim, bfloat16
    extra_a2a = 2 * 4 * (4 - 1) / 4 * (2 * rows - rows) / link.bandwidth          # 4 per layer, 2 layers
    sec = op_seconds(g, topo)
    experts = sum(sec[i] for i, o in enumerate(g.ops) if o.op.startswith("aten._grouped_mm") and o.phase != "optimizer")
    assert busy.time.terms["ep"] - even.time.terms["ep"] == pytest.approx(extra_a2a + experts, rel=1e-6)
    # without ep a rank runs its own rows however they are routed: nothing moves
    assert predict_layout(g2, plan(1), topo).time.step_seconds == predict_layout(g, plan(1), topo).time.step_seconds
    assert predict_parallel_memory(g2, plan(1)).peak_bytes == predict_parallel_memory(g, plan(1)).peak_bytes
    assert busy.memory_bytes >= even.memory_bytes
    with pytest.raises(RoutingError, match="declares a capacity"):                 # tiny-moe: fixed slots
        rerouted(load_workload("tiny-moe", batch=2, seq=16).graph().meta, "imbalance=2")


def _titan_moe_case(job: str, layers: int, **degrees):
    """(torchtitan's own run of `job` cut to `layers` under a fake process group, as tests/titan_moe_fake.py measures
    it at `degrees` (dp_shard, ep, tp); the cut job; its capture; the plan `static-dist plan --torchtitan` reads for
    it)."""
    import json
    import warnings
    from static_dist.graph import capture
    from static_dist.titan import titan_job, titan_loss, titan_model, titan_plan
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in degrees.items()]
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("titan_moe_fake.py")), "--job", job,
                          "--layers", str(layers), *flags], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    cut = titan_job(job, layers=layers, seq_len=64, local_batch=2, ac="none", param_dtype="bfloat16",
                    loss_chunks=0, **degrees)                              # the measurement's loss: whole logits
    model = titan_model(cut, dtype=torch.bfloat16)
    tokens = torch.randint(0, cut.vocab, (2, 64), device="meta")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="In CPU autocast")
        # attention="cpu": the measurement runs on this CPU, whose SDPA takes its math path for MLA (query head dim
        # 192, value 128); on a GPU (the default capture) the memory-efficient kernel keeps no (seq, seq) scores
        g = capture(model, tokens, targets=tokens, loss_fn=titan_loss, optimizer="adamw", attention="cpu")
    world = degrees.get("dp_shard", 1) * degrees.get("tp", 1)
    return json.loads(run.stdout), cut, g, titan_plan(cut, g, world)


# torchtitan's own mixture-of-experts jobs, cut to their first layers, laid out by their own parallelize at
# ep 2 × dp_shard 4 under a fake process group (tests/titan_moe_fake.py: the token dispatcher's all-to-alls, FSDP with
# each block's experts as a second parameter group over efsdp; routing forced balanced by torchtitan's own debug
# switch), one step after a warm-up, against static_dist's prediction from a capture of the same model without ep:
# - deepseek_v3_16b, 3 layers: one dense, then 2 mixtures of 64 experts of hidden 1408, top-6, 2 shared; dim 2048, MLA
#   (0.993 when written; its debug model, 8 experts of width 256: 0.978, 2.2% short in the backward's activations and
#   temporaries, not yet traced);
# - qwen3_30b_a3b, 2 layers: 2 mixtures of 128 experts of hidden 768, top-8, no shared expert; dim 2048, GQA (0.998;
#   marked slow, 30 s, for CI's 45 minutes: `pytest -m slow tests/test_expert_parallel.py` runs it).
@pytest.mark.parametrize("job, layers", [("deepseek_v3_16b", 3),
                                         pytest.param("qwen3_30b_a3b", 2, marks=pytest.mark.slow)])
def test_torchtitan_moe_job_ep_under_a_fake_group(job, layers):
    """The layout `static-dist plan --torchtitan` reads for the job (`titan_job` cut as the measurement cuts it, and
    `titan_plan`: every layer a unit, the dense first one too) predicts torchtitan's own run of it."""
    from static_dist.fsdp import FSDPUnit
    from static_dist.parallel import predict_parallel_memory, rank_profile
    from static_dist.parallel.verify import predict_axis_counts
    measured, cut, g, plan = _titan_moe_case(job, layers, dp_shard=4, ep=2)
    units = (FSDPUnit("tok_embeddings"), *(FSDPUnit(f"layers.{i}") for i in range(layers)),
             FSDPUnit("norm", False, group=("lm_head",)), FSDPUnit("", False))        # torchtitan's, by hand
    assert (plan.dims, plan.fsdp.units, plan.fsdp.param_dtype, plan.fsdp.reduce_dtype) == (
        ParallelDims(dp_shard=4, ep=2), units, "bfloat16", "float32"), plan
    predicted = predict_parallel_memory(g, plan, "float32").peak_bytes
    counts = predict_axis_counts(rank_profile(g, plan, 0, "float32"), plan)
    got = measured["comm_counts"]
    assert counts == {"dp.all_gather": got["_allgather_base_"], "dp.reduce_scatter": got["_reduce_scatter_base_"],
                      "ep.all_to_all": got["all_to_all_single"]}, (counts, got)
    assert abs(predicted / measured["peak_bytes_total"] - 1) < 0.01, (predicted, measured["peak_bytes_by_category"])


# `static-dist plan --routing imbalance=F` prices the layouts under that routing (issue 32, item 4's "effect shown"):
# with one expert per ep rank the busiest rank runs F times the rows, so the ep term grows; a mixture with a declared
# capacity (tiny-moe) is refused in one line.
def test_plan_routing_flag(tmp_path):
    import re
    import transformers
    transformers.MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=256,
                               max_position_embeddings=128).save_pretrained(tmp_path)
    def ep_ms(*extra):
        p = subprocess.run([sys.executable, "-m", "static_dist.app", "plan", "--model", f"hf:{tmp_path}", "--world",
                            "8", "--ep", "4", "--batch", "2", "--seq", "64", "--dtype", "bfloat16", *extra],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        return float(re.search(r"^\s*ep\s+([\d.]+)\s", p.stdout, re.M).group(1)), p.stdout
    even, _ = ep_ms()
    busy, out = ep_ms("--routing", "imbalance=2")
    assert busy > 1.5 * even and "routing imbalance=2" in out, (even, busy)
    p = subprocess.run([sys.executable, "-m", "static_dist.app", "plan", "--model", "tiny-moe", "--world", "8", "--ep",
                        "2", "--routing", "imbalance=2"], capture_output=True, text=True, timeout=300)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "declares a capacity" in lines[0], p.stderr[-2000:]


# Tensor parallelism inside the experts (issue 32, item 2), torchtitan 0.3.0's layout with ep off
# (`moe_sharding.py`'s dense family): each expert's weights split on their intermediate features over tp, the router
# replicated, the mixture's output reduced once. The styles are the search's own (`tp_layout`).
def _tp_plan(g, sequence: bool, ac: str, param_dtype=None) -> ParallelPlan:
    from static_dist.fsdp import block_units
    from static_dist.parallel import tp_layout
    from static_dist.placement import block_spec, megatron_styles
    styles, outer, sp = tp_layout(g, tuple(megatron_styles(block_spec(g)).items()), sequence)
    blocks = g.structure.main.blocks
    return ParallelPlan(ParallelDims(dp_shard=2, tp=2), tp_styles=styles, sequence_parallel=sp,
                        loss_parallel=bool(outer), tp_outer=outer, ac=(ac,) * len(blocks),
                        fsdp=FSDPPlan(2, (2,), block_units(blocks), param_dtype=param_dtype))


@pytest.mark.parametrize("model, sequence, ac", [("tiny-moe", False, "none"), ("tiny-moe", True, "full"),
                                                 ("mixtral", False, "none"), ("deepseek-v3-16b", False, "full")])
def test_tp_inside_experts_under_a_fake_group(tiny_moe, hf_ep_graphs, model, sequence, ac):
    """dp_shard 2 x tp 2 under a fake process group of 4: the predicted peak within 1% of FSDPMemTracker's and the
    collectives CommDebugMode counts exactly (tp's included: the mixture's reductions and its router's gradient
    all-reduce), the allocator replay's requested peak within 2%; each expert weight held at half its intermediate
    features before FSDP shards it (the rank profile's parameter shapes against the captured ones)."""
    from static_dist.parallel import verify_parallel
    from static_dist.parallel.memory import tp_mixtures
    from static_dist.parallel.reserved import predict_parallel_reserved
    w, g = (tiny_moe[0], tiny_moe[1]["float32"]) if model == "tiny-moe" else hf_ep_graphs(model)
    plan = _tp_plan(g, sequence, ac, None if model == "tiny-moe" else "bfloat16")
    assert plan.sequence_parallel == sequence
    mixed = tp_mixtures(g, plan, g.structure.main.blocks)
    assert len(mixed) == len(g.meta["moe"])                                    # every mixture of the step split
    from static_dist.cost.profile import param_infos
    from static_dist.parallel import rank_profile
    whole = {p.name: p.shape for p in param_infos(g)[0]}
    local = {p.name: p.shape for p in rank_profile(g, plan, 0, "float32").params}
    for _, _, dims in mixed.values():
        for w_, d in dims.items():
            assert local[w_][d] * 2 == whole[w_][d] and local[w_][:d] == whole[w_][:d], (w_, local[w_], whole[w_])
    v = verify_parallel(w, plan, g, master_dtype="float32")
    assert abs(v.ratio - 1) < 0.01, v
    assert v.predicted_counts == v.measured_counts, v
    st, = predict_parallel_reserved(g, plan, "float32")
    assert abs(st.peak_requested / v.measured_bytes - 1) < 0.02, (st, v)


def test_gloo_tp_inside_experts_equals_one_process(tmp_path):
    """dp_shard 2 x tp 2 on 4 gloo ranks: transformers' Mixtral (dropless, its real routing; sequence parallelism is
    refused for it: it builds positions from the embeddings' shape) and the zoo's mixture (capacity slots) with
    sequence and loss parallelism. 3 plain-SGD steps give the single process's losses within 1e-5 relative and its
    parameters; the collectives per step, counted by hand per block: without sequence parallelism q, k and v's input
    gradients all-reduced, o's output, the mixture's output and its input's gradient, and the router's weight
    gradient (7 all-reduces); with it each sub-layer (attention, mixture) gathers its input and reduce-scatters its
    output, and the converse backward (4 all-gathers, 4 reduce-scatters), plus per step the embedding's and final
    norm's pair, the 3 loss-parallel all-reduces, the norms' and routers' weight gradients (5 + 2)."""
    att = (("self_attn.q_proj", "colwise"), ("self_attn.k_proj", "colwise"), ("self_attn.v_proj", "colwise"),
           ("self_attn.o_proj", "rowwise"))
    units = (FSDPUnit("model.layers.0"), FSDPUnit("model.layers.1"), FSDPUnit(""))
    mixtral = ParallelPlan(ParallelDims(dp_shard=2, tp=2), tp_styles=att, fsdp=FSDPPlan(2, (2,), units))
    zoo = ParallelPlan(ParallelDims(dp_shard=2, tp=2), sequence_parallel=True, loss_parallel=True,
                       tp_styles=tuple((f"attention.{n}", "rowwise" if n == "wo" else "colwise")
                                       for n in ("wq", "wk", "wv", "wo")),
                       tp_outer=(("tok_embeddings", "embedding"), ("norm", "norm"), ("output", "output")),
                       fsdp=FSDPPlan(2, (2,), (FSDPUnit("layers.0"), FSDPUnit("layers.1"), FSDPUnit(""))))
    reps = launch("static_dist.parallel.run:run_plans", 4, [[_mixtral(tmp_path), mixtral.to_json()],
                                                            [SOURCE, zoo.to_json()]],
                  optimizer="sgd", lr=0.5, timeout=600)
    dp = {"dp.all_gather": 1 + 2 * 2, "dp.reduce_scatter": 3}                    # 3 units: the root gathered once
    want = [{**dp, "tp.all_reduce": 7 * 2},
            {**dp, "tp.all_gather": 4 * 2 + 2, "tp.reduce_scatter": 4 * 2 + 2, "tp.all_reduce": 3 + 5 + 2}]
    _as_one_process(reps, want)


LAYERS_OF_TWO = ((0, "model.layers.0"), (1, "model.layers.1"))   # a 2-layer transformers model's blocks


def test_tp_inside_experts_refusals(tmp_path):
    """A mixture tensor parallelism cannot split inside is named with what to do: features tp does not divide, and
    gpt-oss's experts (interleaved [gate; up] columns, biases after the row-parallel product)."""
    import transformers
    from static_dist.parallel.experts import check_expert_tp
    from static_dist.workload import load_workload
    att = (("self_attn.q_proj", "colwise"), ("self_attn.o_proj", "rowwise"))
    odd = load_workload(_mixtral(tmp_path / "odd", intermediate_size=94), batch=2, seq=16).build(device="meta")
    with pytest.raises(ParallelPlanError, match=r"^tp=4 does not divide the 94 intermediate features of "
                                                r"model.layers.0.mlp.s down_proj: use a tp dividing 94"):
        check_expert_tp(ParallelPlan(ParallelDims(dp_shard=1, tp=4), tp_styles=att), odd, LAYERS_OF_TWO)
    transformers.GptOssConfig(hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                              vocab_size=256, max_position_embeddings=4096).save_pretrained(tmp_path / "oss")
    oss = load_workload(f"hf:{tmp_path / 'oss'}", batch=2, seq=16).build(device="meta")
    with pytest.raises(ParallelPlanError, match=r"^tp=2 inside the experts of model.layers.0.mlp: GptOssExperts has "
                                                r"expert biases \(gate_up_proj_bias, down_proj_bias\)"):
        check_expert_tp(ParallelPlan(ParallelDims(dp_shard=1, tp=2), tp_styles=att), oss, LAYERS_OF_TWO)


# torchtitan 0.3.0's own tensor parallelism of a mixture-of-experts job (its `moe_sharding.py` dense family: sequence
# and loss parallelism, each expert split on its intermediate features, the router replicated, q/k norms replicated
# over the heads), tp 2 × dp_shard 2, qwen3_30b_a3b cut to 2 layers, under a fake process group
# (tests/titan_moe_fake.py --tp 2 --ep 1; routing forced balanced), against the prediction for the job as
# `static-dist plan --torchtitan` reads it. Memory: 0.9977 when written. Collectives: FSDP's and every all-reduce
# exact; torchtitan's backward makes each mixture's input gradient replicated before it cuts the sequence shard (the
# partial sum of the routed experts' and the router's gradients: a reduce-scatter and an all-gather of the whole
# activation, DTensor's Partial -> Replicate), one more of each per mixture than static_dist's layout (one
# reduce-scatter onto the sequence), which the prediction describes.
def test_torchtitan_moe_job_tp_under_a_fake_group():
    from static_dist.parallel import predict_parallel_memory, rank_profile
    from static_dist.parallel.verify import predict_axis_counts
    layers = 2
    measured, cut, g, plan = _titan_moe_case("qwen3_30b_a3b", layers, dp_shard=2, tp=2, ep=1)
    assert (plan.dims, plan.sequence_parallel, plan.loss_parallel) == (ParallelDims(dp_shard=2, tp=2), True, True)
    predicted = predict_parallel_memory(g, plan, "float32").peak_bytes
    counts = predict_axis_counts(rank_profile(g, plan, 0, "float32"), plan)
    got = measured["comm_counts"]
    assert counts == {"dp.all_gather": got["_allgather_base_"], "dp.reduce_scatter": got["_reduce_scatter_base_"],
                      "tp.all_gather": got["all_gather_into_tensor"] - layers,
                      "tp.reduce_scatter": got["reduce_scatter_tensor"] - layers,
                      "tp.all_reduce": got["all_reduce"]}, (counts, got)
    assert abs(predicted / measured["peak_bytes_total"] - 1) < 0.01, (predicted, measured["peak_bytes_by_category"])
