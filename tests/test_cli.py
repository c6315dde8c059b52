"""The static-dist command as a user runs it: a subprocess, exit codes, files written."""
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(*args, cwd=ROOT):
    p = subprocess.run([sys.executable, "-m", "static_dist.app", *args], capture_output=True, text=True, cwd=cwd)
    return p.returncode, p.stdout, p.stderr


def _check_audit(out: pathlib.Path, batch: int, seq: int):
    rep = json.loads((out / "audit.json").read_text())
    assert rep["schema"] == "static_dist.audit/2"
    assert rep["failed_sections"] == [], rep["failed_sections"]
    assert (rep["workload"]["batch"], rep["workload"]["seq"]) == (batch, seq)
    for title, s in rep["sections"].items():
        assert s["status"] in ("ok", "not applicable"), (title, s)
        assert (s["workload"]["batch"], s["workload"]["seq"]) == (batch, seq), title
    assert rep["sections"]["Captured training step"]["data"]["params"] > 0
    md = (out / "audit.md").read_text()
    assert "peak live memory" in md and (out / "memory.png").stat().st_size > 1000
    return rep


def test_audit_own_file(tmp_path):
    "The issue's first done-when: a model file nobody here wrote into the zoo, batch 4 x seq 256."
    code, out, err = run("audit", "--model", "examples/gpt.py:GPT", "--batch", "4", "--seq", "256",
                         "--out", str(tmp_path / "g"))
    assert code == 0, err
    rep = _check_audit(tmp_path / "g", 4, 256)
    assert rep["sections"]["Placement (TP plan on dgx-h100, mesh dp=2 × tp=4)"]["status"] == "ok"


def _hf_configs(tmp_path):
    transformers = pytest.importorskip("transformers", reason="the optional extra static_dist[hf]")
    gpt2 = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=256)
    llama = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)
    dirs = {}
    for name, cfg in (("gpt2", gpt2), ("llama", llama)):
        dirs[name] = tmp_path / name
        cfg.save_pretrained(dirs[name])
    return dirs


# Conv1D, tied embeddings; hf Llama steps are captured and planned in 40ab, 45f, test_fsdp_structure
@pytest.mark.parametrize("name", ["gpt2"])
def test_audit_hf_config(tmp_path, name):
    d = _hf_configs(tmp_path)[name]
    code, out, err = run("audit", "--model", f"hf:{d}", "--batch", "4", "--seq", "256", "--out", str(tmp_path / "o"))
    assert code == 0, err
    _check_audit(tmp_path / "o", 4, 256)


def test_capture_json_and_errors():
    code, out, err = run("capture", "--model", "mlp", "--batch", "4", "--json")
    assert code == 0, err
    s = json.loads(out)
    assert s["params"] == 32 * 64 + 64 + 64 * 64 + 64 + 64 * 8 + 8
    code, out, err = run("capture", "--model", "llama3-7b")
    assert code == 2 and "llama3-8b" in err and "Traceback" not in err
    code, out, err = run("capture", "--seq", "-3")
    assert code == 2 and "at least 1" in err
    code, out, err = run("capture", "--model", "tiny", "--seq", "100000")
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_library_error_is_one_line():
    code, out, err = run("plan-fsdp", "--model", "tiny", "--mesh", "3x3", "--world", "8")
    assert code == 2 and "Traceback" not in err and "world" in err and len(err.strip().splitlines()) == 1


def test_stability_and_train_take_any_model(hf_tiny_llama, own_loss_model, tmp_path):
    """One --model on every verb: stability localizes a NaN injected into a user's GPT (its embedding, found in its own
    module tree), train runs a Hugging Face config and a model that returns its own loss; options a verb cannot honour
    are refused in one line."""
    code, out, err = run("stability", "--model", "examples/gpt.py:GPT", "--steps", "12", "--batch", "4", "--seq", "32",
                         "--strategy", "skip", "--fault", "nan_grad@6", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert [a["step"] for a in r["alarms"]] == [6] and r["alarms"][0]["action"] == "skip", r["alarms"]
    assert r["alarms"][0]["localization"]["module"] == "transformer.wte" == r["faults"][0]["module"], r
    for model in (hf_tiny_llama, own_loss_model):
        code, out, err = run(
            "train",
            "--model",
            model,
            "--steps",
            "2",
            "--seq",
            "16",
            "--no-compile",
            "--optimizer",
            "adam",
            "--log",
            str(tmp_path / "log.json"),
            "--force",
        )
        assert code == 0, (model, err[-2000:])
        assert json.loads(out)["workload"]["optimizer"] == "adam"
    for argv, msg in ((("stability", "--optimizer", "sgd"), "the stability runs train with adamw"),
                      (("stability", "--model", "mlp", "--steps", "2"), "does not take token ids"),
                      (("train", "--optimizer", "none"), "training needs one"),
                      (("train", "--no-compile", "--backend", "inductor"), "give one of them")):
        code, out, err = run(*argv)
        assert code == 2 and msg in err and len(err.strip().splitlines()) == 1, (argv, err)
