"""Offload integrity (issue 14 §3, §4): spilled bytes changed between forward and backward, in-place edits of saved
tensors, filesystem problems, a process killed mid-step, and hand-edited plan files. Every case ends in exactly the
reference (no-offload) gradients or a typed error; never in wrong gradients or an untyped exception."""
import json
import re
import math
import os
import signal
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import static_dist.offload as off
from static_dist.offload import executor, spill   # where the names monkeypatched below are looked up
from static_dist.offload import (OffloadCorruptionError, OffloadDiskError, OffloadExecutor, OffloadInplaceError,
                                 OffloadPlanError, Tier, check_plan, plan_from_dict, plan_offload, plan_to_dict)
from static_dist.errors import StaticDistError

DISK = Tier("nvme", 1e9, 1e-5, math.inf, "disk")
CPU = Tier("cpu", 2e9, 1e-5, math.inf, "cpu")
INPLACE = "one of the variables needed for gradient computation has been modified by an inplace operation"


def _grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters()}


def _run(t, plan, fault, disk_dir=None):
    """Forward under the executor, wait until every spilled region is written, `fault(fd, regions)` with
    regions = {storage: (offset, nbytes)} of those still away, then backward. Returns the gradients."""
    ex = OffloadExecutor(t.g, plan, disk_dir=disk_dir)
    try:
        with ex:
            t.m.zero_grad(set_to_none=True)
            loss = t.zm.loss(t.m(t.x), t.y)
            ex._poll_writes(wait=True)
            regions = {sid: (e.offset, e.dec.nbytes) for sid, e in ex._entries.items() if e.offset is not None}
            fault(ex._spill.fileno() if ex._spill else None, regions)
            loss.backward()
    finally:
        assert ex._spill is None or ex._spill.closed
    return _grads(t.m)


def _exact(got, ref):
    return set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)


# --- spilled bytes changed between forward and backward ------------------------------------------------------------
def flip_each(fd, regions):
    for off_, n in regions.values():
        at = off_ + n // 2
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x01]), at)


def zero_each(fd, regions):
    for off_, n in regions.values(): os.pwrite(fd, bytes(n), off_)


def swap_same_size(fd, regions):
    "Swap the contents of regions of equal size (the size check cannot see it)."
    by_size = {}
    for sid, (o, n) in sorted(regions.items()): by_size.setdefault(n, []).append(o)
    pairs = [(a, b, n) for n, os_ in by_size.items() for a, b in zip(os_[::2], os_[1::2])]
    pairs = [(a, b, n) for a, b, n in pairs if os.pread(fd, n, a) != os.pread(fd, n, b)]   # (equal ones change nothing)
    assert pairs, "no two different spilled tensors of one size"
    for a, b, n in pairs:
        ra, rb = os.pread(fd, n, a), os.pread(fd, n, b)
        os.pwrite(fd, rb, a); os.pwrite(fd, ra, b)


@pytest.mark.parametrize("fault", [flip_each, zero_each, swap_same_size])
def test_changed_spill_bytes_are_refused(offload_tiny, fault):
    assert len(offload_tiny.disk.offloaded) >= 10
    with pytest.raises(OffloadCorruptionError, match=r"storage \d+ \(.*\): its spill file in .* \(unlinked, bytes \d+ "
                                                     r"to \d+\) does not hold the bytes written \((xxh3_64|crc32) "):
        _run(offload_tiny, offload_tiny.disk, fault)


def test_untouched_spill_is_exact(offload_tiny):
    assert _exact(_run(offload_tiny, offload_tiny.disk, lambda fd, r: None), offload_tiny.ref)


@settings(max_examples=12, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pick=st.integers(0, 10**6), where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_any_single_bit_flip_is_refused(offload_tiny, pick, where, bit):
    "One bit anywhere in any still-away region: refused (never a silent change of gradients)."
    def one(fd, regions):
        o, n = sorted(regions.values())[pick % len(regions)]
        at = o + int(where * n)
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ (1 << bit)]), at)
    with pytest.raises(OffloadCorruptionError):
        _run(offload_tiny, offload_tiny.disk, one)


def test_corruption_error_is_typed_and_one_line(offload_tiny):
    with pytest.raises(StaticDistError) as e:
        _run(offload_tiny, offload_tiny.disk, flip_each)
    assert "\n" not in str(e.value) and isinstance(e.value, off.OffloadError)


