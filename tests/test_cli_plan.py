"""`static-dist plan` and `static-dist train --plan` as a user runs them: the layout printed and written, pins, one-line
errors, predicted / measured under a fake process group, and the plan trained on 4 gloo ranks under torchrun next to
one process."""
import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from static_dist.fsdp import FSDPPlan, FSDPUnit
from static_dist.parallel import ParallelDims, ParallelPlan

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(*args, cwd=ROOT, timeout=300):
    p = subprocess.run([sys.executable, "-m", "static_dist.app", *args], capture_output=True, text=True, cwd=cwd,
                       timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def _one_line_error(code, err, *words):
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("static-dist plan: error:"), err
    assert "Traceback" not in err and all(w in lines[0] for w in words), err


def test_plan_tiny_world4_prints_and_writes_a_plan(tmp_path):
    code, out, err = run(
        "plan", "--model", "tiny", "--world", "4", "--budget", "1GiB", "--out", str(tmp_path / "p.json")
    )
    assert code == 0, err
    for what in (
        "layout:",
        "memory per rank",
        "sharded_params",
        "activations",
        "step time",
        "forward",
        "tokens/s per device",
        "MFU",
        "runner-up",
        "plan written to",
        "op_overhead assumed, not measured",      # the device table's unsourced numbers are flagged
    ):
        assert what in out, (what, out)
    plan = ParallelPlan.from_json(tmp_path / "p.json")
    assert plan.dims.world == 4 and len(plan.ac) == 2
    code, out, err = run("plan", "--model", "tiny", "--world", "4", "--out", str(tmp_path / "p.json"))
    _one_line_error(code, err, "p.json")                       # no overwrite without --force
    code, out, err = run(
        "plan", "--model", "tiny", "--world", "4", "--tp", "2", "--out", str(tmp_path / "p.json"), "--force"
    )
    assert code == 0, err
    assert ParallelPlan.from_json(tmp_path / "p.json").dims.tp == 2


def test_plan_pins_are_honoured(tmp_path):
    code, out, err = run("plan", "--model", "tiny", "--world", "4", "--dp-shard", "2", "--tp", "2", "--ac", "full",
                         "--out", str(tmp_path / "p.json"))
    assert code == 0, err
    plan = ParallelPlan.from_json(tmp_path / "p.json")
    assert (plan.dims.dp_shard, plan.dims.tp, plan.dims.pp, plan.dims.cp) == (2, 2, 1, 1)
    from static_dist.graph.policies import FullCheckpoint
    assert plan.ac == (FullCheckpoint(),) * 2 and "blocks 0-1 full" in out
    assert "runner-up" not in out                              # the pins leave one layout


@pytest.mark.parametrize("args,words", [
    (("--tp", "3"), ("--tp 3", "does not divide --world 4")),
    (("--tp", "2", "--pp", "4"), ("8 ranks", "does not divide")),
    (("--pp", "4"), ("pins", "relax a pin")),                   # 4 stages of a 2-block model
    (("--tp", "0"), ("--tp must be at least 1",)),
    (("--dp-replicate", "x"), ("whole number",)),
])
def test_plan_bad_pins_are_one_line(args, words):
    code, out, err = run("plan", "--model", "tiny", "--world", "4", *args)
    _one_line_error(code, err, *words)


def test_plan_verify_tiny_within_half_a_percent():
    "dp_shard 2 x tp 2 with sequence and loss parallelism: 0.9993 (0.98 before torch's loss_parallel copies)."
    code, out, err = run("plan", "--model", "tiny", "--world", "4", "--dp-shard", "2", "--tp", "2", "--verify")
    assert code == 0, err
    line = next(l for l in out.splitlines() if l.startswith("verify: world 4"))
    ratio = float(line.split(" = ")[1].split(";")[0])
    assert abs(ratio - 1) < 0.005 and "collectives match" in line, line


def _train(tmp_path, plan: ParallelPlan, nproc: int | None, batch: int | None = None, steps: int = 3):
    """`train --plan` under torchrun (nproc ranks) or alone; its process and log. `batch`: the workload's (per
    micro-batch)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "plan.json").write_text(plan.to_json())
    cmd = [
        "-m",
        "static_dist.app",
        "train",
        "--plan",
        "plan.json",
        "--model",
        "tiny",
        "--steps",
        str(steps),
        "--no-compile",
    ]
    cmd += ["--batch", str(batch)] if batch else []
    pre = [sys.executable] + (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc else []
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(pre + cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return p, json.loads((tmp_path / "train_log.json").read_text())


def test_train_plan_dp2_tp2_on_4_gloo_ranks_matches_one_process(tmp_path):
    code, out, err = run("plan", "--model", "tiny", "--world", "4", "--dp-shard", "2", "--tp", "2",
                         "--out", str(tmp_path / "p.json"))
    assert code == 0, err
    plan = ParallelPlan.from_json(tmp_path / "p.json")
    p, log = _train(tmp_path / "four", plan, 4)
    assert [f.name for f in (tmp_path / "four").iterdir() if f.name.startswith("train_log")] == ["train_log.json"]
    assert "appeared while writing" not in p.stderr
    assert log["world"] == 4 and sorted(r["rank"] for r in log["peaks"]) == [0, 1, 2, 3]
    assert all(r["peak_bytes"] > 0 and r["peak_is"] == "torch MemTracker" for r in log["peaks"])
    # the prediction beside each rank's measured peak (the same quantity: MemTracker on CPU) agrees with it
    assert all(abs(r["predicted_bytes"] / r["peak_bytes"] - 1) < 0.03 for r in log["peaks"]), log["peaks"]
    assert "predicted" in p.stdout, p.stdout
    _, one = _train(tmp_path / "one", ParallelPlan(name="one process"), None, batch=4)   # the same 2 x 2 rows at once
    assert one["world"] == 1 and len(one["peaks"]) == 1
    assert len(log["losses"]) == len(one["losses"]) == 3
    for a, b in zip(log["losses"], one["losses"]):
        assert abs(a - b) <= 1e-4 * abs(b), (log["losses"], one["losses"])


# The pipeline path of `train --plan` is `parallel.plan_step`, which tests/test_parallel_dist.py runs for pp 2 x
# dp_shard 2
# on 4 gloo ranks against one process; here the verb's path and each pipeline rank's predicted peak against its measured
# one: the schedule's receive buffers, the outputs it keeps and FSDP as it runs under it (a first stage was 6% under
# before they were modelled, a stage without FSDP 14%).
@pytest.mark.parametrize("pins", [("--pp", "2", "--dp-shard", "2"), ("--pp", "2", "--tp", "2", "--dp-shard", "1")])
def test_train_pipeline_plan_peaks_as_predicted(tmp_path, pins):
    code, out, err = run(
        "plan", "--model", "tiny", "--world", "4", *pins, "--ac", "none", "--out", str(tmp_path / "p.json")
    )
    assert code == 0, err
    plan = ParallelPlan.from_json(tmp_path / "p.json")
    assert plan.dims.pp == 2 and plan.microbatches > plan.dims.pp
    _, log = _train(tmp_path / "run", plan, 4)
    assert sorted(r["rank"] for r in log["peaks"]) == [0, 1, 2, 3]
    assert all(abs(r["predicted_bytes"] / r["peak_bytes"] - 1) < 0.03 for r in log["peaks"]), log["peaks"]


def test_train_plan_world_must_match(tmp_path):
    (tmp_path / "p.json").write_text(ParallelPlan(ParallelDims(dp_shard=4)).to_json())
    code, out, err = run("train", "--plan", str(tmp_path / "p.json"), "--model", "tiny", "--steps", "1", "--no-compile",
                         "--log", str(tmp_path / "log.json"))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "4 ranks" in err and "torchrun" in err, err
    assert not (tmp_path / "log.json").exists()


def test_plain_train_under_torchrun_writes_one_log(tmp_path):
    """`train` without --plan on 2 gloo ranks: every rank trains, rank 0 alone writes the log (no 'appeared while
    writing')."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                        "static_dist.app", "train", "--model", "tiny", "--steps", "2", "--no-compile"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env)
    assert p.returncode == 0 and "appeared while writing" not in p.stderr, p.stderr[-3000:]
    assert [f.name for f in tmp_path.iterdir()] == ["train_log.json"]
    assert json.loads((tmp_path / "train_log.json").read_text())["world"] == 2


@pytest.mark.parametrize("argv,words", [
    (["plan", "--model", "tiny", "--world", "4", "--out", "/nonexistent/p.json"], ("/nonexistent",)),
    (["plan", "--model", "tiny", "--world", "4", "--topology", "nosuch"], ("--topology",)),
    (["plan", "--model", "mlp", "--world", "4"], ("repeated blocks",)),
    (["train", "--plan", __file__, "--model", "tiny", "--no-compile"], ("parallel plan",)),
])
def test_plan_inputs_refused_in_one_line(argv, words, tmp_path):
    p = subprocess.run([sys.executable, "-m", "static_dist.app", *argv], capture_output=True, text=True, cwd=tmp_path,
                       timeout=300)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert all(w in lines[0] for w in words), p.stderr


# GPipe holds every micro-batch before its first backward, when it has no gradients yet: predicted from the schedule's
# own order (`parallel.schedule`), not a count of micro-batches in flight times the whole step (which was 10% and 6%
# over
# on the 4-block model).
def test_train_gpipe_plan_peaks_as_predicted(tmp_path):
    import dataclasses
    code, out, err = run("plan", "--model", "tiny", "--world", "4", "--pp", "2", "--dp-shard", "2", "--ac", "none",
                         "--out", str(tmp_path / "p.json"))
    assert code == 0, err
    plan = dataclasses.replace(ParallelPlan.from_json(tmp_path / "p.json"), schedule="GPipe")
    _, log = _train(tmp_path / "run", plan, 4)
    assert all(abs(r["predicted_bytes"] / r["peak_bytes"] - 1) < 0.01 for r in log["peaks"]), log["peaks"]


def test_plan_tp_on_a_model_without_tp_styles_is_refused(tmp_path):
    """GPT-2's projections are Conv1D, which Megatron's styles do not split: tp would only repeat work, so it is never
    chosen."""
    transformers = pytest.importorskip("transformers")
    transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=128, bos_token_id=0,
                            eos_token_id=0).save_pretrained(tmp_path)
    code, out, err = run(
        "plan", "--model", f"hf:{tmp_path / 'config.json'}", "--world", "4", "--tp", "2", "--seq", "64"
    )
    _one_line_error(code, err, "tp=2", "GPT2Block", "pin tp 1")
    code, out, err = run("plan", "--model", f"hf:{tmp_path / 'config.json'}", "--world", "4", "--seq", "64")
    assert code == 0, err
    assert "× tp 1 ×" in out, out


@pytest.mark.parametrize("model,words", [("examples/gpt.py:GPT", "aten.arange inside its forward"),
                                         ("tiny", "needs CUDA attention kernels")])
def test_train_context_parallel_refused_before_the_ranks_train(tmp_path, model, words):
    """Issue 30 item 1: a cp plan whose model builds its positions inside the forward would train wrongly (its losses
    differed from one process from step 0); on CPU, torch's ring attention has no SDPA kernel. Both are refused in one
    line on every rank, before training, and no log is written."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    plan = ParallelPlan(ParallelDims(cp=2), fsdp=FSDPPlan(2, (2,), (FSDPUnit(""),)))
    (tmp_path / "plan.json").write_text(plan.to_json())
    if torch.cuda.is_available() and model == "tiny": pytest.skip("CUDA runs ring attention: tests/test_parallel_dist")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # torchrun stops the other workers once one fails: watching every 5 s, not 0.1, lets the second rank say its line
    # too on a busy machine (both refused in the CI run of session 8, each 1 line short)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        "--monitor-interval=5", "-m", "static_dist.app", "--", "train", "--plan", "plan.json",
                        "--model", model, "--batch", "2", "--seq", "64", "--steps", "2", "--no-compile", "--log",
                        "run.json"], capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env)
    lines = [l for l in p.stderr.splitlines() if l.startswith("static-dist train: error: cp 2:")]
    assert p.returncode != 0 and len(lines) == 2 and all(words in l for l in lines), p.stderr[-3000:]
    assert not (tmp_path / "run.json").exists()


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_gemma2_checkpointed_tp_collectives_exact(tmp_path, ac):
    """Issue 30 item 6: Gemma 2 normalizes the feed-forward's output before the residual (post_feedforward_layernorm),
    so a checkpointed block's recompute must issue the last tensor-parallel all-reduce again to rebuild the norm's
    saved input (Llama's recompute stops before it). Counted 12 against 16 measured before."""
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="gemma2", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=128, sliding_window=32)))
    code, out, err = run("plan", "--model", f"hf:{tmp_path / 'config.json'}", "--batch", "2", "--seq", "32", "--world",
                         "2", "--tp", "2", "--ac", ac, "--verify")
    assert code == 0, err
    line = next(l for l in out.splitlines() if l.startswith("verify: collectives per step"))
    pred, meas = line.split("predicted ")[1].split(", measured ")
    assert ast.literal_eval(pred) == ast.literal_eval(meas) and ast.literal_eval(meas)["tp.all_reduce"] == 8, line


