"Placement: ILPs against brute force on random small problems, and the plan applied with torchrun (4 gloo ranks)."
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import Phase, given, settings, strategies as st

from static_dist.graph import capture
from static_dist.placement import (MEGATRON, ModuleGroups, brute_force_plan, check_pipeline, check_plan, evaluate_plan,
                                   llama_block_spec, module_groups, place_brute_force, place_greedy, place_ilp,
                                   search_plan)
from static_dist.topology import MeshSpec, preset
from static_dist.zoo import get_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny():
    zm = get_model("tiny"); m = zm.build(device="meta"); x, y = zm.batch(2, 64)
    g = capture(m, x, loss_fn=zm.loss, targets=y, optimizer="adamw")
    return g, m.cfg


@settings(max_examples=25, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(st.integers(2, 6), st.integers(0, 2**32 - 1), st.sampled_from(["pcie-box", "cpu-2socket"]), st.booleans())
def test_graph_ilp_matches_brute_force(G, seed, topo_name, pipeline):
    import numpy as np
    rng = np.random.default_rng(seed)
    topo = preset(topo_name, **({"n_gpus": 4} if topo_name == "pcie-box" else {"ranks_per_socket": 2}))
    mem = tuple(int(x) for x in rng.integers(1, 100, G))
    edges = tuple((i, j, int(rng.integers(1, 10**9))) for i in range(G) for j in range(i + 1, G) if rng.random() < 0.5)
    mg = ModuleGroups(tuple(f"g{i}" for i in range(G)), tuple(int(x) for x in rng.integers(10**9, 10**13, G)), mem, edges)
    topo = dataclasses.replace(topo, device_memory=int(max(mem) + rng.integers(0, sum(mem))))
    try:
        bf = place_brute_force(mg, topo, pipeline=pipeline)
    except ValueError:   # nothing fits: the ILP must say so too
        with pytest.raises(ValueError, match="no placement fits"):
            place_ilp(mg, topo, pipeline=pipeline)
        return
    ilp = place_ilp(mg, topo, pipeline=pipeline)
    if pipeline: assert check_pipeline(mg, ilp.devices) == []
    assert ilp.cost == pytest.approx(bf.cost, rel=1e-6, abs=1e-12)
    assert ilp.fits
    gr = place_greedy(mg, topo)
    if gr.fits and not pipeline: assert gr.cost >= ilp.cost * (1 - 1e-9)
    if gr.fits and pipeline: assert gr.cost >= ilp.cost * (1 - 1e-9) and check_pipeline(mg, gr.devices) == []


def test_module_groups_edges_are_the_hidden_state(tiny):
    g, cfg = tiny
    mg = module_groups(g)
    hidden = 2 * 64 * cfg.dim * 4
    assert mg.edges == ((0, 1, 2 * hidden), (1, 2, 2 * hidden), (2, 3, 2 * hidden), (3, 4, 2 * hidden))
    assert sum(mg.flops) > 0 and all(m > 0 for m in mg.memory)


@settings(max_examples=12, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])   # no slow shrinking
@given(st.sampled_from([("cpu-2socket", (2, 2)), ("dgx-h100", (2, 4)), ("dgx-h100", (4, 2)), ("pcie-box", (4, 2))]),
       st.floats(0.0, 1.5), st.floats(0.05, 1.0))
def test_sharding_ilp_matches_brute_force(tiny, case, slack, eff):
    g, cfg = tiny
    spec = llama_block_spec(g, cfg)
    name, shape = case
    topo = preset(name, **({"ranks_per_socket": 2} if name == "cpu-2socket" else {}))
    mesh = MeshSpec(shape, ("dp", "tp"))
    meg = evaluate_plan(spec, MEGATRON, topo, mesh)
    budget = meg.memory * (1 + slack) if not check_plan(spec, MEGATRON, mesh) else None
    try:
        ref = brute_force_plan(spec, topo, mesh, efficiency=eff, memory_budget=budget)
    except ValueError:
        with pytest.raises(ValueError, match="no sharding plan fits"):
            search_plan(spec, topo, mesh, efficiency=eff, memory_budget=budget, allow_dp_shard=False)
        return
    got = search_plan(spec, topo, mesh, efficiency=eff, memory_budget=budget, allow_dp_shard=False)
    assert got.seconds == pytest.approx(ref.seconds, rel=1e-9)
    assert check_plan(spec, {n: s for n, s, _ in got.styles}, mesh) == []


def test_dp_sharding_chosen_only_under_memory_pressure(tiny):
    g, cfg = tiny
    spec = llama_block_spec(g, cfg)
    topo, mesh = preset("dgx-h100"), MeshSpec((4, 2), ("dp", "tp"))
    roomy = search_plan(spec, topo, mesh)
    assert not any(f for *_, f in roomy.styles)
    meg = evaluate_plan(spec, MEGATRON, topo, mesh)
    tight = search_plan(spec, topo, mesh, memory_budget=meg.memory / 2)
    assert any(f for *_, f in tight.styles) and tight.memory <= meg.memory / 2 + 1


def test_torchrun_plans_match_single_process(tmp_path):
    "4 gloo ranks, 2x2 mesh: found / Megatron / mixed plans vs one process; CommDebugMode and bytes vs prediction."
    from static_dist.launch import launch
    r = launch(f"{ROOT / 'tests' / 'dist_placement_tp.py'}:main", 4, timeout=300)
    for label in ("found", "megatron", "mixed", "found_fsdp"):
        x = r[label]
        assert x["out_err"] < 1e-5 and x["grad_err"] < 1e-6, (label, x["out_err"], x["grad_err"])
        assert x["counts"] == x["predicted_counts"], label
        assert x["bytes"] == x["predicted_bytes"], label
        assert x["dp_grad_bytes"] == x["predicted_dp_bytes"], label
    assert r["found"]["predicted_seconds"] <= r["megatron"]["predicted_seconds"] * (1 + 1e-9)
    assert sum(r["mixed"]["counts"].values()) > 0 and "c10d_functional.all_gather_into_tensor" in r["mixed"]["counts"]
    assert "c10d._reduce_scatter_base_" in r["found_fsdp"]["counts"]   # FSDP2 really ran on the dp dim
    bad = r["bad_plan"]
    assert bad["caught"] and any("residual add" in v for v in bad["caught"])
    assert bad["torch_error"] is not None   # the unchecked plan really fails inside torch
