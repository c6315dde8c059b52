"""The one launcher: a rank's failure comes back as a LaunchError with its traceback, a hung launch is killed, and the
FSDP example script trains a user's model end to end under torchrun."""
import subprocess
import sys
import time
from pathlib import Path

import pytest

from static_dist.launch import LaunchError, launch

ROOT = Path(__file__).resolve().parents[1]

RANKS = '''
import os, time
import torch.distributed as dist

def fail_on_last():
    dist.barrier()
    if dist.get_rank() == dist.get_world_size() - 1: raise ValueError("rank-side failure " + os.environ["RANK"])
    dist.barrier()                                          # the others wait here until torchrun stops them
    return "never"

def hang():
    time.sleep(600)
'''


def test_a_failing_rank_is_reported(tmp_path):
    (tmp_path / "ranks.py").write_text(RANKS)
    with pytest.raises(LaunchError) as e:
        launch(f"{tmp_path}/ranks.py:fail_on_last", 2, timeout=120)
    msg = str(e.value)
    assert "ValueError: rank-side failure 1" in msg and "rank 1" in msg, msg


def test_a_hung_launch_is_killed(tmp_path, monkeypatch):
    (tmp_path / "ranks.py").write_text(RANKS)
    import psutil
    monkeypatch.setenv("STATIC_DIST_TEST_TAG", str(tmp_path))   # the processes this launch starts inherit it
    def ours(p) -> bool:   # not another test's launch running beside this one (CI runs two pytest side by side)
        try: return p.environ().get("STATIC_DIST_TEST_TAG") == str(tmp_path)
        except psutil.Error: return False
    t0, started = time.perf_counter(), time.time()
    with pytest.raises(LaunchError, match="did not finish within 8 s"):
        launch(f"{tmp_path}/ranks.py:hang", 2, timeout=8)
    left = [p.pid for p in psutil.process_iter(["cmdline", "create_time"])
            if "static_dist.launch" in " ".join(p.info["cmdline"] or ()) and p.info["create_time"] >= started - 1
            and ours(p)]
    assert not left, f"ranks left running: {left}"            # torchrun and every rank it started were killed
    assert time.perf_counter() - t0 < 60, time.perf_counter() - t0


def test_example_trains_a_user_model_under_torchrun():
    "examples/train_fsdp.py: plan, apply_plan, train_step with the plan, on examples/gpt.py's GPT over 2 gloo ranks."
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(ROOT / "examples" / "train_fsdp.py"),
            "--model",
            f"{ROOT / 'examples' / 'gpt.py'}:GPT",
            "--steps",
            "6",
            "--batch",
            "2",
            "--seq",
            "32",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    losses = [float(l.split()[-1]) for l in p.stdout.splitlines() if l.startswith("step")]
    assert len(losses) == 2 and losses[1] < losses[0], p.stdout                 # steps 0 and 5: it learns
