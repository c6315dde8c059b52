"""FSDP2 over gloo (torchrun, 2 ranks): global gradient norms against a single process, one NaN skipped by all ranks."""
import json
import os
import subprocess
import sys
from pathlib import Path


def test_fsdp_global_norms_and_nan_guard(tmp_path):
    out = tmp_path / "fsdp.json"
    script = Path(__file__).parent / "dist_stability.py"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(script), str(out)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["world"] == 2 and rep["accum"] == 2
    assert rep["max_rel_err_per_param_norm"] < 1e-5                                   # per parameter, all ranks
    assert abs(rep["total_norm_fsdp"] / rep["total_norm_single"] - 1) < 1e-6
    assert abs(rep["total_norm_local_shards_only"] / rep["total_norm_single"] - 1) > 0.05   # the all-reduce matters
    assert rep["finite"] and rep["final_param_max_abs_diff"] < 1e-5
    for r in rep["ranks"]:                        # the NaN was injected on rank 1 only; both ranks skip step 2
        assert r["actions"] == ["update", "update", "skip", "update"], r
        assert r["alarms"][2] == ["nonfinite"]
    assert rep["ranks"][1]["localization"][2] == "tok_embeddings"
