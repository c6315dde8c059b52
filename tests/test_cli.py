"""The static-dist command as a user runs it: a subprocess, exit codes, files written."""
import json
import subprocess
import sys


def run(*args, cwd=None):
    p = subprocess.run([sys.executable, "-m", "static_dist.cli", *args], capture_output=True, text=True, cwd=cwd)
    return p.returncode, p.stdout, p.stderr


def test_audit_writes_report(tmp_path):
    code, out, err = run("audit", "--model", "tiny", "--seq", "32", "--out", str(tmp_path / "a"))
    assert code == 0, err
    rep = json.loads((tmp_path / "a" / "audit.json").read_text())
    assert rep["schema"] == "static_dist.audit/1"
    assert rep["sections"]["Captured training step"]["params"] > 0
    md = (tmp_path / "a" / "audit.md").read_text()
    assert "peak live memory" in md and (tmp_path / "a" / "memory.png").stat().st_size > 1000


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
    assert code == 2 and "max_seq_len" in err


def test_plugin_usage_error_is_one_line_under_python_m():
    "A plugin raises static_dist.cli.UsageError; under `python -m static_dist.cli` it must still be exit 2, no traceback."
    code, out, err = run("plan-fsdp", "--model", "tiny", "--mesh", "3x3", "--world", "8")
    assert code == 2 and "Traceback" not in err and "world" in err
