"""`static-dist plan --float8` and `train --plan` with a Float8 plan, as a user runs them: the prediction on this CPU
(the converted model captured on fake tensors), the report and the torchtitan note, one-line refusals."""
import json
import pathlib
import subprocess
import sys

import pytest
import torch

pytest.importorskip("torchao")

from static_dist.parallel import ParallelPlan

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(*args, timeout=600):
    p = subprocess.run([sys.executable, "-m", "static_dist.app", *args], capture_output=True, text=True, cwd=ROOT,
                       timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def _error_line(err: str, verb: str) -> str:
    "The one error line of `verb` (torchao's own load warnings about its CUDA kernels aside)."
    lines = [l for l in err.strip().splitlines() if l.startswith(f"static-dist {verb}: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_plan_float8_tensorwise_with_all_gather(tmp_path):
    out_file = tmp_path / "p.json"
    code, out, err = run("plan", "--model", "tiny", "--world", "4", "--dp-shard", "4", "--budget", "1GiB",
                         "--float8", "tensorwise", "--float8-all-gather", "--emit", "torchtitan", "--out",
                         str(out_file))
    assert code == 0, err
    text = " ".join(out.split())
    assert "float8 tensorwise) on" in text and "FSDP gathers their weights in float8 (one byte per element)" in text
    assert "older releases: --model.converters float8 --float8.enable_fsdp_float8_all_gather" in text
    plan = ParallelPlan.from_json(out_file.read_text())
    assert (plan.float8, plan.float8_all_gather) == ("tensorwise", True)


def test_plan_float8_all_gather_needs_tensorwise():
    code, _, err = run("plan", "--model", "tiny", "--world", "4", "--float8", "rowwise", "--float8-all-gather")
    assert code == 2 and "needs --float8 tensorwise" in _error_line(err, "plan")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU may train float8")
def test_train_refuses_float8_without_an_sm89_gpu(tmp_path):
    plan = tmp_path / "f8.json"
    plan.write_text(ParallelPlan(float8="rowwise").to_json())
    code, _, err = run("train", "--model", "tiny", "--plan", str(plan), "--steps", "1", "--log", str(tmp_path / "l"))
    line = _error_line(err, "train")
    assert code == 2 and "compute capability 8.9+" in line and "this run is on cpu" in line, err
