"""FSDP planning on models nobody here wrote: blocks found from the module tree, `expand_blocks` checked against full
captures (GPT-style at `transformer.h`, Hugging Face Llama at `model.layers`), fixed plans, plan files fuzzed, and
predictions verified with FSDPMemTracker under a fake process group."""
import math
import dataclasses
import copy
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import Phase, given, settings, strategies as st

from static_dist.cost import (
    BlockMismatchError,
    PlanError,
    expand_profile,
    block_mismatch,
    expand_blocks,
    profile_expanded,
    profile_graph,
    profile_workload,
)
from static_dist.fsdp import (
    FSDPPlan,
    FSDPUnit,
    Overrides,
    apply_plan,
    candidate_unit_sets,
    plan_fsdp,
    predict_comms,
    predict_memory,
    predict_plan,
    validate,
    verify_plan,
)
from static_dist.graph import capture
from static_dist.errors import StaticDistError
from static_dist.graph.policies import FullCheckpoint, NoCheckpoint
from static_dist.workload import load_workload
from static_dist.zoo import PRESETS, Llama

sys.path.insert(0, str(Path(__file__).parent))
from gpt_model import build_gpt, gpt_loss  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
X = torch.randint(0, 512, (2, 64))
Y = torch.randint(0, 512, (2, 64))


def gpt_profile(n_layer, dtype=torch.float32, master=None):
    g = capture(build_gpt(n_layer, dtype=dtype), X, loss_fn=gpt_loss, targets=Y, optimizer="adamw")
    return profile_graph(g, master)


def ac_plans(prefix, n, world):
    "Per-block units; activation checkpointing on none, the first 3 and the first 5 of `n` blocks."
    for ac in (0, 3, 5):
        units = (FSDPUnit(""), *(FSDPUnit(f"{prefix}.{i}", True, "full" if i < ac else "none") for i in range(n)))
        yield ac, FSDPPlan(world, (world,), units, param_dtype="bfloat16", reduce_dtype="float32")


@pytest.fixture(scope="module")
def gpt():
    return gpt_profile(3), gpt_profile(8)


def test_blocks_come_from_the_structure(gpt):
    p3, _ = gpt
    assert p3.stack == "transformer.h" and p3.blocks == tuple(f"transformer.h.{i}" for i in range(3))
    sets = candidate_unit_sets(p3)
    assert sets["blocks"] == ("", "transformer.h.0", "transformer.h.1", "transformer.h.2")
    assert "transformer.h.0.attn" in sets["sub-blocks+ends"]
    # the tied input/output embedding is seen in the graph (the embedding op reads lm_head.weight): no set splits it
    assert p3.tied == (("lm_head.weight", "transformer.wte.weight"),)
    assert not any({"lm_head", "transformer.wte"} & set(s) for s in sets.values())
    for W in (8, 64):
        for budget in (2**30, 2**21):
            plan = plan_fsdp(p3, world_size=W, budget=budget).plan
            validate(plan, None, build_gpt(3))        # the model itself shows the tie: the plan keeps it whole


def test_expand_blocks_matches_full_capture_on_gpt(gpt):
    "GPT built with 3 and with 8 blocks: the expanded 3-block profile predicts what the 8-block capture does."
    p3, p8 = gpt
    assert block_mismatch(p3) == []
    e8, how = profile_expanded(lambda: p3, lambda: p8, 8)
    assert how == "expanded 3 captured blocks to 8"
    for W in (8, 64, 1024):
        for ac, plan in ac_plans("transformer.h", 8, W):
            a, b = predict_memory(e8, plan).peak_bytes, predict_memory(p8, plan).peak_bytes
            assert abs(a / b - 1) < 0.01, (W, ac, a, b)
            assert predict_comms(e8, plan) == predict_comms(p8, plan)


@pytest.fixture(scope="module")
def hf_llama():
    import transformers   # the `hf` extra; a dev dependency, so a missing one fails here instead of skipping
    def prof(n):
        cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=n,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                       max_position_embeddings=256, use_cache=False)
        with torch.device("meta"): m = transformers.LlamaForCausalLM(cfg)
        g = capture(m, example_kwargs=dict(input_ids=X, labels=Y), loss_fn=lambda out: out.loss, optimizer="adamw")
        return profile_graph(g)
    return prof(3), prof(8)


