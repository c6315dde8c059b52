"""A stuck, killed or orphaned rank ends a torchrun job of `train --plan` within a bounded time, with one line per
surviving rank (which rank, which collective, what to do), a non-zero exit and no step log (issue 30, items 8 and 9).
Each case runs the README's command line on 2 gloo ranks and acts on one rank from outside, as a user's fault would."""
import os, signal, subprocess, sys, time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc to find the ranks")


def _ranks(cwd: Path) -> dict[int, int]:
    "{RANK: pid} of the train ranks running in `cwd` (this test's job only)."
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit(): continue
        try:
            if os.readlink(d / "cwd") != str(cwd): continue
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            env = dict(kv.split(b"=", 1) for kv in (d / "environ").read_bytes().split(b"\0") if b"=" in kv)
        except OSError: continue
        if b"static_dist.app" in cmd and b"train" in cmd and env.get(b"TORCHELASTIC_RUN_ID") and b"RANK" in env:
            out[int(env[b"RANK"])] = int(d.name)
    return out


def _start(tmp_path: Path, *extra: str) -> subprocess.Popen:
    "torchrun of `train --plan` (dp_shard 2 of the tiny model, many steps), as the README writes it (with `--`)."
    from static_dist.app.cli import main
    assert (
        main(["plan", "--model", "tiny", "--world", "2", "--dp-shard", "2", "--out", str(tmp_path / "plan.json")]) == 0
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # torchrun looks at its ranks every 5 s, not 0.1: the surviving rank says its line before the agent stops it (on
    # a loaded 2-core machine torchrun has SIGTERMed rank 0 before it printed, as in test_cli_plan's cp refusal)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--monitor-interval", "5", "-m",
           "static_dist.app", "--", "train", "--plan", "plan.json", "--model", "tiny", "--steps", "1000000",
           "--no-compile", "--log", "run.json", *extra]
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _training(p: subprocess.Popen, cwd: Path, seconds: float = 15) -> dict[int, int]:
    "Both ranks' pids once they have run `seconds` (past start-up, inside the step loop's collectives)."
    t0 = time.monotonic()
    while time.monotonic() - t0 < 120:
        if len(r := _ranks(cwd)) == 2: break
        time.sleep(0.5)
    assert len(r) == 2, "the ranks did not start"
    time.sleep(seconds)
    assert p.poll() is None, p.communicate()[1][-2000:]
    return r


def _finish(p: subprocess.Popen, ranks: dict, limit: float) -> tuple[str, float]:
    "stderr of torchrun once it ends (killing what is left after `limit` s), and how long it took."
    t0 = time.monotonic()
    try: _, err = p.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        for pid in [*ranks.values(), p.pid]:
            try: os.kill(pid, signal.SIGKILL)
            except ProcessLookupError: pass
        _, err = p.communicate()
        pytest.fail(f"the job did not end within {limit} s: {err[-2000:]}")
    for pid in ranks.values():                          # a stopped rank torchrun could not end
        try: os.kill(pid, signal.SIGKILL)
        except ProcessLookupError: pass
    return err, time.monotonic() - t0


def test_stuck_rank_ends_the_job_in_bounded_time(tmp_path):
    p = _start(tmp_path, "--collective-timeout", "10")
    ranks = _training(p, tmp_path)
    os.kill(ranks[1], signal.SIGSTOP)                   # a hung rank: alive, silent, holding its sockets
    err, took = _finish(p, ranks, 150)                   # 10 s timeout + torchrun's 30 s grace to stop the others
    lines = [l for l in err.splitlines() if l.startswith("static-dist train: error: rank 0:")]
    assert p.returncode != 0 and len(lines) == 1, err[-3000:]
    assert "did not complete within 10 s" in lines[0] and "--collective-timeout" in lines[0], lines[0]
    assert "gloo" not in err and "unbound_buffer" not in err, err[-3000:]   # gloo's own message stays inside
    assert not (tmp_path / "run.json").exists()


def test_killed_rank_gives_one_line_not_a_gloo_traceback(tmp_path):
    p = _start(tmp_path)
    ranks = _training(p, tmp_path)
    os.kill(ranks[1], signal.SIGKILL)
    err, took = _finish(p, ranks, 90)
    lines = [l for l in err.splitlines() if l.startswith("static-dist train: error: rank 0:")]
    assert p.returncode != 0 and len(lines) == 1 and "a peer rank is gone" in lines[0], err[-3000:]
    assert "pair.cc" not in err and "Connection reset by peer. This is typically" not in err, err[-3000:]
    # the only traceback left is torchrun's own report of the failed job
    assert err.count("Traceback (most recent call last)") <= 1, err[-3000:]
    assert not (tmp_path / "run.json").exists()


def test_ranks_exit_with_torchrun(tmp_path):
    p = _start(tmp_path)
    ranks = _training(p, tmp_path, seconds=5)
    os.kill(p.pid, signal.SIGKILL)                       # torchrun's agent gone: its ranks must not live on
    t0 = time.monotonic()
    while time.monotonic() - t0 < 20 and any(Path(f"/proc/{pid}").exists() and
                                             "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
                                             for pid in ranks.values()):
        time.sleep(0.5)
    alive = [pid for pid in ranks.values() if Path(f"/proc/{pid}").exists()
             and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]]
    for pid in alive: os.kill(pid, signal.SIGKILL)
    _, err = p.communicate()
    assert not alive, f"ranks {alive} outlived torchrun"
    # a rank that says why says one line: its watcher saw torchrun go, or its collective lost the peer that left first;
    # a rank can also go without a word (seen in about 1 run of 3 on a busy 2-core machine, before this session's
    # changes too: rank 0 silent while rank 1 said torchrun was gone), so at least one line, none a traceback
    gone = [l for l in err.splitlines() if "torchrun (pid" in l and "is gone" in l]
    lost = [l for l in err.splitlines() if "failed because a peer rank is gone" in l]
    assert gone and len(gone) + len(lost) <= 2 and "Traceback" not in err, err[-2000:]


_AGENT = """
import os, subprocess, sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
env = {**os.environ, "TORCHELASTIC_RUN_ID": "t", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
code = "from static_dist.launch import init_process_group; init_process_group('gloo')"
child = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=open(sys.argv[1], "w"))
keys = store.num_keys()
while store.num_keys() == keys: time.sleep(0.1)      # rank 0 is inside init_process_group, waiting for rank 1
print(child.pid, flush=True)
child.wait()
"""


def test_torchrun_killed_while_a_rank_joins_the_group(tmp_path):
    "torchrun's store closes under a joining rank before the rank is re-parented: still one line, no traceback."
    err = tmp_path / "rank0.err"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    agent = subprocess.Popen([sys.executable, "-c", _AGENT, str(err)], env=env, stdout=subprocess.PIPE, text=True)
    rank = int(agent.stdout.readline())
    time.sleep(1)
    os.kill(agent.pid, signal.SIGKILL)
    agent.wait()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 20 and Path(f"/proc/{rank}").exists(): time.sleep(0.2)
    alive = Path(f"/proc/{rank}").exists()
    if alive: os.kill(rank, signal.SIGKILL)
    text = err.read_text()
    assert not alive, "the rank outlived torchrun"
    # c10d's own C++ warning of the closed store may come first; from Python, one line and no traceback
    gone = [l for l in text.splitlines() if "is gone" in l]
    assert gone == [f"rank 0: torchrun (pid {agent.pid}) is gone; this rank exits"], text[-2000:]
    assert "Traceback (most recent call last)" not in text, text[-2000:]