def test_plan_offers_context_parallelism_only_where_it_is_correct(tmp_path):
    """Issue 30 item 1: the GPT example builds its positions with arange inside forward, so a cp layout would train it
    wrongly: --cp 2 is refused naming why, and the search never offers cp > 1 for it. cp x pp is refused (torch's
    context_parallel wraps one forward/backward, not a schedule)."""
    code, out, err = run("plan", "--model", "examples/gpt.py:GPT", "--batch", "4", "--seq", "64", "--world", "4",
                         "--cp", "2")
    _one_line_error(code, err, "cp=2", "aten.arange inside its forward")
    code, out, err = run("plan", "--model", "examples/gpt.py:GPT", "--batch", "4", "--seq", "64", "--world", "8",
                         "--budget", "1MiB", "--out", str(tmp_path / "p.json"))
    if code == 0: assert ParallelPlan.from_json(tmp_path / "p.json").dims.cp == 1
    assert "cp 2" not in out and "× cp" not in out, out
    import pytest as _pt
    from static_dist.parallel import ParallelPlanError
    with _pt.raises(ParallelPlanError, match="cp 2 x pp 2"):
        ParallelPlan(ParallelDims(dp_shard=1, cp=2, pp=2), stages=(1, 1), microbatches=2)


def test_train_plan_trains_the_workload_it_was_planned_for(tmp_path):
    """A plan searched at batch 4 x seq 32 trains batch 4 x seq 32 without being told (the plan file's record); another
    batch or model is refused in one line; one step's peak is not compared with a steady step's prediction."""
    code, _, err = run("plan", "--model", "tiny", "--world", "1", "--batch", "4", "--seq", "32",
                       "--out", str(tmp_path / "p.json"))
    assert code == 0, err
    rec = json.loads((tmp_path / "p.json").read_text())["planned_for"]
    assert (rec["source"], rec["batch"], rec["seq"], rec["optimizer"]) == ("tiny", 4, 32, "adamw")
    log = tmp_path / "log.json"
    train = ("train", "--plan", str(tmp_path / "p.json"), "--no-compile", "--log", str(log))
    code, out, err = run(*train, "--steps", "2")
    assert code == 0, err
    got = json.loads(log.read_text())
    assert (got["workload"]["batch"], got["workload"]["seq"]) == (4, 32)
    assert got["peaks"][0]["ratio"] is not None and "× measured" in out
    for extra, words in ((("--batch", "2"), ("--batch 2", "batch 4")), (("--model", "small"), ("parameters", "tiny"))):
        code, _, err = run(*train, "--steps", "2", "--force", *extra)
        assert code == 2 and len(err.strip().splitlines()) == 1 and all(w in err for w in words), err
    code, out, err = run(*train, "--steps", "1", "--force")
    assert code == 0, err
    assert json.loads(log.read_text())["peaks"][0]["ratio"] is None
    assert "not compared: one step" in out and "--steps 2 or more" in err


