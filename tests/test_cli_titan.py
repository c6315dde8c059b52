"""`static-dist plan --torchtitan`: a torchtitan job predicted as written (against torchtitan's own code applied under a
fake process group, `titan.measure_titan`), an older .toml job file, and `--emit torchtitan` parsed by torchtitan."""
import contextlib
import importlib.util
import io
import shlex

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                                reason='torchtitan is not installed: pip install "static_dist[titan]"')


def _plan(*argv) -> tuple[int, str]:
    from static_dist.app.cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out): code = main(["plan", *argv])
    return code, " ".join(out.getvalue().split())         # rich wraps lines at the terminal's width


def test_llama3_8b_job_predicted_by_category():
    code, out = _plan("--torchtitan", "llama3_8b", "--world", "16")
    assert code == 0, out
    assert "torchtitan llama3_8b as written (local batch 1, seq 8192, selective checkpointing)" in out
    assert "3 of 32 blocks captured" in out               # the few-block capture, not 32 blocks
    assert "dp_shard 16 × cp 1 × tp 1 × pp 1 (world 16)" in out  # dp_shard -1: what the other degrees leave
    for cat in ("sharded_params", "optimizer_state", "activations", "peak", "tokens/s per device, MFU"):
        assert cat in out, cat
    assert "verdict" in out and "float8 off; compile off" in " ".join(out.split())


def test_toml_job(tmp_path):
    f = tmp_path / "job.toml"
    f.write_text('[model]\nname = "llama3"\nflavor = "debugmodel"\n[training]\nlocal_batch_size = 4\nseq_len = 512\n'
                 'mixed_precision_param = "float32"\n[parallelism]\ndata_parallel_shard_degree = 2\n'
                 'tensor_parallel_degree = 2\n[activation_checkpoint]\nmode = "full"\n[compile]\nenable = true\n'
                 '[float8]\nenable_float8_linear = true\n')
    from static_dist.titan import titan_toml
    j = titan_toml(f)
    assert (j.local_batch, j.seq_len, j.dp_shard, j.tp, j.ac, j.param_dtype, j.compile, j.float8) == (
        4, 512, 2, 2, "full", "float32", True, True)
    code, out = _plan("--torchtitan", str(f))               # --world: the product of its degrees
    assert code == 0, out
    assert "dp_shard 2 × cp 1 × tp 2 × pp 1 (world 4)" in out and "blocks 0-5 full" in out
    assert "float32 master weights and optimizer state, float32 compute" in out
    text = " ".join(out.split())
    assert "float8 tensorwise: priced (torchao's ops captured); compile on, priced" in text
    assert "compiled: 6 blocks, priced" in text              # the job as written compiles every block


