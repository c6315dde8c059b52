"""FSDP planner checked against PyTorch: torchrun/gloo (2 and 4 ranks) and FSDPMemTracker under a fake process group."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(n: int, tmp_path: Path) -> dict:
    "tests/dist_fsdp.py's main on n gloo ranks, through the package's launcher; rank 0's results."
    from static_dist.launch import launch
    return launch(f"{ROOT / 'tests' / 'dist_fsdp.py'}:main", n, timeout=300)


@pytest.mark.parametrize("n", [2, 4])
def test_gloo_params_and_collectives_match(n, tmp_path):
    res = _torchrun(n, tmp_path)
    assert res["world"] == n
    names = set(res["results"])
    assert {"planned", "per-block", "checkpointed+ends", "accumulate-4-nosync", "accumulate-3-sync-every"} <= names
    if n == 4: assert {"reshard-int-2", "hsdp-2x2"} <= names
    for name, r in res["results"].items():
        # same global batch, SGD: parameters equal the single-process run up to float reassociation
        assert r["max_param_error"] < 1e-5, (name, r["max_param_error"])
        # every step's CommDebugMode counts equal the plan's prediction exactly (accumulation included)
        for counts in r["counts_per_step"]: assert counts == r["predicted_counts"], (name, counts)
        if "tracked_peak" in r:     # FSDPMemTracker on the real gloo run (real tensors, real collectives)
            assert abs(r["predicted_peak"] / r["tracked_peak"] - 1) < 0.10, r


def test_fake_pg_memtracker_within_5_percent(tmp_path):
    out = tmp_path / "fake.json"
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "dist_fsdp_fake.py"), str(out), "quick"],
                       capture_output=True, text=True, cwd=ROOT, timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert {r["world"] for r in res} == {8, 1024} and len(res) == 18
    bad = [r for r in res if abs(r["error"]) > 0.01]     # the issue asks for 5%; measured: < 0.1%
    assert not bad, bad


def test_cli_plan_fsdp_70b(tmp_path):
    "The issue's command runs and writes a plan that fits (its wall time is recorded by `static-dist bench fsdp`)."
    out = tmp_path / "plan.json"
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "static_dist.app", "plan-fsdp", "--model", "llama3-70b", "--world",
                        "1024", "--budget", "80GiB", "--out", str(out)], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    from static_dist.fsdp import FSDPPlan
    plan = FSDPPlan.from_json(out)
    assert plan.world_size == 1024 and len(plan.units) >= 81
    assert "whole-model" in p.stdout and "ZeRO-3-like" in p.stdout
    print(f"plan-fsdp llama3-70b: {time.perf_counter() - t0:.1f} s wall (shared CPU)")


def test_cli_usage_errors():
    from static_dist.app.cli import main
    assert main(["plan-fsdp", "--model", "tiny", "--mesh", "3x3", "--world", "8"]) == 2
    assert main(["plan-fsdp", "--model", "tiny", "--ignore", "nonexistent"]) == 2


def _gpu_check():
    "tests/gpu_fsdp.py as a module (its main needs CUDA; its target logic does not)."
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_fsdp", ROOT / "tests" / "gpu_fsdp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_fsdp_targets():
    """The GPU check fails a plan off `max_memory_allocated` by more than 25% either way, and a run that measured
    nothing."""
    check = _gpu_check().check_targets
    row = lambda plan, pred, peak: dict(plan=plan, predicted=pred, cuda_max_allocated=peak, rel_error=pred / peak - 1)
    last_gpu_run = [row("per-block", 972, 1000), row("checkpointed", 807, 1000), row("whole-model", 850, 1000)]
    assert check(last_gpu_run) == []                             # -2.8%, -19.3%, -15.0%: within the target
    bad = check([row("per-block", 972, 1000), row("checkpointed", 740, 1000), row("whole-model", 1260, 1000)])
    assert len(bad) == 2 and bad[0].startswith("checkpointed: ") and "-26.0%" in bad[0] and "+26.0%" in bad[1], bad
    assert check([row("edge", 750, 1000), row("edge", 1250, 1000)]) == []   # exactly 25% off still passes
    assert check([]) == ["no plan was measured"]


def test_gpu_fsdp_without_cuda_stops_cleanly():
    import torch
    if torch.cuda.is_available(): pytest.skip("a GPU is here: tests/gpu_fsdp.py would run the real check")
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu_fsdp.py")], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert p.returncode == 0 and json.loads(p.stdout) == {"skipped": "no CUDA device: this check needs one (the CPU "
                                                                      "tests cover the rest)"}, p.stdout + p.stderr
    assert not (ROOT / "gpu_fsdp.json").exists()


# --- plan files: every field checked, read bounded (issue #22) -------------------------------------------------------
def _plan_doc() -> dict:
    from static_dist.fsdp import FSDPPlan, FSDPUnit
    return json.loads(FSDPPlan(8, (8,), (FSDPUnit(""), FSDPUnit("layers.0")), ignored=("norm",)).to_json())


@pytest.mark.parametrize("edit,message", [
    (dict(ignored=[""]), "ignored[0]: expected a module FQN, not '' (that would leave the whole model unsharded), "
                         "found \"\""),
    (dict(world_size=2**70), "world_size: expected an integer from 1 to 2**24 (the number of ranks), found "
                             "1180591620717411303424"),
    (dict(units=[{"module": "", "reshard_after_forward": "yes"}]),
     'units[0].reshard_after_forward: expected true, false or a group size >= 2 that divides the shard size, found '
     '"yes"'),
    (dict(sync_every_microbatch="yes"), 'sync_every_microbatch: expected true or false, found "yes"'),
    (dict(units=[{"module": "", "modul": "x"}]), "units[0].modul: unknown field; the fields here are module, "),
    (dict(mesh_shape=[4]), "mesh_shape: [4] multiplies to 4, not world_size 8: give [8] for FSDP"),
])
def test_plan_file_fields_are_checked(edit, message):
    from static_dist.cost import PlanError
    from static_dist.fsdp import FSDPPlan
    with pytest.raises(PlanError) as e:
        FSDPPlan.from_json(json.dumps({**_plan_doc(), **edit}))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_plan_file_is_read_bounded(tmp_path):
    import os
    from static_dist.cost import PlanError
    from static_dist.fsdp import MAX_PLAN_BYTES, FSDPPlan
    p = tmp_path / "p.json"
    p.write_text(json.dumps(_plan_doc()))
    assert json.loads(FSDPPlan.from_json(p).to_json()) == _plan_doc()
    os.truncate(p, 20 * 2**30)  # a 20 GB sparse file: refused by fstat, nothing read
    with pytest.raises(PlanError, match=rf"p.json: 21,474,836,480 bytes, more than the {MAX_PLAN_BYTES:,} allowed"):
        FSDPPlan.from_json(p)
    os.mkfifo(tmp_path / "fifo")                                     # no writer: a read would block forever
    with pytest.raises(PlanError, match="fifo: not a regular file"): FSDPPlan.from_json(tmp_path / "fifo")
    with pytest.raises(PlanError, match="nested deeper than 64 levels"): FSDPPlan.from_json("[" * 10**5 + "]" * 10**5)


def test_cli_plan_fsdp_refuses_an_empty_ignored_name(capsys):
    "`plan-fsdp --ignore ''` once ended in KeyError: None; the plan's own check now names the field."
    from static_dist.app.cli import main
    assert main(["plan-fsdp", "--model", "tiny", "--ignore", ""]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ignored[0]: expected a module FQN, not ''" in err, err


def test_apply_refuses_a_plan_for_another_world():
    "#22: an 8-rank plan applied in a 16-rank group (a fake one, in a subprocess) is refused before any fully_shard."
    code = ("import torch.distributed as dist, torch.nn as nn\n"
            "from torch.testing._internal.distributed.fake_pg import FakeStore\n"
            "from static_dist.fsdp import FSDPPlan, FSDPUnit, PlanError, apply_plan\n"
            "dist.init_process_group('fake', store=FakeStore(), rank=0, world_size=16)\n"
            "m = nn.Sequential(nn.Linear(4, 4))\n"
            "try: apply_plan(m, FSDPPlan(8, (8,), (FSDPUnit(''),))); print('applied')\n"
            "except PlanError as e: print('refused:', e)\n"
            "print('sharded' if type(m.get_parameter('0.weight')).__name__ == 'DTensor' else 'untouched')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "refused: the plan is for 8 ranks but the process group has 16" in p.stdout and "untouched" in p.stdout, (
        p.stdout + p.stderr
    )


@pytest.fixture(scope="module")
def tiny_graph():
    from static_dist.workload import load_workload
    return load_workload("tiny", batch=2, seq=16).graph()


@pytest.mark.parametrize("call", [
    lambda g, F: F.plan_fsdp(g, world_size=8, budget=float("nan")),
    lambda g, F: F.plan_fsdp(g, world_size=8, budget=float("inf")),
    lambda g, F: F.plan_fsdp(g, world_size=8, budget="80GiB"),
    lambda g, F: F.plan_fsdp("tiny", world_size=8, budget=2**30),
    lambda g, F: F.plan_fsdp(g, world_size=8, budget=2**30, overrides=None),
    lambda g, F: F.profile_graph(None),
    lambda g, F: F.predict_memory(F.profile_graph(g), None),
    lambda g, F: F.FSDPPlan.from_json(None),
    lambda g, F: F.fsdp_widget(None),
], ids=["budget nan", "budget inf", "budget str", "graph str", "overrides None", "profile None", "plan None",
        "from_json None", "widget None"])
def test_api_misuse_is_a_plan_error(call, tiny_graph):
    """#22 section 12: the FSDP API's public functions name a wrong argument with a PlanError, not a TypeError deep
    inside."""
    import static_dist.fsdp as F
    with pytest.raises(F.PlanError): call(tiny_graph, F)


def test_fsdp_widget_takes_a_graph_too(tiny_graph):
    from static_dist.fsdp import fsdp_widget
    assert fsdp_widget(tiny_graph).result is not None


def _tracked_modules(w, plan, monkeypatch, dtype=None):
    """FSDPMemTracker's peak (its 'Total') and {module FQN: its forward peak} over the second step of `plan` on `w`
    under a fake process group (verify's own measurement, the tracker kept)."""
    import static_dist.cost.measure as M
    from static_dist.fsdp.apply import apply_plan, plan_mesh
    from static_dist.launch import process_group
    from static_dist.workload import DTYPES
    keep, peak_by = {}, M.peak_by_category
    monkeypatch.setattr(M, "peak_by_category", lambda t: (keep.setdefault("t", t), peak_by(t))[1])
    args, kwargs, targets = w.inputs(dtype=plan.param_dtype or w.dtype)
    with process_group(fake_world=plan.world_size):
        m = w.build(device="meta", dtype=DTYPES[dtype or w.dtype])
        apply_plan(m, plan, plan_mesh(plan, "cpu"))
        cats, _ = M.measure_step_by_category(m, plan, args, kwargs, targets, w.loss, w.optimizer)
    fwd = {st.mod_fqn.partition(".")[2]: max(d["Total"] for s in v for d in s.values())
           for st in keep["t"].memory_tracking.values() for k, v in st.snapshots.items() if k.value == "Peak Forward"}
    return int(cats["Total"]), fwd


def test_forward_all_gather_kept_until_the_next_copy_out(monkeypatch):
    """FSDP2 keeps each forward all-gather output (`all_gather_state`) until the next unit's copy-out, a prefetched
    unit's too: each block's forward peak, as FSDPMemTracker measures it, is the predicted one (within the optimizer's
    step scalars); before, a prefetched unit's output was let go at its copy-out, one gathered block short in every
    block's forward (1.73 vs 1.92 MB on the tiny Llama)."""
    from static_dist.cost.few_blocks import profile_workload
    from static_dist.fsdp import FSDPPlan, block_units, layout, predict_memory
    from static_dist.workload import load_workload
    w = load_workload("tiny", batch=2, seq=64)
    prof = profile_workload(w, expand=False)
    plan = FSDPPlan(4, (4,), block_units(prof.blocks))
    pred = predict_memory(prof, plan)
    total, fwd = _tracked_modules(w, plan, monkeypatch)
    tot = sum(pred.curves.values())
    for l in layout(prof, plan):
        if l.module in prof.blocks:
            assert 0 <= fwd[l.module] - tot[l.fwd[0]:l.fwd[1] + 1].max() <= 128, (l.module, fwd[l.module])
    assert 0 <= total - pred.peak_bytes <= 128


@pytest.fixture(scope="module")
def hf_olmo2(tmp_path_factory):
    "A 4-block, width-256 OLMo 2 config written here (nothing downloaded): q/k norms over all heads, fp32 rotary."
    from hf_configs import hf_source
    return hf_source(tmp_path_factory, "Olmo2Config", num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=512, vocab_size=1024, max_position_embeddings=256,
                     eos_token_id=0, pad_token_id=1)


def _olmo2_per_block(src, world):
    from static_dist.cost.few_blocks import profile_workload
    from static_dist.fsdp import FSDPPlan, block_units, verify_workload
    from static_dist.workload import load_workload
    w = load_workload(src, batch=2, seq=64)
    prof = profile_workload(w, "bfloat16", "float32", expand=False)
    plan = FSDPPlan(world, (world,), block_units(prof.blocks), param_dtype="bfloat16", reduce_dtype="float32")
    return verify_workload(w, plan, prof)


def test_mixed_precision_all_gather_input_held_at_its_issue(hf_olmo2):
    """OLMo 2 per-block at world 2, bf16 over fp32 masters: the peak is where the last block's backward prefetches
    the one before, with the block's shard cast to bf16 (FSDP2's `_get_param_all_gather_inputs`) beside the all-gather
    output; was 0.9973 of FSDPMemTracker (82,944 B short), now 0.9995 (what is left is the next test's)."""
    v = _olmo2_per_block(hf_olmo2, 2)
    assert abs(v.ratio - 1) < 0.001, v.line()


@pytest.mark.xfail(strict=True, reason="not modelled: FSDP2's MixedPrecisionPolicy.cast_forward_inputs "
                   "(torch/distributed/fsdp/_fully_shard/_fsdp_state.py:346-353) casts each unit's floating inputs to "
                   "param_dtype; OLMo 2's rotary cos/sin are float32 in the bf16 capture, so every block keeps its own "
                   "bf16 copy for backward (2 x 8 KiB here), which the captured step has not")
@pytest.mark.parametrize("world", [2, 4])
def test_mixed_precision_forward_input_casts(hf_olmo2, world):
    "Exact with the per-block input casts: today 16,512 B (world 2) and 16,606 B (world 4) short, 0.9995 and 0.9992."
    v = _olmo2_per_block(hf_olmo2, world)
    assert v.predicted_bytes >= v.measured_bytes - 256, v.line()