def test_plan_offers_no_pipeline_to_a_model_whose_forward_is_its_loss(tmp_path):
    """Issue 30 item 13: an hf: causal LM returns its own loss, and a pipeline schedule needs targets for the loss on
    its last stage (train --plan refused it, "a pipeline needs targets"): --pp 2 is refused at plan time, naming why,
    and the search never offers pp > 1 for it."""
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)))
    hf = ("--model", f"hf:{tmp_path / 'config.json'}", "--batch", "4", "--seq", "32")
    code, out, err = run("plan", *hf, "--world", "4", "--pp", "2")
    _one_line_error(code, err, "pp=2", "LlamaForCausalLM computes its loss inside its forward", "pin pp 1")
    code, out, err = run("plan", *hf, "--world", "8", "--budget", "2MiB", "--out", str(tmp_path / "p.json"))
    if code == 0: assert ParallelPlan.from_json(tmp_path / "p.json").dims.pp == 1
    assert "× pp 2" not in out and "× pp 4" not in out, out


def test_reserved_replay_of_a_70b_layout_stays_near_its_allocated():
    """A regression: with FSDP2's forward all-gather output kept to the next unit's copy-out, the reserved replay's
    intervals chained across blocks and reserved 169.46 GiB for 34.30 GiB allocated (so the search found no 70B layout
    at 256 ranks). The caching allocator reserves the live bytes plus the free blocks it caches, which the replay
    finds at 49.79 GiB here; a replay over 1.6 x allocated is a broken replay, not fragmentation."""
    import re
    code, out, err = run("plan", "--model", "llama3-70b", "--world", "256", "--seq", "8192", "--batch", "1",
                         "--dp-shard", "32", "--cp", "4", "--tp", "2", "--ac", "selective")
    assert code == 0, err
    got = re.search(r"allocated ([\d.]+) GiB, reserved ([\d.]+) GiB", " ".join(out.split()))
    alloc, rsv = map(float, got.groups())
    assert alloc <= rsv < 1.6 * alloc, (alloc, rsv)