# --- in-place edits of saved tensors --------------------------------------------------------------------------------
def _edit_after_forward(t, plan, module="layers.0.feed_forward.w2"):
    "Forward, double the input saved by `module` in place, backward: under `plan` (None = plain autograd)."
    held = []
    h = t.m.get_submodule(module).register_forward_pre_hook(lambda mod, args: held.append(args[0]))
    try:
        if plan is None:
            t.m.zero_grad(set_to_none=True)
            loss = t.zm.loss(t.m(t.x), t.y); held[-1].mul_(2); loss.backward()
        else: _run(t, plan, lambda fd, r: held[-1].mul_(2))
    finally: h.remove()


@pytest.mark.parametrize("tiers,min_bytes", [((DISK,), 0), ((CPU,), 0), ((DISK,), 2**40)],
                         ids=["offloaded-to-disk", "offloaded-to-cpu", "kept"])
def test_inplace_edit_after_save_gives_autograds_error(offload_tiny, tiers, min_bytes):
    "The executor's error says what plain autograd says: the tensor (type, shape) and the versions, word for word."
    with pytest.raises(RuntimeError, match=INPLACE) as plain:
        _edit_after_forward(offload_tiny, None)                               # plain autograd: the reference behaviour
    plan = plan_offload(offload_tiny.g, tiers, min_bytes=min_bytes)
    with pytest.raises(OffloadInplaceError, match=INPLACE) as ours:
        _edit_after_forward(offload_tiny, plan)
    what = lambda e: re.search(r"inplace operation: (\[\S+ \[[\d, ]+\]\]), which is .*, (is at version \d+; expected "
                               r"version \d+ instead)", str(e.value)).groups()
    assert (
        what(ours) == what(plain) == ("[torch.FloatTensor [512, 192]]", "is at version 1; expected version 0 instead")
    )


def test_inplace_edit_before_offload_is_refused(offload_tiny):
    """Edited right after its save, while the worker may still be writing it: the version says so before any read is
    trusted."""
    saved = []
    def pre(mod, args): saved.append(args[0])
    def post(mod, args, out): saved[-1].add_(1)                          # after w2 saved its input
    w2 = offload_tiny.m.layers[1].feed_forward.w2
    h1, h2 = w2.register_forward_pre_hook(pre), w2.register_forward_hook(post)
    try:
        with pytest.raises(OffloadInplaceError, match=INPLACE):
            _run(offload_tiny, offload_tiny.disk, lambda fd, r: None)
    finally: h1.remove(); h2.remove()


def test_no_false_inplace_alarm(offload_tiny):
    "An in-place op on a tensor that is not saved (the loss) is fine, as in plain autograd."
    with OffloadExecutor(offload_tiny.g, offload_tiny.disk):
        offload_tiny.m.zero_grad(set_to_none=True)
        loss = offload_tiny.zm.loss(offload_tiny.m(offload_tiny.x), offload_tiny.y)
        (loss * 1.0).backward()
    assert _exact(_grads(offload_tiny.m), offload_tiny.ref)


# --- filesystem problems: a typed error naming the directory, before anything runs -------------------------------
def _enter(t, d):
    with OffloadExecutor(t.g, t.disk, disk_dir=d): pass


def test_missing_directory(offload_tiny, tmp_path):
    with pytest.raises(OffloadDiskError, match=rf"offload directory {tmp_path}/nope does not exist: create it"):
        _enter(offload_tiny, tmp_path / "nope")


def test_file_in_place_of_directory(offload_tiny, tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OffloadDiskError, match=rf"offload directory {tmp_path}/f is a file, not a directory"):
        _enter(offload_tiny, tmp_path / "f")


