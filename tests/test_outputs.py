"""#22: nothing clobbered. Writers never replace a device, FIFO or symlink to a device (with or without --force), honour
the umask, keep a replaced file's mode, create exclusively without --force (of concurrent runs one wins), and a report
folder is the old report or the new one, whole, whenever a SIGINT arrives. All in-process: a few seconds in all."""
import contextlib
import io
import os
import signal
import stat
import threading
from pathlib import Path

import pytest

from static_dist.app.cli import main
from static_dist.outputs import OutputFolder
from static_dist.errors import InputError
from static_dist.files import atomic_write

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")


def run_main(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try: code = main([str(a) for a in argv])
        except SystemExit as e: code = e.code
    return code, err.getvalue()


def one_line(code, err, want=2):
    assert code == want and "Traceback" not in err and len(err.strip().splitlines()) == 1, (code, err)


def mknod(path, minor=3):
    "A character device like /dev/null (1, 3) or /dev/full (1, 7), made here."
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, minor))


@pytest.fixture
def keys(tmp_path):
    code, err = run_main(["keygen", "--out", tmp_path / "k"])
    assert code == 0, err
    return tmp_path / "k.key", tmp_path / "k.pub"


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    import torch
    p = tmp_path_factory.mktemp("prog") / "x.pt2"
    torch.export.save(torch.export.export(torch.nn.Linear(2, 2), (torch.randn(1, 2),)), p)
    return p


@ROOT_ONLY
def test_device_files_are_never_replaced(tmp_path, keys, program):
    "The issue's first case: `--force` onto a device made with mknod (and a symlink to one) leaves the device."
    null, full = tmp_path / "null", tmp_path / "full"
    mknod(null, 3); mknod(full, 7)
    (tmp_path / "link").symlink_to(null)
    for path in (null, tmp_path / "link"):
        with pytest.raises(InputError, match=r"not a regular file|is a device"):
            atomic_write(path, "x", force=True)
    for argv in (["sign", program, "--key", keys[0], "--out", full, "--force"],
                 ["sign", program, "--key", keys[0], "--out", full],
                 ["keygen", "--out", tmp_path / "null", "--force"]):              # writes null.key, null.pub: fine
        code, err = run_main(argv)
        if argv[0] == "keygen": assert code == 0, err; continue
        one_line(code, err)
        assert "--force" not in err, err                                         # no invitation to clobber a device
    (tmp_path / "rep").mkdir(); mknod(tmp_path / "rep" / "export_report.md")
    with pytest.raises(InputError, match="never replaced"):
        OutputFolder(tmp_path / "rep", ("export_report.md",), force=True).check()
    assert all(stat.S_ISCHR(os.stat(p).st_mode) for p in (null, full, tmp_path / "rep" / "export_report.md"))
    assert os.path.islink(tmp_path / "link")


def test_fifo_and_folder_targets_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "f")
    for force in (False, True):
        with pytest.raises(InputError, match=r"is a FIFO, not a regular file"):
            atomic_write(tmp_path / "f", "x", force=force)
        with pytest.raises(InputError, match="is a folder"): atomic_write(tmp_path, "x", force=force)
    assert stat.S_ISFIFO(os.stat(tmp_path / "f").st_mode)


def test_modes_follow_the_umask_and_force_keeps_a_files_mode(tmp_path):
    old = os.umask(0o027)
    try:
        code, err = run_main(["keygen", "--out", tmp_path / "k"])
        assert code == 0, err
        assert stat.S_IMODE(os.stat(tmp_path / "k.pub").st_mode) == 0o640        # the public key: the umask's mode
        assert stat.S_IMODE(os.stat(tmp_path / "k.key").st_mode) == 0o600        # the private key: owner only, always
        os.umask(0o022)
        assert stat.S_IMODE(atomic_write(tmp_path / "new.json", "{}").stat().st_mode) == 0o644
        (tmp_path / "mine.json").write_text("{}"); os.chmod(tmp_path / "mine.json", 0o604)
        assert stat.S_IMODE(atomic_write(tmp_path / "mine.json", "[]", force=True).stat().st_mode) == 0o604
    finally: os.umask(old)


def test_concurrent_writers_one_wins(tmp_path):
    "Without --force the file is created exclusively: of 8 threads writing one path at once exactly one succeeds."
    for trial in range(5):
        target, gate, won, lost = tmp_path / f"a{trial}.sdxa", threading.Barrier(8), [], []
        def write(i):
            gate.wait()
            try: atomic_write(target, f"writer {i}", force=False); won.append(i)
            except InputError: lost.append(i)
        threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
        for t in threads: t.start()
        for t in threads: t.join()
        assert len(won) == 1 and len(lost) == 7, (won, lost)
        assert target.read_text() == f"writer {won[0]}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"a{t}.sdxa" for t in range(5)]   # no temporary file left


def test_concurrent_signs_one_wins(tmp_path, keys, program):
    "The issue's race: 6 `sign --out a.sdxa` at once without --force: one exit 0, five exit 2, nothing replaced."
    gate, codes = threading.Barrier(6), []
    def sign():
        gate.wait()
        codes.append(run_main(["sign", program, "--key", keys[0], "--out", tmp_path / "a.sdxa"]))
    threads = [threading.Thread(target=sign) for _ in range(6)]
    for t in threads: t.start()
    for t in threads: t.join()
    assert sorted(c for c, _ in codes) == [0, 2, 2, 2, 2, 2], codes
    code, err = run_main(["verify", tmp_path / "a.sdxa", "--trusted-key", keys[1]])
    assert code == 0, err


