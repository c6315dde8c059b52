"Placement: ILPs against brute force on random small problems, and the plan applied with torchrun (4 gloo ranks)."
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import Phase, given, settings, strategies as st

from static_dist.graph import capture
from static_dist.placement import (
    MEGATRON,
    ModuleGroups,
    block_spec,
    brute_force_plan,
    check_pipeline,
    check_sharding_plan,
    choice_cost,
    evaluate_plan,
    llama_block_spec,
    module_groups,
    place_brute_force,
    place_greedy,
    place_ilp,
    search_plan,
)
from static_dist.topology import MeshSpec, op_seconds, preset
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
    mg = ModuleGroups(tuple(f"g{i}" for i in range(G)), tuple(float(x) for x in rng.uniform(1e-5, 5e-2, G)), mem, edges)
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
    mg = module_groups(g, preset("dgx-h100"))
    hidden = 2 * 64 * cfg.dim * 4
    assert mg.edges == ((0, 1, 2 * hidden), (1, 2, 2 * hidden), (2, 3, 2 * hidden), (3, 4, 2 * hidden))
    assert sum(mg.seconds) > 0 and all(m > 0 for m in mg.memory)


@settings(max_examples=12, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])   # no slow shrinking
@given(st.sampled_from([("cpu-2socket", (2, 2)), ("dgx-h100", (2, 4)), ("dgx-h100", (4, 2)), ("pcie-box", (4, 2))]),
       st.floats(0.0, 1.5))
def test_sharding_ilp_matches_brute_force(tiny, case, slack):
    g, cfg = tiny
    name, shape = case
    topo = preset(name, **({"ranks_per_socket": 2} if name == "cpu-2socket" else {}))
    spec = llama_block_spec(g, cfg, topo)
    mesh = MeshSpec(shape, ("dp", "tp"))
    meg = evaluate_plan(spec, MEGATRON, topo, mesh)
    budget = meg.memory * (1 + slack) if not check_sharding_plan(spec, MEGATRON, mesh) else None
    try:
        ref = brute_force_plan(spec, topo, mesh, memory_budget=budget)
    except ValueError:
        with pytest.raises(ValueError, match="no sharding plan fits"):
            search_plan(spec, topo, mesh, memory_budget=budget, allow_dp_shard=False)
        return
    got = search_plan(spec, topo, mesh, memory_budget=budget, allow_dp_shard=False)
    assert got.seconds == pytest.approx(ref.seconds, rel=1e-9)
    assert check_sharding_plan(spec, {n: s for n, s, _ in got.styles}, mesh) == []


def test_dp_sharding_chosen_only_under_memory_pressure(tiny):
    g, cfg = tiny
    topo, mesh = preset("dgx-h100"), MeshSpec((4, 2), ("dp", "tp"))
    spec = llama_block_spec(g, cfg, topo)
    roomy = search_plan(spec, topo, mesh)
    assert not any(f for *_, f in roomy.styles)
    meg = evaluate_plan(spec, MEGATRON, topo, mesh)
    tight = search_plan(spec, topo, mesh, memory_budget=meg.memory / 2)
    assert any(f for *_, f in tight.styles) and tight.memory <= meg.memory / 2 + 1


# ---- placement reads the one memory model and the one time model


class _Block(torch.nn.Module):
    "Two linears around a ReLU, with a residual: a repeated block with one producer -> consumer chain."
    def __init__(self, d: int, bias: bool):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d, bias=bias), torch.nn.Linear(4 * d, d, bias=bias)

    def forward(self, x): return x + self.fc2(torch.relu(self.fc1(x)))


class _Net(torch.nn.Module):
    "An embedding (frozen: no gradient, no optimizer state), two blocks and a head."
    def __init__(self, d: int = 32, vocab: int = 64, bias: bool = True, frozen: bool = True):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.emb.weight.requires_grad_(not frozen)
        self.layers = torch.nn.ModuleList(_Block(d, bias) for _ in range(2))
        self.head = torch.nn.Linear(d, vocab, bias=bias)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.layers: x = b(x)
        return self.head(x)


def _net_graph(optimizer, dtype=torch.float32, bias=True, frozen=True):
    with torch.device("meta"): m = _Net(bias=bias, frozen=frozen).to(dtype)
    idx = torch.randint(0, 64, (2, 16))
    loss = lambda out, y: torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), y.flatten())
    opt = optimizer(m) if callable(optimizer) else optimizer
    return capture(m, idx, loss_fn=loss, targets=idx, optimizer=opt)


@pytest.mark.parametrize("optimizer,state_per_param", [
    (lambda m: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1), 0),   # no momentum: no state
    ("adam", 2)])                                                                                # exp_avg, exp_avg_sq
