"Offload executor and planner: faults, mismatches, activation checkpointing, properties, CLI."
import dataclasses
import errno
import json
import math
import os
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch.utils.checkpoint import checkpoint

import static_dist.offload as off
from static_dist.offload import executor   # where the executor looks up its I/O functions (monkeypatched)
from static_dist.graph import capture
from static_dist.structure import compiled_modules
from static_dist.offload import (
    OffloadCompiledError,
    OffloadError,
    OffloadExecutor,
    OffloadMismatchError,
    Tier,
    check_plan,
    classify,
    load_plan,
    plan_offload,
    planned_live_bytes,
    saved_tensors,
)
from static_dist.zoo import get_model

DISK = Tier("nvme", 1e9, 1e-5, math.inf, "disk")
CPU = Tier("cpu", 2e9, 1e-5, math.inf, "cpu")


def _step(m, zm, x, y):
    def step():
        m.zero_grad(set_to_none=True)
        zm.loss(m(x), y).backward()
        return {n: p.grad.clone() for n, p in m.named_parameters()}
    return step


def _same(a, b):
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _run_faulty(t, fault=lambda ex: None):
    "Forward, wait for the files, fault(ex), backward — under the disk plan. Returns the executor."
    ex = OffloadExecutor(t.g, t.disk)
    try:
        with ex:
            t.m.zero_grad(set_to_none=True)
            loss = t.zm.loss(t.m(t.x), t.y)
            ex._poll_writes(wait=True)
            fault(ex)
            loss.backward()
    finally:
        assert ex._spill is None or ex._spill.closed, "spill file left open"
    return ex


def test_short_read_names_tensor(offload_tiny, monkeypatch):
    monkeypatch.setattr(executor, "_file_readinto", lambda fd, buf, offset: len(memoryview(buf)) - 1)
    with pytest.raises(OffloadError, match=r"storage \d+ \(.*: read (\d+) of \d+ bytes"):
        _run_faulty(offload_tiny)


def test_write_error_names_tensor(offload_tiny, monkeypatch):
    def broken(fd, buf, offset): raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(executor, "_file_write", broken)
    with pytest.raises(off.OffloadDiskError, match=r"storage \d+ .*writing \d+ bytes to the spill file in .* failed: "
                                                   r"Input/output error — check the disk"):
        _run_faulty(offload_tiny)


def test_truncated_spill_file_refused(offload_tiny):
    victim = max(offload_tiny.disk.offloaded, key=lambda d: d.nbytes)
    def cut(ex): os.ftruncate(ex._spill.fileno(), ex._entries[victim.storage].offset + 1)
    with pytest.raises(
        off.OffloadCorruptionError, match=r"storage \d+ .*its spill file in .* was truncated to \d+ bytes"
    ):
        _run_faulty(offload_tiny, cut)


def test_user_exception_closes_spill_file(offload_tiny, tmp_path):
    ex = OffloadExecutor(offload_tiny.g, offload_tiny.disk, disk_dir=tmp_path)
    with pytest.raises(ZeroDivisionError):
        with ex:
            offload_tiny.zm.loss(offload_tiny.m(offload_tiny.x), offload_tiny.y)
            ex._poll_writes(wait=True)
            assert os.fstat(ex._spill.fileno()).st_size == sum(
                d.nbytes for d in offload_tiny.disk.offloaded
            )  # it was written
            1 / 0
    assert ex._spill.closed and os.listdir(tmp_path) == []


def test_spill_file_has_no_name(offload_tiny, tmp_path):
    "The step's spill file is never visible in the directory, during or after the step; gradients are exact."
    with OffloadExecutor(offload_tiny.g, offload_tiny.disk, disk_dir=tmp_path) as ex:
        offload_tiny.m.zero_grad(set_to_none=True)
        loss = offload_tiny.zm.loss(offload_tiny.m(offload_tiny.x), offload_tiny.y)
        ex._poll_writes(wait=True)
        assert os.listdir(tmp_path) == [] and ex.stats["written_bytes"] > 0
        loss.backward()
    assert os.listdir(tmp_path) == [] and ex._spill.closed
    assert _same({n: p.grad for n, p in offload_tiny.m.named_parameters()}, offload_tiny.ref)


