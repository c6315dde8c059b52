"""Stability monitors against injected faults whose ground truth is known (tiny Llama, Markov tokens, one thread)."""
import copy
import json
import math
import subprocess
import sys

import pytest
import torch

from static_dist.stability import (STRATEGIES, Fault, RunConfig, Trainer, grad_norms, stability_bench, total_norm,
                                   train, bench_markdown)
from static_dist.zoo import get_model

NAN_SITES = [("nan_grad", "tok_embeddings"), ("nan_activation", "tok_embeddings"),
             ("nan_activation", "layers.0.attention.wq"), ("nan_activation", "layers.0.attention"),
             ("nan_activation", "layers.1.feed_forward.w2"), ("nan_activation", "layers.1.ffn_norm"),
             ("nan_activation", "norm"), ("nan_activation", "output"), ("nan_grad", "layers.1.feed_forward.w1"),
             ("nan_grad", "layers.0.attention.wo")]
CONFIGS = {"fp32": {}, "bf16": dict(amp=True), "checkpoint": dict(checkpoint=True),
           "bf16+checkpoint": dict(amp=True, checkpoint=True), "accum2": dict(accum=2, batch_size=4)}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("localize", ["replay", "hooks"])
def test_every_nan_localized_within_its_step(config, localize):
    "Each injected NaN (forward or backward) is attributed to the module that produced it, at the step it happened."
    cfg = RunConfig(steps=9, **CONFIGS[config])
    strategy = STRATEGIES["skip"].__class__(**{**STRATEGIES["skip"].__dict__, "name": f"skip/{localize}", "localize": localize})
    for kind, module in NAN_SITES:
        run = train(cfg, strategy, [Fault(kind, 7, module=module)])
        assert run.alarm_steps == [7], (kind, module, run.alarm_steps)
        loc = run.records[7].localization
        assert loc is not None and loc.module == module, (config, kind, module, loc)
        assert loc.kind == "nan" and loc.phase == ("forward" if kind == "nan_activation" else "backward")
        assert run.records[7].action == "skip" and math.isfinite(run.eval_loss)


def test_no_false_alarm_over_1000_clean_steps():
    "All spike and NaN detectors on, 1,000 clean steps: not one alarm (ZClip's z > 2.5 clips fire many times)."
    run = train(RunConfig(steps=1000), "rewind")
    assert run.alarm_steps == []
    assert all(r.action == "update" for r in run.records)
    assert run.eval_loss < run.records[0].loss - 3          # it trained: ~5.5 -> ~1.2


def test_grad_norm_under_accumulation_matches_full_batch():
    "The monitored norm of 2 accumulated micro-batches of 4 equals the eager norm of one batch of 8."
    zm = get_model("tiny")
    m = zm.build(device="cpu", seed=1)
    ref = copy.deepcopy(m)
    (x,), y = zm.batch(8, 16, seed=3)
    tr = Trainer(m, torch.optim.SGD(m.parameters(), lr=0.0), zm.loss, STRATEGIES["zscore_clip"])
    rec = tr.step(0, 0, [((x[:4],), y[:4]), ((x[4:],), y[4:])])
    zm.loss(ref(x), y).backward()
    want = torch.cat([p.grad.flatten() for p in ref.parameters()]).norm().item()
    assert rec.grad_norm == pytest.approx(want, rel=1e-5)
    per = grad_norms(list(ref.parameters()))
    assert total_norm(per).item() == pytest.approx(want, rel=1e-5)


def test_mitigations_recover_within_2pct_and_faults_hurt():
    "A mitigation ends within 2% of the clean run's held-out loss where the unmitigated run does not."
    cfg = RunConfig(steps=200)
    clean = train(cfg, "unmonitored").eval_loss
    for fault, strategy in [(Fault("lr_spike", 100), "rewind"), (Fault("grad_spike", 100), "zscore_clip"),
                            (Fault("nan_grad", 100), "skip")]:
        bad = train(cfg, "unmonitored", [fault]).eval_loss
        good = train(cfg, strategy, [fault]).eval_loss
        assert not (abs(bad / clean - 1) <= 0.02), (fault.kind, bad, clean)      # NaN or > 2% off
        assert abs(good / clean - 1) <= 0.02, (fault.kind, strategy, good, clean)


def test_bench_against_zclip_small():
    "A small bench: the JSON has every strategy x fault; ZClip loses a NaN run that the NaN guard saves."
    res = stability_bench(RunConfig(steps=80), strategies=("unmonitored", "zclip", "zclip_nanguard", "rewind"),
                          faults=(Fault("nan_grad", 40), Fault("lr_spike", 40)), clean_steps=80, overhead_steps=10,
                          configs=False)["results"]
    json.dumps(res)
    rows = {(r["strategy"], r["fault"]): r for r in res["runs"]}
    assert len(rows) == 8
    assert math.isnan(rows["zclip", "nan_grad"]["final_loss"])
    assert rows["zclip_nanguard", "nan_grad"]["localized"] == "tok_embeddings"
    assert res["summary"]["rewind"]["recall"] == 1.0 and res["summary"]["rewind"]["clean_false_alarms"] == 0
    assert res["summary"]["unmonitored"]["recall"] == 0.0
    assert set(res["overhead"]) >= {"unmonitored", "zclip", "rewind", "zscore_clip+hooks"}
    md = bench_markdown(res)
    assert "| `zclip` |" in md and "lost (NaN)" in md


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "static_dist.app", *args], capture_output=True, text=True)


def test_cli_stability_verb():
    p = _cli("stability", "--strategy", "rewind", "--fault",
                        "lr_spike@40", "--fault", "nan_grad@20", "--steps", "60", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert [(a["step"], a["action"]) for a in out["alarms"]] == [(20, "skip"), (41, "rewind")]
    p = _cli("stability", "--fault", "lr_spike@400")
    assert p.returncode == 2 and "past the end" in p.stderr and "Traceback" not in p.stderr
