"""FSDP2 over gloo (torchrun, 2 ranks): global gradient norms against a single process, one NaN skipped by all ranks."""
from static_dist.stability import run_fsdp_check


def test_fsdp_global_norms_and_nan_guard():
    rep = run_fsdp_check(2)                       # the package's launcher: 2 gloo ranks under torchrun, rank 0's report
    assert rep["world"] == 2 and rep["accum"] == 2
    assert rep["max_rel_err_per_param_norm"] < 1e-5                                   # per parameter, all ranks
    assert abs(rep["total_norm_fsdp"] / rep["total_norm_single"] - 1) < 1e-6
    assert abs(rep["total_norm_local_shards_only"] / rep["total_norm_single"] - 1) > 0.05   # the all-reduce matters
    assert rep["finite"] and rep["final_param_max_abs_diff"] < 1e-5
    for r in rep["ranks"]:                        # the NaN was injected on rank 1 only; both ranks skip step 2
        assert r["actions"] == ["update", "update", "skip", "update"], r
        assert r["alarms"][2] == ["nonfinite"]
    assert rep["ranks"][1]["localization"][2] == "tok_embeddings"