def test_backward_after_exit_is_an_error(offload_tiny):
    ex = OffloadExecutor(offload_tiny.g, plan_offload(offload_tiny.g, (CPU,), min_bytes=0))
    with ex:
        offload_tiny.m.zero_grad(set_to_none=True)
        loss = offload_tiny.zm.loss(offload_tiny.m(offload_tiny.x), offload_tiny.y)
    with pytest.raises(OffloadError, match="after the OffloadExecutor's `with` block ended"):
        loss.backward()


def test_other_model_or_dtype_is_refused(offload_tiny):
    zm = get_model("mlp")
    m = zm.build("cpu"); (x,), y = zm.batch(4)
    with pytest.raises(OffloadMismatchError, match=r"left the captured step at save #0 \(captured before op 0: "
                                                   r"aten.embedding.default .*saved \(4, 32\) torch.float32, captured "
                                                   r"\(4, 128\) torch.int64"):
        with OffloadExecutor(offload_tiny.g, offload_tiny.disk): _step(m, zm, x, y)()
    m64 = offload_tiny.zm.build("cpu", dtype=torch.float64)
    with pytest.raises(OffloadMismatchError, match=r"torch.float64, captured .* torch.float32"):
        with OffloadExecutor(offload_tiny.g, offload_tiny.disk):
            _step(m64, offload_tiny.zm, offload_tiny.x, offload_tiny.y)()


def test_fewer_saves_than_captured_is_refused(offload_tiny):
    "A step that stops early (here: forward only, no loss) saved fewer tensors than the captured one."
    with pytest.raises(
        OffloadMismatchError, match=r"the step ended after \d+ saves for backward, the captured one makes"
    ):
        with OffloadExecutor(offload_tiny.g, offload_tiny.disk): offload_tiny.m(offload_tiny.x)


def test_graph_without_hook_record_is_refused(offload_tiny):
    "A graph read from a schema-1 file has no save/unpack record: the executor asks for a new capture."
    old = dataclasses.replace(offload_tiny.g, saves=(), unpacks=())
    with pytest.raises(ValueError, match="no record of autograd's saves"):
        OffloadExecutor(old, offload_tiny.disk)


def test_schedule_points_are_hook_calls(offload_tiny):
    "Every planned point is an op before which autograd packs or unpacks: the executor can act exactly there."
    ticks = {o for o, _ in offload_tiny.g.saves} | {o for o, _ in offload_tiny.g.unpacks}
    assert offload_tiny.disk.offloaded
    for d in offload_tiny.disk.offloaded:
        assert d.release_op in ticks and d.prefetch_at in ticks, d


def test_late_prefetch_still_exact(offload_tiny):
    """Prefetches moved to the first op that reads the tensor come after autograd already asked for some of them (it
    unpacks
    a node's saved tensors before the node's first op): those are loaded on demand, with the same gradients."""
    p = dataclasses.replace(offload_tiny.disk, decisions=tuple(
        dataclasses.replace(d, prefetch_at=d.first_backward_use) if d.tier else d for d in offload_tiny.disk.decisions))
    ex = OffloadExecutor(offload_tiny.g, p)
    with ex: got = offload_tiny.step()
    assert ex.stats["late_prefetches"] >= 1
    assert _same(got, offload_tiny.ref)


def _checkpointed(m, reentrant):
    "Activation checkpointing on every block, FQNs unchanged (torch.utils.checkpoint)."
    for layer in m.layers:
        f = layer.forward
        layer.forward = lambda *a, _f=f: checkpoint(_f, *a, use_reentrant=reentrant)
    return m


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_blocks(offload_tiny, reentrant):
    zm = offload_tiny.zm
    m = _checkpointed(zm.build("cpu"), reentrant)
    g = capture(m, (offload_tiny.x,), loss_fn=zm.loss, targets=offload_tiny.y, mode="real")
    # checkpointed, the step's peak is out of offload's reach: move what qualifies anyway, to test the executor
    plan = plan_offload(g, (DISK,), min_bytes=0, lower_peak_only=False)
    bwd0 = min(o.index for o in g.ops if o.phase == "backward")
    fwd = lambda g: [o for o in g.ops if o.phase == "forward"]
    bwd = lambda g: [o for o in g.ops if o.phase == "backward"]
    compute = lambda g: Counter(o.op for o in fwd(g) if not o.op.startswith("aten.empty"))   # (torch 2.11's checkpoint
    assert len(bwd(g)) > len(bwd(offload_tiny.g)) and compute(g) == compute(
        offload_tiny.g
    )  # allocates a few) the blocks re-run in backward
    assert all(d.offload_after < bwd0 for d in plan.offloaded)                  # nothing made in backward is moved
    rec = [s for s in saved_tensors(g) if s.recomputed]
    if reentrant:   # the re-run saves through the outer hooks: the graph sees those tensors, marked recomputed
        assert rec and all(s.created >= bwd0 for s in rec)
        assert {d.klass for d in plan.decisions if d.storage in {s.storage for s in rec}} == {"must_retain"}
    else:           # non-reentrant checkpointing packs with its own hooks: the re-run's tensors are never offered
        assert rec == []
    assert plan.offloaded and sum(d.nbytes for d in plan.offloaded) < sum(d.nbytes for d in offload_tiny.disk.offloaded)
    step = _step(m, zm, offload_tiny.x, offload_tiny.y)
    ref = step()
    assert _same(ref, offload_tiny.ref)                        # checkpointing itself is exact here
    with OffloadExecutor(g, plan): got = step()
    assert _same(got, ref)