def test_expand_blocks_accepts_hf_llama(hf_llama):
    """HF Llama's block 0 differs from the others only in what the expansion keeps as captured (it saves the RoPE
    tables every block reads, and frees nothing made before it): 3 captured blocks stand for 8, and predict what the
    full capture predicts, with and without checkpointing."""
    p3, p8 = hf_llama
    assert p3.stack == "model.layers" and len(p3.blocks) == 3
    assert block_mismatch(p3) == []
    e8 = expand_blocks(p3, 8)
    got, how = profile_expanded(lambda: p3, lambda: p8, 8)
    assert got.path == e8.path == "expanded from 3 of 8 blocks", how
    for ac, plan in ac_plans("model.layers", 8, 64):
        a, b = predict_memory(e8, plan).peak_bytes, predict_memory(p8, plan).peak_bytes
        assert a == b, (ac, a, b)


def test_fixed_plan_is_evaluated_as_written(gpt):
    p3, _ = gpt
    units = (FSDPUnit(""), *(FSDPUnit(b, i % 2 == 0) for i, b in enumerate(p3.blocks)))
    plan = FSDPPlan(8, (8,), units, forward_prefetch=0, backward_prefetch=1, name="mine")
    rep = plan_fsdp(p3, world_size=8, budget=2**30, overrides=Overrides(plan=plan))
    bare = dataclasses.replace(
        rep.plan, reasons=(), units=tuple(dataclasses.replace(u, reason="") for u in rep.plan.units)
    )
    assert bare == plan and rep.evaluated == 1 and "pinned" in rep.notes[0]     # exactly as given, with reasons added
    assert rep.memory.peak_bytes == predict_memory(p3, plan).peak_bytes
    assert (
        rep.step.counts == predict_comms(p3, plan) == {"all_gather": 4 + 2, "reduce_scatter": 4, "all_reduce": 0}
    )  # 2 blocks re-gather
    assert predict_plan(p3, FSDPPlan.from_json(plan.to_json())).memory.peak_bytes == rep.memory.peak_bytes
    # a searched plan for the same profile is free to differ; the pinned one is not
    assert plan_fsdp(p3, world_size=8, budget=2**30).plan != plan


def test_apply_plan_refuses_before_sharding():
    m = build_gpt(3)
    plan = FSDPPlan(8, (8,), (FSDPUnit(""), FSDPUnit("transformer.h.9")))
    with pytest.raises(PlanError, match="'transformer.h.9' is not in the model"):
        apply_plan(m, plan, mesh=None)
    assert not any(hasattr(mod, "_get_fsdp_state") for mod in m.modules())     # nothing was sharded
    tied = FSDPPlan(8, (8,), (FSDPUnit(""), FSDPUnit("transformer.wte"), FSDPUnit("lm_head")))
    with pytest.raises(PlanError, match="one parameter in two units"):
        apply_plan(m, tied, mesh=None)


# ---- plan files: every mutation of a valid file is a typed error, or loads exactly what the file says
VALID = FSDPPlan(8, (2, 4), (FSDPUnit(""), FSDPUnit("transformer.h.0", 2, "full", "r"),
                             FSDPUnit("transformer.h.1", False),
                             FSDPUnit("transformer.h.2")), ignored=("transformer.wpe",), param_dtype="bfloat16",
                 reduce_dtype="float32", forward_prefetch=2, accumulation_steps=2, reasons=(("units", "x"),)).to_dict()
VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, 2, 3, 4, 8, -1, 2**24 + 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(
        [
            "",
            "transformer.h.0",
            "float64",
            "bfloat16",
            "static_dist.graph/2",
            "static_dist.fsdp_plan/2",
            "full",
            "none",
            "selective",
            "layers",
        ]
    ),
    st.lists(st.integers(-2, 9), max_size=3),
    st.just({}),
    st.just([]),
    st.just([{"module": ""}]),
    st.just(["x", "y"]),
)


def _subset(given, loaded, path="") -> None:
    "Everything the file says is what was loaded (no silent coercion, nothing dropped)."
    if isinstance(given, dict):
        for k, v in given.items(): _subset(v, loaded[k], f"{path}.{k}")
    elif isinstance(given, list):
        assert len(given) == len(loaded), path
        for i, (a, b) in enumerate(zip(given, loaded)): _subset(a, b, f"{path}[{i}]")
    else:
        assert given == loaded and type(given) is type(loaded), (path, given, loaded)