def test_linear_memory_is_its_parameters_gradients_and_optimizer_state(optimizer, state_per_param):
    "Hand count from the tensors: fc1's weight (128 x 32) and bias (128) in fp32, a gradient each, and the state."
    g = _net_graph(optimizer)
    topo, mesh = preset("dgx-h100"), MeshSpec((4, 2), ("dp", "tp"))
    spec = block_spec(g, topo)
    numel = 128 * 32 + 128
    steps = 2 * 4 if state_per_param else 0                      # Adam's step counter: a 4-byte scalar per tensor
    hand = 4 * numel * (2 + state_per_param) + steps
    assert spec.linear("fc1").state_bytes == hand
    # what the search charges for it, replicated and then sharded over tp = 2 and dp = 4
    assert choice_cost(spec.linear("fc1"), "replicate", False, topo, mesh).memory == hand
    assert choice_cost(spec.linear("fc1"), "colwise", True, topo, mesh).memory == pytest.approx(hand / 2 / 4)
    # the frozen embedding holds no gradient and no state: a whole-model bytes-per-parameter factor would dilute it
    plan = evaluate_plan(spec, {"fc1": "replicate", "fc2": "replicate"}, topo, mesh)
    fc2 = 4 * (32 * 128 + 32) * (2 + state_per_param) + steps
    assert plan.memory == 2 * (hand + fc2)


def _own_ops(g, fqn: str) -> list[int]:
    "The test's own reading of a linear's ops: its forward ops, and backward ops on its weight's or bias's storages."
    names = {f"{fqn}.weight", f"{fqn}.bias", f"{fqn}.weight.grad", f"{fqn}.bias.grad"}
    ids = {s.id for s in g.storages if s.name in names}
    return [i for i, o in enumerate(g.ops) if (o.phase == "forward" and o.module == fqn) or
            (o.phase == "backward" and {g.tensors[t].storage for t in o.inputs + o.outputs} & ids)]


@pytest.mark.parametrize("bias", [False, True])
def test_linear_time_is_the_op_time_model_of_its_ops(bias):
    "fp32 and bf16 linears: their seconds are `op_seconds` summed over their forward and backward ops, halved on tp 2."
    topo, mesh = preset("dgx-h100"), MeshSpec((4, 2), ("dp", "tp"))
    seconds = {}
    for dtype in (torch.float32, torch.bfloat16):
        g = _net_graph("sgd", dtype, bias, frozen=False)     # a trainable input: autograd computes fc1's dX too
        ops, secs = _own_ops(g, "layers.0.fc1"), op_seconds(g, topo)
        # its three matmuls (forward, dX, dW), each 2 x 32 tokens x 32 x 128 FLOPs, are among them
        assert sorted(g.ops[i].flops for i in ops if g.ops[i].flops) == [2 * 32 * 32 * 128] * 3
        lin = block_spec(g, topo).linear("fc1")
        assert lin.seconds == pytest.approx(sum(secs[i] for i in ops), rel=1e-12)
        halved = choice_cost(lin, "colwise", False, topo, mesh).compute_seconds
        assert halved == pytest.approx(lin.seconds / 2, rel=1e-12)
        seconds[dtype] = lin.seconds
    assert seconds[torch.bfloat16] < seconds[torch.float32]     # the same FLOPs, half the bytes


def test_module_group_costs_are_the_models(tiny):
    "A block's group: its ops' seconds, and its parameters + gradients + optimizer state + saved activations."
    g, _ = tiny
    topo = preset("pcie-box", n_gpus=4)
    mg = module_groups(g, topo)
    b = mg.names.index("layers.1")
    secs = op_seconds(g, topo)
    assert mg.seconds[b] == pytest.approx(sum(secs[i] for i, o in enumerate(g.ops) if o.phase != "optimizer"
                                              and (o.module + ".").startswith("layers.1.")), rel=1e-12)
    own = sum(s.nbytes for s in g.storages if s.role in ("parameter", "gradient", "optimizer_state")
              and s.name.startswith("layers.1."))
    saved = sum(s.nbytes for s in g.storages if s.role == "activation" and (s.saved_in or "").startswith("layers.1"))
    assert mg.memory[b] == own + saved


def test_an_unpriced_or_mispriced_block_is_refused(tiny):
    g, cfg = tiny
    mesh = MeshSpec((4, 2), ("dp", "tp"))
    with pytest.raises(ValueError, match=r"block_spec\(graph, topo\)"):
        search_plan(llama_block_spec(g, cfg), preset("dgx-h100"), mesh)
    with pytest.raises(ValueError, match="priced on"):
        search_plan(llama_block_spec(g, cfg, preset("pcie-box")), preset("dgx-h100"), mesh)


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