def test_recomputed_modules_are_kept(offload_tiny):
    "The caller can name checkpointed modules (e.g. from an AC plan): nothing saved in them is moved."
    p = plan_offload(offload_tiny.g, (DISK,), min_bytes=0, recomputed=["layers.0"])
    assert p.offloaded and not any((d.saved_in or "").startswith("layers.0") for d in p.offloaded)
    assert all(d.reason.startswith("recomputed") for d in p.decisions if (d.saved_in or "").startswith("layers.0"))


# --- torch.compile'd blocks: the executor cannot follow them, and says so (issue 15) -------------------------------
def _compiled_tiny(backend, how):
    "The tiny Llama with every block compiled: `Module.compile()` ('method') or a `torch.compile(block)` wrapper."
    m = get_model("tiny").build("cpu")
    for i, b in enumerate(m.layers):
        if how == "method": b.compile(backend=backend)
        else: m.layers[i] = torch.compile(b, backend=backend)
    return m


@pytest.mark.parametrize("how", ["method", "wrapper"])
def test_compiled_model_refused_up_front(offload_tiny, how):
    """Given the model, the executor names its compiled modules before anything runs (compile is lazy: nothing compiles
    here)."""
    m = _compiled_tiny("aot_eager", how)
    assert compiled_modules(m) == ["layers.0", "layers.1"] and compiled_modules(offload_tiny.m) == []
    with pytest.raises(
        OffloadCompiledError,
        match=r"cannot run Llama: 2 module\(s\) run torch.compile'd \(layers.0, "
        r"layers.1\); .*run the offloaded step on the model without torch.compile",
    ):
        OffloadExecutor(offload_tiny.g, offload_tiny.disk, model=m)
    eager = get_model("tiny").build("cpu")
    ex = OffloadExecutor(offload_tiny.g, offload_tiny.disk, model=eager)     # accepted: nothing compiled yet
    eager.layers[1].compile(backend="aot_eager")                             # compiled after the executor was made
    with pytest.raises(OffloadCompiledError, match=r"1 module\(s\) run torch.compile'd \(layers.1\)"):
        with ex: pass
    assert not ex._active


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_step_is_refused_with_the_reason(offload_tiny, backend):
    """Measured: compiled blocks give the eager gradients without the executor (bitwise with aot_eager), but save other
    tensors for backward than the captured eager step (capture() records the eager ops either way), so the executor's
    save-by-save match stops inside the first compiled block: an OffloadCompiledError, never a wrong gradient."""
    t = offload_tiny
    m = _compiled_tiny(backend, "method")
    step = _step(m, t.zm, t.x, t.y)
    got = step()
    if backend == "aot_eager": assert _same(got, t.ref)
    else: assert all(torch.allclose(got[k], t.ref[k], rtol=1e-4, atol=1e-6) for k in t.ref)   # Inductor's own kernels
    saves = []
    with torch.autograd.graph.saved_tensors_hooks(lambda v: saves.append(v.shape) or v, lambda v: v): step()
    assert 0 < len(saves) < len(t.g.saves)
    assert len(capture(m, (t.x,), loss_fn=t.zm.loss, targets=t.y).saves) == len(t.g.saves)  # the capture sees eager ops
    with pytest.raises(
        OffloadCompiledError,
        match=r"left the captured step at save #\d+ .*, inside torch.compile'd code "
        r"\(TransformerBlock\): saved .* pass model= to OffloadExecutor",
    ):
        with OffloadExecutor(t.g, t.disk): step()
    assert _same(step(), got)                                   # the refused step left the model as it was


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cpu_bw=st.floats(1e6, 1e11), nvme_bw=st.floats(1e6, 1e10), lat=st.floats(0, 1e-3),
       host=st.one_of(st.none(), st.integers(0, 8 * 2**20)), min_bytes=st.integers(0, 2**20), safety=st.floats(1, 4))
