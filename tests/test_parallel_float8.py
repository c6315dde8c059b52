"""Float8 layouts (torchao's converters) predicted against what PyTorch and torchao allocate and communicate: the
converted model applied with `apply_parallel_plan` under a fake process group, measured by FSDPMemTracker and
CommDebugMode (`verify_parallel`)."""
import pytest

pytest.importorskip("torchao")

from static_dist.fsdp import FSDPPlan, block_units
from static_dist.parallel import ParallelDims, ParallelPlan, verify_parallel
from static_dist.parallel.float8 import float8_workload
from static_dist.workload import load_workload


@pytest.mark.parametrize("recipe,all_gather", [("tensorwise", True), ("rowwise", False)])
def test_float8_fsdp_layout_matches_fsdpmemtracker(recipe, all_gather):
    w = load_workload("small", batch=2, seq=128, dtype="bfloat16")
    g = float8_workload(w, recipe).graph("bfloat16")
    plan = ParallelPlan(ParallelDims(dp_shard=4), fsdp=FSDPPlan(4, (4,), block_units(g.structure.main.blocks)),
                        float8=recipe, float8_all_gather=all_gather)
    v = verify_parallel(w, plan, graph=g)
    assert abs(v.predicted_bytes - v.measured_bytes) <= 0.001 * v.measured_bytes, v.line()
    assert v.predicted_counts == v.measured_counts        # with the float8 all-gather: each weight's amax all-reduce
    if all_gather: assert v.measured_counts["dp.all_reduce"] > 0