def _check(text: str, prof) -> None:
    try:
        plan = FSDPPlan.from_json(text)
        validate(plan, prof)
    except PlanError as e:
        assert str(e) and "\n" not in str(e).split(": ", 1)[0]
        return
    given = json.loads(text)
    for u in given.get("units", []):
        # a root unit's `true` loads as `false` (FSDPUnit): older files wrote `true` for a root that fully_shard's
        # default (None) never reshards after forward (FSDPState._lazy_init), and `false` is what apply_plan runs
        if u.get("module") == "" and u.get("reshard_after_forward") is True: u["reshard_after_forward"] = False
    _subset(given, json.loads(plan.to_json()))


_PROF = []


def small_profile():
    "One 3-block GPT profile for the fuzz tests (a module global keeps it out of hypothesis' reports)."
    if not _PROF: _PROF.append(gpt_profile(3))
    return _PROF[0]


@settings(max_examples=300, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(data=st.data())
def test_mutated_plan_files(data):
    p3 = small_profile()
    d = json.loads(json.dumps(VALID))
    for _ in range(data.draw(st.integers(1, 3))):
        target, units = d, d.get("units")
        if isinstance(units, list) and units and isinstance(units[0], dict) and data.draw(st.booleans()):
            target = units[data.draw(st.integers(0, len(units) - 1))]
            if not isinstance(target, dict): continue
        key = data.draw(st.sampled_from(sorted(target) + ["extra"]))
        if data.draw(st.integers(0, 4)) == 0: target.pop(key, None)
        else: target[key] = copy.deepcopy(data.draw(VALUES))   # st.just's objects are shared between draws
    _check(json.dumps(d), p3)


@settings(max_examples=200, deadline=None)
@given(pos=st.integers(0, 10**6), ch=st.sampled_from(list('{}[]",:0129-tfn .eE')))
def test_corrupted_plan_text(pos, ch):
    text = json.dumps(VALID)
    pos %= len(text)
    _check(text[:pos] + ch + text[pos + 1:], small_profile())


# ---- plan files written before a unit's checkpointing was a policy object: "activation_checkpointing": true/false.
# The text is what the version before the change wrote for this plan (`FSDPPlan.to_json`, indentation dropped).
OLD_PLAN = """{"world_size": 8, "mesh_shape": [8], "units": [
 {"module": "", "reshard_after_forward": true, "activation_checkpointing": false, "reason": ""},
 {"module": "transformer.h.0", "reshard_after_forward": true, "activation_checkpointing": true,
  "reason": "checkpointed"},
 {"module": "transformer.h.1", "reshard_after_forward": 2, "activation_checkpointing": false, "reason": ""}],
 "ignored": [], "param_dtype": null, "reduce_dtype": null, "forward_prefetch": 1, "backward_prefetch": 1,
 "accumulation_steps": 1, "sync_every_microbatch": false, "name": "plan", "reasons": [],
 "schema": "static_dist.fsdp_plan/1"}"""


def test_plan_file_with_the_old_checkpointing_key_loads_to_the_same_units():
    plan = FSDPPlan.from_json(OLD_PLAN)
    assert plan.units == (FSDPUnit(""), FSDPUnit("transformer.h.0", True, FullCheckpoint(), "checkpointed"),
                          FSDPUnit("transformer.h.1", 2, NoCheckpoint()))
    validate(plan, small_profile())
    new = json.loads(plan.to_json())
    assert [u["checkpoint"] for u in new["units"]] == ["none", "full", "none"]     # written in the policy's JSON form
    assert "activation_checkpointing" not in new["units"][1]
    assert FSDPPlan.from_dict(new) == plan
    with pytest.raises(PlanError, match=r"units\[1\].checkpoint: 'selective': an FSDP unit is checkpointed whole"):
        FSDPPlan.from_dict({**new, "units": [new["units"][0], {**new["units"][1], "checkpoint": "selective"}]})


# ---- FSDPMemTracker under a fake process group (a subprocess each: one process group per process)
def _run(code: str, timeout=900) -> dict:
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_verify_plan_gpt_with_tied_embeddings():
    r = _run("""
import json, sys, torch; sys.path.insert(0, 'tests')
from gpt_model import build_gpt, gpt_loss
from static_dist.cost import profile_graph
from static_dist.fsdp import FSDPPlan, FSDPUnit, verify_plan
from static_dist.graph import capture
x = torch.randint(0, 512, (2, 64)); y = torch.randint(0, 512, (2, 64))
prof = profile_graph(capture(build_gpt(4), x, loss_fn=gpt_loss, targets=y, optimizer="adamw"))
units = (FSDPUnit(""), *(FSDPUnit(b, True, "full" if i < 2 else "none") for i, b in enumerate(prof.blocks)))
v = verify_plan(lambda: build_gpt(4), FSDPPlan(8, (8,), units, forward_prefetch=0), prof, (x,), targets=y,
                loss_fn=gpt_loss)
print(json.dumps(v.to_dict()))""")
    print(f"gpt (4 blocks, tied, AC on 2) world 8: predicted {r['predicted_bytes']:,} / measured "
          f"{r['measured_bytes']:,} = {r['ratio']:.4f}")
    assert abs(r["ratio"] - 1) < 0.05 and r["counts_match"], r


LLAMA3_8B = """
import json, sys, time, torch, transformers
from static_dist.cost import profile_graph
from static_dist.fsdp import FSDPPlan, FSDPUnit, verify_plan
from static_dist.graph import capture
W = [int(w) for w in sys.argv[1:]] or [64, 1024]
cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                               num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, use_cache=False)
def build(dtype=torch.float32):
    with torch.device("meta"): return transformers.LlamaForCausalLM(cfg).to(dtype)
ids = torch.randint(0, 128256, (1, SEQ))
t0 = time.perf_counter()
g = capture(build(torch.bfloat16), example_kwargs=dict(input_ids=ids, labels=ids), loss_fn=lambda o: o.loss,
            optimizer="adamw")
prof = profile_graph(g, master_dtype="float32")
t1 = time.perf_counter()
out = dict(capture_seconds=t1 - t0, blocks=len(prof.blocks), stack=prof.stack, runs=[])
for w in W:
    plan = FSDPPlan(w, (w,), (FSDPUnit(""), *(FSDPUnit(b) for b in prof.blocks)), forward_prefetch=0,
                    param_dtype="bfloat16", reduce_dtype="float32")
    v = verify_plan(build, plan, prof, kwargs=dict(input_ids=ids, labels=ids), loss_fn=lambda o: o.loss)
    out["runs"].append(v.to_dict())
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.parametrize("world", [64, 1024])
def test_llama3_8b_per_block_within_5_percent(world):
    "The issue's done-when: Llama 3 8B through transformers, per-block units, bf16 compute / fp32 masters."
    t0 = time.perf_counter()
    r = _run(LLAMA3_8B.replace("SEQ", "4096").replace("sys.argv[1:]", f"[{world}]"), timeout=1800)
    v = r["runs"][0]
    print(f"llama3-8b world {world}: predicted {v['predicted_bytes'] / 2**30:.2f} GiB / measured "
          f"{v['measured_bytes'] / 2**30:.2f} GiB = {v['ratio']:.4f}; counts {v['measured_counts']}; capture "
          f"{r['capture_seconds']:.0f} s, total {time.perf_counter() - t0:.0f} s")
    assert r["blocks"] == 32 and r["stack"] == "model.layers"
    assert abs(v["ratio"] - 1) < 0.05 and v["counts_match"], v


def _examples_gpt(n_layer, checkpoint=()):
    "examples/gpt.py (the chapter's model: tied embeddings, optional model-level activation checkpointing)."
    import importlib.util
    spec = importlib.util.spec_from_file_location("examples_gpt", ROOT / "examples" / "gpt.py")
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    with torch.device("meta"): m = mod.GPT(mod.GPTConfig(n_layer=n_layer, checkpoint=checkpoint))
    return profile_graph(capture(m, X, loss_fn=gpt_loss, targets=Y, optimizer="adamw"))


def test_expand_blocks_on_examples_gpt():
    """The example model, 3 vs 8 blocks: expansion agrees within 1% with AC plans; with checkpoint=(0,) inside the
    model the captured blocks differ, so it refuses and the fallback is the full capture."""
    p3, p8 = _examples_gpt(3), _examples_gpt(8)
    e8, how = profile_expanded(lambda: p3, lambda: p8, 8)
    assert how.startswith("expanded")
    for ac, plan in ac_plans("transformer.h", 8, 64):
        a, b = predict_memory(e8, plan).peak_bytes, predict_memory(p8, plan).peak_bytes
        print(f"examples/gpt.py ac={ac}: expanded {a:,} vs full {b:,} ({a / b - 1:+.4%})")
        assert abs(a / b - 1) < 0.01
    c3, c8 = _examples_gpt(3, (0,)), _examples_gpt(8, (0,))
    got, how = profile_expanded(lambda: c3, lambda: c8, 8)
    assert got is c8 and how.startswith("fell back to full capture: block 0"), how
    print(how)


# ---- profile_workload: the fast path (3 blocks captured, expanded) against the full capture of the same workload
def _deep_small(n_layers):
    """The `small` preset with `n_layers` blocks, as a workload `build` (meta only: the fake capture builds nothing
    else)."""
    def build(device="meta", dtype=torch.float32):
        assert str(device) == "meta", device
        with torch.device("meta"): return Llama(dataclasses.replace(PRESETS["small"], n_layers=n_layers)).to(dtype)
    return build


def _same_plans(fast, full, worlds, budgets):
    "Every (world, budget): plan_fsdp chooses the same plan with the same predicted peak and step time from both."
    for W in worlds:
        for budget in budgets:
            a = plan_fsdp(fast, world_size=W, budget=budget)
            b = plan_fsdp(full, world_size=W, budget=budget)
            print(
                f"world {W} budget {budget:,}: {a.plan.name}, peak {a.memory.peak_bytes:,} / {b.memory.peak_bytes:,}, "
                f"checkpointed {sum(u.checkpoint.checkpoints for u in a.plan.units)}"
            )
            assert a.plan == b.plan, (W, budget)
            assert a.memory.peak_bytes == b.memory.peak_bytes
            # step time is a sum of per-op seconds: equal to float rounding
            assert math.isclose(a.step.step_seconds, b.step.step_seconds, rel_tol=1e-9)
            assert [e.peak_bytes for e in a.baselines] == [e.peak_bytes for e in b.baselines]


def test_profile_workload_16_blocks_plans_as_the_full_capture():
    """16 blocks of the small preset in bf16 with fp32 masters (as plan-fsdp profiles): 3 captured and expanded give
    the full capture's parameters, saved activations and forward/backward bytes, and the same plans, roomy or tight
    enough to checkpoint."""
    w = dataclasses.replace(load_workload("small", batch=2, seq=128), build=_deep_small(16))
    fast, full = profile_workload(w, "bfloat16", "float32"), profile_workload(w, "bfloat16", "float32", expand=False)
    assert (fast.path, full.path) == ("expanded from 3 of 16 blocks", "full capture")
    assert sorted(fast.params, key=lambda p: p.name) == sorted(full.params, key=lambda p: p.name)
    assert sorted(fast.saved) == sorted(full.saved)
    n = int((full.op_phase < 2).sum())
    assert (fast.native[:n] == full.native[:n]).all() and fast.native[n:].max() == full.native[n:].max()
    roomy = plan_fsdp(full, world_size=8, budget=2**34).memory.peak_bytes
    _same_plans(fast, full, (8, 64, 1024), (2**34, roomy // 2))
    tight = plan_fsdp(full, world_size=8, budget=roomy // 2).plan
    assert any(u.checkpoint.checkpoints for u in tight.units)         # the tight budget did exercise checkpointing


@pytest.mark.slow
def test_profile_workload_llama3_8b_plans_as_the_full_capture():
    "Llama 3 8B at 4096 tokens, as plan-fsdp profiles it: the expanded profile plans what the full capture plans."
    w = load_workload("llama3-8b", batch=1, seq=4096)
    fast, full = profile_workload(w, "bfloat16", "float32"), profile_workload(w, "bfloat16", "float32", expand=False)
    assert (fast.path, full.path) == ("expanded from 3 of 32 blocks", "full capture")
    _same_plans(fast, full, (64, 1024), (80 * 2**30, 24 * 2**30))


def test_profile_workload_falls_back_where_blocks_differ(tmp_path):
    """A block that differs beyond the 3 captured (one norm's eps) is seen on the module tree: full capture, and the
    path says which attribute. HF Llama's blocks are copies: expanded."""
    def odd(device="meta", dtype=torch.float32):
        m = _deep_small(6)(device, dtype)
        m.layers[5].ffn_norm.eps = 1e-3
        return m
    w = dataclasses.replace(load_workload("small", batch=2, seq=64), build=odd)
    assert profile_workload(w).path == ("full capture: blocks differ: layers.5.ffn_norm.eps is 0.001 where "
                                        "layers.0.ffn_norm.eps is 1e-05")
    import transformers
    transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=256,
    ).save_pretrained(tmp_path)
    p = profile_workload(load_workload(f"hf:{tmp_path}", batch=2, seq=64))
    assert p.path == "expanded from 3 of 8 blocks" and len(p.blocks) == 8, p.path      # HF Llama's blocks are copies