def test_no_permission(offload_tiny, tmp_path, monkeypatch):
    "Root ignores directory modes, so the refusal the kernel gives a user (EACCES) is injected at file creation."
    def denied(*a, **k): raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(spill.tempfile, "TemporaryFile", denied)
    with pytest.raises(OffloadDiskError, match=rf"offload directory {tmp_path}: no permission to create files there"):
        _enter(offload_tiny, tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write into a mode-500 directory")
def test_no_permission_real(offload_tiny, tmp_path):
    d = tmp_path / "ro"; d.mkdir(mode=0o500)
    with pytest.raises(OffloadDiskError, match="no permission"):
        _enter(offload_tiny, d)


def test_disk_too_small(offload_tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(spill.shutil, "disk_usage", lambda p: SimpleNamespace(total=10, used=9, free=1))
    with pytest.raises(OffloadDiskError, match=rf"offload directory {tmp_path} has 1 B free, the plan spills .* there"):
        _enter(offload_tiny, tmp_path)


def test_disk_full_mid_step(offload_tiny, tmp_path, monkeypatch):
    def full(fd, buf, offset): raise OSError(28, "No space left on device")
    monkeypatch.setattr(executor, "_file_write", full)
    with pytest.raises(
        OffloadDiskError,
        match=rf"writing \d+ bytes to the spill file in {tmp_path} failed: No space left "
        r"on device — the disk is full",
    ):
        _run(offload_tiny, offload_tiny.disk, lambda fd, r: None, disk_dir=tmp_path)
    assert os.listdir(tmp_path) == []


def test_executor_usable_after_refusal(offload_tiny, tmp_path):
    with pytest.raises(OffloadDiskError): _enter(offload_tiny, tmp_path / "nope")
    assert _exact(_run(offload_tiny, offload_tiny.disk, lambda fd, r: None, disk_dir=tmp_path), offload_tiny.ref)


# --- SIGKILL mid-step: nothing left on disk ------------------------------------------------------------------------
CHILD = textwrap.dedent("""
    import math, os, sys, time
    from static_dist.graph import capture
    from static_dist.offload import OffloadExecutor, Tier, plan_offload
    from static_dist.zoo import get_model
    zm = get_model("tiny"); m = zm.build("cpu"); (x,), y = zm.batch(4, 128)
    g = capture(m, (x,), loss_fn=zm.loss, targets=y)
    plan = plan_offload(g, (Tier("nvme", 1e9, 1e-5, math.inf, "disk"),), min_bytes=0)
    with OffloadExecutor(g, plan, disk_dir=sys.argv[1]) as ex:
        loss = zm.loss(m(x), y)
        ex._poll_writes(wait=True)
        print(ex._spill.fileno(), ex.stats["written_bytes"], flush=True)
        time.sleep(120)                                   # killed here, mid-step, between forward and backward
""")


def test_sigkill_leaves_no_spill_files(tmp_path):
    d = tmp_path / "spill"; d.mkdir()
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(d)], stdout=subprocess.PIPE, text=True)
    try:
        fd, written = map(int, p.stdout.readline().split())
        assert written > 0
        link = f"/proc/{p.pid}/fd/{fd}"
        assert os.stat(link).st_size == written               # the spill file is real and full...
        assert os.readlink(link).endswith("(deleted)") and os.listdir(d) == []   # ...and has no name
    finally:
        p.send_signal(signal.SIGKILL); p.wait(30)
    assert p.returncode == -signal.SIGKILL
    assert os.listdir(d) == []


# --- hand-edited plan files ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plan_json(offload_tiny):
    return json.loads(
        json.dumps(plan_to_dict(plan_offload(offload_tiny.g, (CPU, DISK), host_limit=2**20, min_bytes=0)))
    )


def _paths(x, pre=()):
    "Every path (tuple of keys / indices) into a JSON value."
    yield pre
    if isinstance(x, dict):
        for k, v in x.items(): yield from _paths(v, pre + (k,))
    elif isinstance(x, list):
        for i, v in enumerate(x): yield from _paths(v, pre + (i,))


def _get(x, path):
    for k in path: x = x[k]
    return x


VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=True, allow_infinity=True),
                   st.text(max_size=8), st.lists(st.integers(-3, 3), max_size=3), st.just({}), st.just("float32"),
                   st.sampled_from(["cpu", "nvme", "disk", "must_retain", "safe_to_offload", "static_dist.offload/3"]))


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_plan_is_refused_or_loaded_unchanged(offload_tiny, plan_json, data):
    """Delete, replace or duplicate any field of a valid plan JSON: the loader raises OffloadPlanError, or it loads
    what the file says, exactly (it re-serialises to the same JSON) and `check_plan` then accepts or refuses it
    typed."""
    d = json.loads(json.dumps(plan_json))
    paths = [p for p in _paths(d) if p]
    path = data.draw(st.sampled_from(paths))
    parent, key = _get(d, path[:-1]), path[-1]
    how = data.draw(st.sampled_from(["delete", "replace", "duplicate"]))
    if how == "delete":
        if isinstance(parent, list): parent.pop(key)
        else: del parent[key]
    elif how == "replace": parent[key] = data.draw(VALUES)
    elif isinstance(parent, list): parent.insert(key, json.loads(json.dumps(parent[key])))
    else: parent[key + "_copy" if isinstance(key, str) else key] = parent[key]
    text = json.dumps(d)                                        # what a file would hold (NaN and Infinity included)
    try: plan = plan_from_dict(json.loads(text))
    except OffloadPlanError as e:
        assert "\n" not in str(e)
        return
    back = json.loads(json.dumps(plan_to_dict(plan)))
    assert back == json.loads(text)                             # nothing dropped, coerced or invented
    try: check_plan(plan, offload_tiny.g)
    except OffloadPlanError: pass