def test_plan_properties(offload_tiny, cpu_bw, nvme_bw, lat, host, min_bytes, safety):
    tiers = (Tier("cpu", cpu_bw, lat, math.inf), Tier("nvme", nvme_bw, lat * 10, math.inf, "disk"))
    p = plan_offload(offload_tiny.g, tiers, host_limit=host, min_bytes=min_bytes, safety=safety)
    check_plan(p, offload_tiny.g)
    if host is not None: assert sum(d.nbytes for d in p.offloaded if d.tier == "cpu") <= host
    assert p.planned_peak_bytes <= p.peak_bytes == offload_tiny.g.peak().bytes
    assert planned_live_bytes(offload_tiny.g, p).min() >= 0
    for d in p.decisions:
        # the class rule, by hand: round trip 2 (latency + bytes / bandwidth) against the idle window
        rts = [2 * (t.latency + d.nbytes / t.bandwidth) for t in tiers]
        if d.nbytes < min_bytes or d.first_backward_use is None: assert d.klass == "must_retain"
        elif all(r * safety <= d.idle_s for r in rts): assert d.klass == "safe_to_offload"
        elif any(r <= d.idle_s for r in rts): assert d.klass == "conditionally_offloadable"
        else: assert d.klass == "must_retain"
        if d.tier is not None:
            t = next(t for t in tiers if t.name == d.tier)
            assert 2 * t.transfer_time(d.nbytes) <= d.idle_s


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(host=st.integers(0, 4 * 2**20), nvme_bw=st.floats(1e8, 1e10))
def test_random_plans_give_identical_gradients(offload_tiny, host, nvme_bw):
    p = plan_offload(offload_tiny.g, (CPU, Tier("nvme", nvme_bw, 1e-4, math.inf, "disk")), host_limit=host, min_bytes=0)
    with OffloadExecutor(offload_tiny.g, p): got = offload_tiny.step()
    assert _same(got, offload_tiny.ref)


