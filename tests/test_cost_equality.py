"""One time model: `plan-fsdp`'s prediction (fsdp.predict_memory + fsdp.predict_step) and `plan`'s
(parallel.predict_parallel_memory + parallel.predict_step_time) of the same FSDP layout (every block its own unit plus
the root; no TP, CP or PP) give the same peak memory and the same step time. The two sides read the captured step
separately (fsdp: `profile_graph`'s per-op arrays and `layout`; parallel: `rank_work` from the graph itself) and
schedule their own segments, so a change to one side's op times shows up as a difference (the second test)."""
import dataclasses

import pytest
import torch

from static_dist.cost import profile_graph
from static_dist.fsdp import CostModel, FSDPPlan, FSDPUnit, predict_memory, predict_step
from static_dist.cost.few_blocks import first_blocks
from static_dist.parallel import ParallelDims, ParallelPlan, predict_parallel_memory, predict_step_time, rank_work
from static_dist.structure import find_structure
from static_dist.topology import preset
from static_dist.workload import load_workload

LAYOUTS = [dict(world=8, dtype="float32", k=1), dict(world=16, dtype="bfloat16", k=2)]


def _graph(source: str, dtype: str):
    "The step of `source` captured on fake tensors, the zoo's 8B cut to its first 3 blocks."
    w = load_workload(source, batch=1, seq=128, dtype=dtype)
    if source == "llama3-8b":
        build = w.build
        stack = find_structure(build(device="meta")).main.path
        cut = lambda device="meta", dtype=torch.float32: first_blocks(build(device=device, dtype=dtype), stack, 3)
        w = dataclasses.replace(w, build=cut)
    return w.graph()


@pytest.fixture(scope="module", params=["llama3-8b", "hf"])
def graphs(request, hf_tiny_llama):
    source = hf_tiny_llama if request.param == "hf" else request.param
    return {d: _graph(source, d) for d in ("float32", "bfloat16")}


def _both(g, world: int, k: int):
    "(fsdp peak, fsdp step seconds, parallel peak, parallel step seconds) of the per-block layout on `world` H100s."
    units = (FSDPUnit(""), *(FSDPUnit(b) for b in g.structure.main.blocks))
    fp = FSDPPlan(world, (world,), units, accumulation_steps=k)
    topo = preset("cluster", n_nodes=max(world // 8, 1), gpus_per_node=min(world, 8))
    prof = profile_graph(g)
    pp = ParallelPlan(ParallelDims(dp_shard=world), fsdp=fp)
    return (predict_memory(prof, fp).peak_bytes, predict_step(prof, fp, CostModel(topo)).step_seconds,
            predict_parallel_memory(g, pp).peak_bytes, predict_step_time(rank_work(g, pp, topo), pp, topo).step_seconds)


@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda l: f"w{l['world']}-{l['dtype']}-k{l['k']}")
def test_plan_fsdp_and_plan_agree(graphs, lay):
    g = graphs[lay["dtype"]]
    mf, tf, mp, tp = _both(g, lay["world"], lay["k"])
    assert len(g.structure.main.blocks) >= 2 and mf > 0 and tf > 0
    assert mf == mp, (mf, mp)
    assert tp == pytest.approx(tf, rel=1e-6), (tf, tp)


def test_one_side_changed_alone_differs(graphs, monkeypatch):
    """5% more op time on either side alone (each through the name that side calls) breaks the agreement (at the
    sourced H100 efficiencies the 8-rank step is partly communication, so 5% of op time shows as more than 0.5%)."""
    import static_dist.fsdp.steptime as fst
    import static_dist.parallel.time as pt
    g = graphs["float32"]
    _, tf, _, tp = _both(g, 8, 1)
    assert tp == pytest.approx(tf, rel=1e-6)
    slow_work, slow_op = fst.work_seconds, pt.op_seconds
    with monkeypatch.context() as m:
        m.setattr(fst, "work_seconds", lambda *a, **kw: slow_work(*a, **kw) * 1.05)
        _, tf2, _, tp2 = _both(g, 8, 1)
    assert tp2 == pytest.approx(tp, rel=1e-9) and tf2 > tf * 1.005, (tf, tf2, tp, tp2)
    with monkeypatch.context() as m:
        m.setattr(pt, "op_seconds", lambda *a, **kw: slow_op(*a, **kw) * 1.05)
        _, tf3, _, tp3 = _both(g, 8, 1)
    assert tf3 == pytest.approx(tf, rel=1e-9) and tp3 > tp * 1.005, (tf, tf3, tp, tp3)