@pytest.mark.parametrize("edit,msg", [
    (lambda d: d["decisions"][0].pop("tier"), r"plan.decisions\[0\].tier: missing; give a string, or null"),
    (lambda d: d["decisions"][0].update(shape=[4, -1]), r"plan.decisions\[0\].shape\[1\]: expected an integer from 0 "
                                                        r"to 2\*\*63-1, found -1"),
    (lambda d: d["decisions"][0].update(shape="4x4"), r"plan.decisions\[0\].shape: expected a list, each item an "
                                                      r"integer from 0 to 2\*\*63-1, found \"4x4\""),
    (lambda d: d["decisions"].append(dict(d["decisions"][3])), r"plan.decisions\[\d+\].storage: expected one decision "
                                                               r"per storage, found \d+, already decided in "
                                                               r"plan.decisions\[3\]"),
    (lambda d: d.update(decisions=[]), r"plan.decisions: expected a non-empty list, found \[\]"),
    (lambda d: d.update(decisions={}), r"plan.decisions: expected a non-empty list, found \{\}"),
    (lambda d: d.update(schema="static_dist.offload/99"), r"is not an offload plan: expected schema"),
    (lambda d: d.pop("schema"), r"is not an offload plan"),
    (lambda d: d.update(schema="static_dist.graph/2"), r"is not an offload plan"),
    (lambda d: d["decisions"][0].update(nbytes=-5), r"plan.decisions\[0\].nbytes: expected an integer from 0 to "
                                                    r"2\*\*62, found -5"),
    (lambda d: d["decisions"][0].update(nbytes=True), r"plan.decisions\[0\].nbytes: expected an integer from 0 to "
                                                      r"2\*\*62, found true"),
    (lambda d: d["tiers"][0].update(kind="tape"), r"plan.tiers\[0\].kind: expected one of \"cpu\", \"disk\", found "
                                                  r"\"tape\""),
    (lambda d: d.update(safety=0.5), r"plan.safety: expected a finite number >= 1, found 0.5"),
    (lambda d: d["decisions"][0].update(dtype="float99"), r"plan.decisions\[0\].dtype: expected a torch dtype name "
                                                          r"such as \"float32\", found \"float99\""),
    (lambda d: d["decisions"][0].update(nbytes=2**70), r"plan.decisions\[0\].nbytes: expected an integer from 0 to "
                                                       r"2\*\*62, found 1180591620717411303424"),
    (lambda d: d["decisions"][0].update(shape=[10**12, 10**12]), r"plan.decisions\[0\].shape: expected a shape of at "
                                                                 r"most 2\*\*62 bytes"),
    (lambda d: d.update(colour=1), r"plan.colour: unknown field; the fields here are schema, decisions"),
])
def test_hand_edits_name_the_field(plan_json, edit, msg):
    d = json.loads(json.dumps(plan_json)); edit(d)
    with pytest.raises(OffloadPlanError, match=msg):
        plan_from_dict(d)


def test_load_plan_file_errors(tmp_path, plan_json):
    (tmp_path / "p.json").write_text(json.dumps(plan_json))
    assert off.load_plan(tmp_path / "p.json") == plan_from_dict(plan_json)
    with pytest.raises(OffloadPlanError, match="offload plan .*: is a folder, not a file; give the file"):
        off.load_plan(tmp_path)
    with pytest.raises(OffloadPlanError, match="none.json: no such file; give the file"):
        off.load_plan(tmp_path / "none.json")
    os.mkfifo(tmp_path / "fifo")                                     # no writer: a read would block forever
    with pytest.raises(OffloadPlanError, match="fifo: not a regular file"): off.load_plan(tmp_path / "fifo")
    (tmp_path / "big.json").write_text("{}")
    os.truncate(tmp_path / "big.json", 20 * 2**30)                   # 20 GB, sparse: refused by its size, nothing read
    with pytest.raises(OffloadPlanError, match=r"big.json: 21,474,836,480 bytes, more than the"):
        off.load_plan(tmp_path / "big.json")
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(OffloadPlanError, match="nested deeper than 64 levels"): off.load_plan(tmp_path / "deep.json")
    (tmp_path / "g.json").write_text('{"schema": "static_dist.graph/2", "ops": []}')
    with pytest.raises(OffloadPlanError, match=r"g.json is not an offload plan"): off.load_plan(tmp_path / "g.json")