def test_emit_torchtitan_parses_in_torchtitan():
    "Every emitted option is one torchtitan 0.3.0's own parser takes, and the config it builds is the layout's."
    import warnings
    from torchtitan.config.manager import ConfigManager
    code, out = _plan("--torchtitan", "llama3_debugmodel", "--world", "8", "--emit", "torchtitan")
    assert code == 0, out
    argv = shlex.split(out[out.index("--parallelism."):].split(" note: ")[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = ConfigManager().parse_args(["--module", "llama3", "--config", "llama3_debugmodel", *argv])
    opts = dict(zip(argv[:-1:2], argv[1::2]))
    p = cfg.parallelism
    assert (p.data_parallel_shard_degree, p.tensor_parallel_degree, p.context_parallel_degree) == (
        int(opts["--parallelism.data_parallel_shard_degree"]), int(opts["--parallelism.tensor_parallel_degree"]),
        int(opts["--parallelism.context_parallel_degree"]))
    assert cfg.training.local_batch_size == int(opts["--training.local_batch_size"]) == 8
    assert argv[-1].startswith("activation-checkpoint:")
    # and a name torchtitan does not have is refused by the same parser: the check above can fail
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        ConfigManager().parse_args(["--module", "llama3", "--config", "llama3_debugmodel",
                                    "--parallelism.tensor_parallel_size", "2"])


def test_job_prediction_matches_torchtitan_at_2_layers():
    "The 8B job as written, cut to 2 layers: static_dist's prediction against torchtitan's own apply, within 1%."
    from static_dist.app.layout import layout_topology, titan_prediction
    from static_dist.parallel import predict_axis_counts, rank_profile
    from static_dist.titan import measure_titan, titan_job
    job = titan_job("llama3_8b", layers=2, seq_len=256, local_batch=1, ac="none", dp_shard=8)
    g, n, how, given = titan_prediction(job, 8, layout_topology(None, 8))
    assert (n, how) == (2, "full capture (2 blocks: captured whole)")
    m = measure_titan(job, 8)
    ratio = given.memory_bytes / m.peak_bytes
    print(f"predicted {given.memory_bytes} / measured {m.peak_bytes} = {ratio:.5f}")
    assert abs(ratio - 1) <= 0.01, ratio
    counts = predict_axis_counts(rank_profile(g, given.plan, master_dtype=job.master_dtype), given.plan)
    assert {f"dp.{k}": v for k, v in m.collectives.items() if v} == counts


def test_emit_torchtitan_of_a_searched_layout():
    "`--emit torchtitan` on the normal search: the overrides carry the degrees of the layout it printed."
    import re
    code, out = _plan("--model", "tiny", "--world", "4", "--tp", "2", "--emit", "torchtitan")
    assert code == 0, out
    d = dict(re.findall(r"(dp_replicate|dp_shard|cp|tp|pp) (\d+)", out[out.index("layout:"):out.index("(world 4)")]))
    names = {"dp_replicate": "data_parallel_replicate", "dp_shard": "data_parallel_shard", "cp": "context_parallel",
             "tp": "tensor_parallel", "pp": "pipeline_parallel"}
    for k, v in d.items(): assert f"--parallelism.{names[k]}_degree {v} " in out, (k, v)
    assert d["tp"] == "2" and "--parallelism.enable_sequence_parallel" in out


def test_plan_async_tp_priced_written_and_emitted(tmp_path):
    "`plan --async-tp`: the chosen sequence-parallel layout carries async TP (compiled blocks, as torchtitan requires),"
    "its step time is the plan's with the overlap, and `--emit torchtitan` writes it as torchtitan's own options."
    import warnings
    from torchtitan.config.manager import ConfigManager
    from static_dist.parallel import ParallelPlan, predict_step_time, rank_work
    from static_dist.app.layout import layout_topology
    from static_dist.workload import load_workload
    f = tmp_path / "p.json"
    code, out = _plan("--model", "tiny", "--world", "4", "--tp", "2", "--async-tp", "--emit", "torchtitan",
                      "--out", str(f))
    assert code == 0, out
    plan = ParallelPlan.from_json(f)
    assert plan.async_tp and plan.sequence_parallel and all(plan.compile), plan
    argv = shlex.split(out[out.index("--parallelism."):].split(" note: ")[0].split(" plan written to ")[0])
    assert "--compile.enable_async_tensor_parallel" in argv
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = ConfigManager().parse_args(["--module", "llama3", "--config", "llama3_debugmodel", *argv])
    assert cfg.compile.enable and cfg.compile.enable_async_tensor_parallel
    import dataclasses
    topo, g = layout_topology(None, 4), load_workload("tiny").graph()
    sync = dataclasses.replace(plan, async_tp=False)
    t_async, t_sync = (predict_step_time(rank_work(g, p, topo), p, topo).terms["tp"] for p in (plan, sync))
    assert t_async < t_sync, (t_async, t_sync)       # the overlap is priced: fails if async_tp were only a label


def test_torchtitan_job_reads_async_tp(tmp_path):
    "A job that sets async TP (llama3_405b's `compile.enable_async_tensor_parallel`; here an older .toml) is predicted "
    "with it, and --async-tp beside --torchtitan is refused: the job sets it."
    f = tmp_path / "job.toml"
    f.write_text('[model]\nname = "llama3"\nflavor = "debugmodel"\n[training]\nlocal_batch_size = 2\nseq_len = 256\n'
                 '[parallelism]\ndata_parallel_shard_degree = 2\ntensor_parallel_degree = 2\n'
                 '[compile]\nenable = true\nenable_async_tensor_parallel = true\n')
    code, out = _plan("--torchtitan", str(f))
    assert code == 0, out
    assert "async TP on (priced: its overlap)" in out and "loss in 8 chunks" in out
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        from static_dist.app.cli import main
        code = main(["plan", "--torchtitan", "llama3_8b", "--async-tp"])
    assert code != 0 and "--async-tp" in err.getvalue() and "Traceback" not in err.getvalue(), err.getvalue()


def test_deepseek_v3_16b_job_planned_with_its_ep():
    """torchtitan's DeepSeek-V3 16B job (its registry: 27 layers, the first dense, then mixtures of 64 experts; ep 8 of
    dp_shard 8) as written: its expert parallelism in the layout, the all-to-alls in the step time, its routing
    torchtitan's balanced debug routing; `--emit torchtitan` names its module."""
    code, out = _plan("--torchtitan", "deepseek_v3_16b", "--world", "8", "--emit", "torchtitan")
    assert code == 0, out
    assert "torchtitan deepseek_v3_16b as written (local batch 4, seq 4096, selective checkpointing)" in out
    assert "3 of 26 blocks captured" in out                # the 26 mixtures after the dense first layer
    assert "dp_shard 8 × cp 1 × tp 1 × pp 1 (world 8), ep 8 of dp_shard × cp" in out
    assert float(out.split(" ep ")[1].split()[0]) > 0, out          # the step time's ep term, in ms
    assert "for torchtitan/train.py --module deepseek_v3 --config NAME" in out


def test_emit_ep_parses_in_torchtitan():
    "A layout with ep 2 as torchtitan's overrides: its own parser reads the expert-parallel degree."
    import warnings
    from torchtitan.config.manager import ConfigManager
    from static_dist.parallel import ParallelDims, ParallelPlan
    from static_dist.titan import titan_overrides
    argv, _ = titan_overrides(ParallelPlan(ParallelDims(dp_shard=4, ep=2)), 2, 256, "float32")
    assert "--parallelism.expert_parallel_degree" in argv
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = ConfigManager().parse_args(["--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel", *argv])
    assert (cfg.parallelism.expert_parallel_degree, cfg.parallelism.data_parallel_shard_degree) == (2, 4)
