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
from static_dist.parallel.apply import check_experts
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
    with pytest.raises(ParallelPlanError, match="no tensor parallelism inside experts"):
        ParallelPlan(ParallelDims(dp_shard=2, tp=2, ep=2))
    pins = dict(dp_replicate=None, dp_shard=4, cp=None, tp=None, pp=None, ep=2)
    assert layout_pins(Namespace(world=4, **pins)) == {"dp_shard": 4, "ep": 2}   # --ep 2 is not 2 more ranks
    with pytest.raises(ParallelPlanError, match="does not price expert parallelism"):
        layout_dims(4, n_blocks=2, node=4, pins={"ep": 2})
    units = FSDPPlan(4, (4,), (FSDPUnit(""), FSDPUnit("layers.0"), FSDPUnit("layers.1.moe.router")))
    with pytest.raises(ParallelPlanError, match="unit 'layers.1.moe.router' is the mixture of experts layers.1.moe"):
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
    for rep, counts in zip(reps, want):
        assert len(rep["losses"]) == 3
        for a, b in zip(rep["losses"], rep["ref_losses"]): assert abs(a - b) <= 1e-5 * abs(b), rep["losses"]
        assert rep["losses"][-1] < rep["losses"][0] - 0.3                    # it trained
        for r in rep["ranks"]:
            assert r["error"] is None and r["close"], (r["error"], r.get("max_abs"))
            for c in r["counts"]: assert c == counts, (c, counts)


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
    w, graphs = tiny_moe
    g, shard = graphs[dtype], 4 // replicate
    blocks = g.structure.main.blocks
    fsdp = FSDPPlan(4, (replicate, shard) if replicate > 1 else (4,), block_units(blocks),
                    param_dtype=None if dtype == "float32" else dtype)
    plan = ParallelPlan(ParallelDims(dp_replicate=replicate, dp_shard=shard, ep=ep), ac=(ac,) * len(blocks), fsdp=fsdp)
    v = verify_parallel(w, plan, g, master_dtype="float32")
    assert abs(v.predicted_bytes / v.measured_bytes - 1) < 0.01, v
    assert v.predicted_counts == v.measured_counts, v
    assert v.measured_counts["ep.all_to_all"] == 2 * (4 + 2 * (ac != "none"))     # 2 mixtures
    one = verify_parallel(w, dataclasses.replace(plan, dims=dataclasses.replace(plan.dims, ep=1)), g, "float32")
    assert v.measured_bytes < one.measured_bytes                                  # the experts gathered 1/ep


def test_a_unit_over_fewer_ranks_is_only_eps():
    from static_dist.fsdp import PlanError, apply_plan
    f = FSDPPlan(4, (4,), (FSDPUnit(""), FSDPUnit("layers.0.moe", shard_size=2)))
    assert FSDPPlan.from_json(f.to_json()) == f                                   # the plan file keeps it
    with pytest.raises(PlanError, match="unit 'layers.0.moe' shards over 2 of the plan's 4 ranks"):
        apply_plan(get_model("tiny-moe").build("meta"), f)