def _report_files(d: Path) -> dict:
    return {p.name: p.read_bytes() for p in d.iterdir()}


def test_sigint_at_any_point_of_an_audit_leaves_one_report_whole(tmp_path, monkeypatch):
    """A SIGINT delivered at each file write of the staged report, and at each move of the commit: the folder holds the
    previous report or the new one, byte for byte, and no staging folder is left."""
    from static_dist.app import audit as A
    from static_dist import outputs, util
    from static_dist.usercode import watch_interrupts
    from static_dist.workload import load_workload
    sections = (A.graph_section,)
    old, new = load_workload("mlp", batch=2), load_workload("mlp", batch=4)
    out = tmp_path / "rep"
    A.audit(old, out, sections=sections)
    first = _report_files(out)
    ref = tmp_path / "ref"
    A.audit(new, ref, sections=sections)
    second = _report_files(ref)
    events = {"n": 0, "at": None}
    def hit():
        events["n"] += 1
        if events["n"] == events["at"]: os.kill(os.getpid(), signal.SIGINT)
    real_write, real_place = util.atomic_write, outputs.place
    monkeypatch.setattr(A, "atomic_write", lambda *a, **k: (hit(), real_write(*a, **k))[1])
    monkeypatch.setattr(outputs, "place", lambda *a, **k: (hit(), real_place(*a, **k))[1])
    events["at"] = 10**9; A.audit(new, out, sections=sections); total = events["n"]      # writes and moves, counted
    assert total >= 6, total                                   # 3 files written, then 3 moved into an existing folder
    seen = set()
    for at in range(1, total + 1):
        A.audit(old, out, sections=sections)                   # the previous report, again
        events.update(n=0, at=at)
        with watch_interrupts():
            try: A.audit(new, out, sections=sections)
            except KeyboardInterrupt: pass
        now = _report_files(out)
        volatile = lambda files: {
            k: v for k, v in files.items() if k != "audit.json"
        }  # audit.json holds the seconds taken
        assert volatile(now) in (volatile(first), volatile(second)), (at, sorted(now))
        assert now.keys() in (first.keys(), second.keys())
        seen.add("new" if volatile(now) == volatile(second) else "old")
    assert seen == {"old", "new"}                              # early signals keep the old report, late ones the new
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ref", "rep"]


def test_failed_runs_leave_no_folder_and_an_earlier_report_needs_force(tmp_path):
    for argv in (["audit", "--model", "nosuch", "--out", tmp_path / "a"],
                 ["check-export", "--model", "nosuch", "--out", tmp_path / "e"],
                 ["bench", "offload", "--model", "nosuch", "--out", tmp_path / "b"],
                 ["audit", "--budget", "0", "--out", tmp_path / "a"],
                 ["audit", "--out", tmp_path / ("x" * 300)]):
        one_line(*run_main(argv))
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "rep").mkdir(); (tmp_path / "rep" / "export_report.json").write_text("{}")
    code, err = run_main(["check-export", "--model", "mlp", "--out", tmp_path / "rep"])
    one_line(code, err); assert "pass --force" in err
    assert (tmp_path / "rep" / "export_report.json").read_text() == "{}"
    (tmp_path / "bench").mkdir(); (tmp_path / "bench" / "cli.json").write_text("{}")
    code, err = run_main(["bench", "cli", "--out", tmp_path / "bench"])
    one_line(code, err); assert "holds an earlier cli bench result" in err


def test_a_report_folder_that_appears_meanwhile_is_not_replaced(tmp_path):
    "Two check-export runs into one new folder: the second to finish fails (exit 2) instead of losing the first report."
    a, b = OutputFolder(tmp_path / "rep", ("r.md",)), OutputFolder(tmp_path / "rep", ("r.md",))
    sa, sb = a.__enter__(), b.__enter__()
    (sa / "r.md").write_text("a"); (sb / "r.md").write_text("b")
    a.__exit__(None, None, None)
    with pytest.raises(InputError, match="while this one was written"): b.__exit__(None, None, None)
    assert (tmp_path / "rep" / "r.md").read_text() == "a" and sorted(p.name for p in tmp_path.iterdir()) == ["rep"]


def test_a_target_folder_that_cannot_take_the_files_is_refused_before_work(tmp_path, monkeypatch):
    """An existing report folder that is not writable (a read-only mount, a folder of another user) is refused by
    check()."""
    from static_dist import outputs
    (tmp_path / "rep").mkdir()
    real = os.access
    monkeypatch.setattr(outputs.os, "access", lambda p, mode: real(p, mode) and Path(p) != tmp_path / "rep")
    with pytest.raises(InputError, match="folder is not writable"):
        OutputFolder(tmp_path / "rep", ("r.md",), force=True).check()


@ROOT_ONLY
def test_a_target_folder_on_another_file_system_is_staged_there(tmp_path):
    "A report folder that is a mount point: staged inside it, so the final renames never cross file systems (EXDEV)."
    import subprocess
    (tmp_path / "mnt").mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(tmp_path / "mnt")], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        (tmp_path / "mnt" / "r.md").write_text("old")
        with OutputFolder(tmp_path / "mnt", ("r.md",), force=True) as stage: (stage / "r.md").write_text("new")
        assert (tmp_path / "mnt" / "r.md").read_text() == "new" and sorted(os.listdir(tmp_path / "mnt")) == ["r.md"]
    finally: subprocess.run(["umount", str(tmp_path / "mnt")])