def test_cli_plan_offload_save(tmp_path, capsys):
    from static_dist.app.cli import main
    from static_dist.workload import load_workload
    path = tmp_path / "plan.json"
    assert main(["plan-offload", "--seq", "32", "--host-limit", "1MiB", "--save", str(path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    plan = load_plan(path)
    check_plan(plan, load_workload("tiny", batch=2, seq=32).graph())
    assert summary["offloaded"]["cpu"] <= 2**20 and summary["saved_tensors"] == len(plan.decisions)
    with pytest.raises(SystemExit) as e:                # argparse refuses the size, with exit status 2
        main(["plan-offload", "--host-limit", "lots"])
    assert e.value.code == 2


@pytest.mark.slow
def test_bench_offload_runs():
    res = off.bench_offload(repeat=1)
    assert [v["variant"] for v in res["results"]["variants"]] == ["none", "save_on_cpu", "executor"]
    assert all(v["grads_bitwise_equal"] for v in res["results"]["variants"])
    json.dumps(res)


def test_bench_offload_user_model():
    "The user's own model by file path (examples/gpt.py's GPT): every variant's gradients equal the plain step's."
    src = f"{os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}/examples/gpt.py:GPT"
    res = off.bench_offload(model=src, batch=2, seq=32, repeat=1)
    assert res["model"] == src and [v["variant"] for v in res["results"]["variants"]] == [
        "none",
        "save_on_cpu",
        "executor",
    ]
    assert all(v["grads_bitwise_equal"] for v in res["results"]["variants"])
    assert (
        res["results"]["variants"][2]["peak_bytes"] < res["results"]["variants"][0]["peak_bytes"]
    )  # the plan moved something


@pytest.mark.gpu
def test_gpu_executor_identical_and_lower_peak():
    zm = get_model("tiny")
    m = zm.build("cuda"); (x,), y = zm.batch(8, 256, device="cuda")
    g = capture(m, (x,), loss_fn=zm.loss, targets=y, device="cuda")
    step = _step(m, zm, x, y)
    ref = step()
    for tiers in ((off.tier("pcie5-pinned"),), (DISK,)):
        p = plan_offload(g, tiers, device="h200-fp32", min_bytes=0)
        with OffloadExecutor(g, p): got = step()
        torch.cuda.synchronize()
        assert _same(got, ref)


# --- #22: typed errors for every misuse of the API --------------------------------------------------------------

def test_api_misuse_is_a_typed_error(offload_tiny):
    from static_dist.offload import OffloadUsageError
    from static_dist.errors import StaticDistError
    g = offload_tiny.g
    plan = plan_offload(g)
    for call, words in [(lambda: OffloadExecutor(None, None), "graph must be a StaticGraph"),
                        (lambda: OffloadExecutor(g, None), "plan must be an OffloadPlan"),
                        (lambda: OffloadExecutor(g, plan, workers=0), "workers must be an integer from 1 to 64"),
                        (lambda: OffloadExecutor(g, plan, disk_dir=""), "disk_dir must be a directory path"),
                        (lambda: plan_offload(g, tiers=["nvme"]), "pass tier('nvme') for a preset"),
                        (lambda: plan_offload(g, min_bytes=-1), "min_bytes must be an integer >= 0"),
                        (lambda: plan_offload(g, host_limit=float("nan")), "host_limit must be a number of bytes >= 0"),
                        (lambda: plan_offload(None), "graph must be a StaticGraph"),
                        (lambda: plan_offload(g, lookahead=-1), "lookahead must be an integer >= 0")]:
        with pytest.raises(OffloadUsageError, match=words.replace("(", r"\(").replace(")", r"\)")):
            call()
    assert issubclass(OffloadUsageError, (StaticDistError, ValueError))


def test_a_spill_file_closed_under_the_step_is_a_typed_error(offload_tiny):
    from static_dist.offload import OffloadDiskError
    t = offload_tiny
    ex = OffloadExecutor(t.g, t.disk)
    with pytest.raises(OffloadDiskError, match="spill file"):
        with ex:
            t.m.zero_grad(set_to_none=True)
            loss = t.zm.loss(t.m(t.x), t.y)
            ex._poll_writes(wait=True); ex._spill.close()
            loss.backward()


def test_a_spill_descriptor_closed_behind_the_executor_is_a_typed_error(offload_tiny):
    """#22 section 12: os.close of the spill file's descriptor mid-step: OffloadDiskError, and leaving the block raises
    no EBADF."""
    import os
    from static_dist.offload import OffloadDiskError
    t = offload_tiny
    ex = OffloadExecutor(t.g, t.disk)
    with pytest.raises(OffloadDiskError, match="spill file"):
        with ex:
            t.m.zero_grad(set_to_none=True)
            os.close(ex._spill_fd())
            t.zm.loss(t.m(t.x), t.y).backward()


@pytest.mark.parametrize("kw", [dict(seqs=()), dict(seqs=[0]), dict(seqs="64"), dict(batch=0)])
def test_offload_widget_refuses_bad_arguments(kw):
    "#22 section 12: an empty or non-positive `seqs`, or a bad batch, is an OffloadUsageError, not an IndexError."
    with pytest.raises(off.OffloadUsageError): off.offload_widget(**kw)


def test_plan_offload_recomputed_is_a_list_of_names():
    from static_dist.workload import load_workload
    g = load_workload("mlp", batch=2).graph()
    with pytest.raises(off.OffloadUsageError, match="list of module names"): off.plan_offload(g, recomputed="layers")


def test_plan_offload_out_of_reach_says_so_and_moves_nothing(tmp_path):
    """Issue 30 item 14: a step whose peak is parameters, gradients and optimizer state (the tiny model at one sequence
    of 32 tokens, AdamW) gets a plan that moves nothing and says where the peak is and what would lower it; the saved
    plan keeps the note."""
    import json, subprocess, sys
    from static_dist.offload import load_plan
    p = subprocess.run([sys.executable, "-m", "static_dist.app", "plan-offload", "--model", "tiny", "--batch", "1",
                        "--seq", "32", "--save", str(tmp_path / "o.json")], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    out = " ".join(p.stdout.split())
    assert "Nothing is moved: the peak" in out and "CPUOffloadPolicy" in out and "0 B held" in out, out
    plan = load_plan(tmp_path / "o.json")
    assert not plan.offloaded and "optimizer" in plan.note
