"""ExportReport: the versioned JSON schema round-trips, diff finds exactly what changed; CLI and audit integration."""
import json
import math
import os

import pytest

import torch
from hypothesis import given, settings, strategies as st  # noqa: E402

from static_dist.export import (  # noqa: E402
    SCHEMA, SCHEMA_VERSION, ExportReport, Finding, NumericCheck, Stage)

text = st.text(max_size=20)
stages = st.builds(Stage, text, st.sampled_from(["ok", "warn", "fail", "skip"]), st.floats(0, 100), text)
findings = st.builds(Finding, text, st.sampled_from(["error", "warning", "info"]), st.sampled_from(["export", "onnx"]),
                     text, text, text, text, text)
numerics = st.builds(
    NumericCheck,
    st.sampled_from(["export", "onnx"]),
    text,
    st.integers(0, 3),
    text,
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(0, 1e9),
    st.floats(0, 1),
    st.floats(0, 1),
    st.booleans(),
    text,
)
reports = st.builds(ExportReport, text, st.lists(st.sampled_from(["onnx", "torchscript", "aoti"]), max_size=3),
                    st.lists(stages, max_size=5), st.lists(findings, max_size=5), st.lists(numerics, max_size=5))


def _same_num(a, b):
    return a == b or (math.isnan(a) and math.isnan(b))


@settings(max_examples=200, deadline=None, database=None)
@given(reports)
def test_json_round_trip(r):
    j = r.to_json()
    d = json.loads(j)  # plain JSON: NaN/inf are written as strings
    assert (d["schema"], d["version"], d["ok"]) == (SCHEMA, SCHEMA_VERSION, r.ok)
    r2 = ExportReport.from_json(j)
    assert r2.stages == r.stages and r2.findings == r.findings and r2.model == r.model
    assert all(_same_num(a.max_abs, b.max_abs) and a.ok == b.ok for a, b in zip(r.numerics, r2.numerics))
    assert r.diff(r2).empty


@settings(max_examples=200, deadline=None, database=None)
@given(reports, findings)
def test_diff_sees_added_and_removed_finding(r, f):
    other = ExportReport.from_json(r.to_json())
    other.findings = other.findings + [f]
    d = r.diff(other)
    if f.key() in {x.key() for x in r.findings}:
        assert not d.added
    else:
        assert d.added == [f] and other.diff(r).removed == [f]


def test_unknown_version_refused():
    d = json.loads(ExportReport("m", ["onnx"]).to_json())
    d["version"] = SCHEMA_VERSION + 1
    with pytest.raises(ValueError, match="not supported"):
        ExportReport.from_json(json.dumps(d))


# --- CLI through the lead's `static-dist` entry point, and the audit section -------------------------------------
import static_dist.app.cli as _cli


class cli:
    "main() as the script runs it: argparse's own errors exit 2 through SystemExit."
    @staticmethod
    def main(argv):
        try: return _cli.main(argv)
        except SystemExit as e: return e.code
import onnxruntime  # noqa: F401  (a dev dependency: missing it must fail, not skip)


def test_check_export_cli(tmp_path, capsys):
    assert cli.main(["check-export", "--model", "mlp", "--targets", "onnx", "--out", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "mlp" and out["ok"] and {n["target"] for n in out["numerics"]} == {"export", "onnx"}
    base = tmp_path / "export_report.json"
    assert cli.main(["check-export", "--model", "control-flow", "--targets", "onnx", "--out", str(tmp_path / "cf"),
                     "--baseline", str(base)]) == 1
    md = capsys.readouterr().out
    assert "data-dependent-branch" in md and "zoo.py:" in md and "Export report diff" in md


@pytest.mark.parametrize("argv, msg", [
    (["check-export", "--model", "nope"], "Unknown model 'nope'"),
    (["check-export", "--targets", "tflite"], "--targets 'tflite'"),
    (["check-export", "--model", "llama3-70b"], "70,554M parameters"),         # util.check_real_size, the one size rule
    (["check-export", "--baseline", "/nonexistent.json"], "no such file"),
])
def test_check_export_cli_bad_input(argv, msg, capsys, tmp_path):
    assert cli.main(argv + ["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_sign_verify_cli(tmp_path, capsys):
    m = torch.nn.Linear(3, 2)
    torch.export.save(torch.export.export(m, (torch.randn(1, 3),)), tmp_path / "m.pt2")
    assert cli.main(["keygen", "--out", str(tmp_path / "rel")]) == 0
    assert cli.main(["keygen", "--out", str(tmp_path / "evil")]) == 0
    assert cli.main(["sign", str(tmp_path / "m.pt2"), "--key", str(tmp_path / "rel.key")]) == 0
    (tmp_path / "trusted.pem").write_bytes((tmp_path / "evil.pub").read_bytes() + (tmp_path / "rel.pub").read_bytes())
    assert (
        cli.main(["verify", str(tmp_path / "m.sdxa"), "--trusted-keys", str(tmp_path / "trusted.pem"), "--load"]) == 0
    )
    assert cli.main(["verify", str(tmp_path / "m.sdxa"), "--trusted-key", str(tmp_path / "evil.pub")]) == 1
    assert "UntrustedKeyError" in capsys.readouterr().err
    assert cli.main(["verify", str(tmp_path / "m.sdxa")]) == 2
    assert cli.main(["verify", str(tmp_path / "missing.sdxa"), "--trusted-key", str(tmp_path / "rel.pub")]) == 2




# --- report files: every field checked (issue 14 §4) ---------------------------------------------------------------
from hypothesis import HealthCheck, given, settings, strategies as st
from static_dist.export import ReportFileError

_VALID = json.loads(
    ExportReport(
        "m",
        ["onnx"],
        stages=[Stage("export-strict", "ok", 0.5, "")],
        findings=[Finding("data-dependent-branch", "error", "export", "aten.x", "f.py:3")],
        numerics=[NumericCheck("onnx", "example", 0, "float32", float("inf"), 0.0, 1e-5, 1e-5, False)],
    ).to_json()
)


def _paths(d, prefix=()):
    "Every (path, value) in a JSON document."
    yield prefix, d
    if isinstance(d, dict):
        for k, v in d.items(): yield from _paths(v, (*prefix, k))
    elif isinstance(d, list):
        for k, v in enumerate(d): yield from _paths(v, (*prefix, k))


def _edit(d, path, action, value):
    import copy
    d = copy.deepcopy(d)
    if not path: return value
    parent = d
    for p in path[:-1]: parent = parent[p]
    if action == "delete": del parent[path[-1]]
    else: parent[path[-1]] = value
    return d


_PATHS = [p for p, _ in _paths(_VALID) if p]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(_PATHS), st.sampled_from(["delete", "set"]),
       st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=False), st.text(max_size=5),
                 st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)))
def test_report_file_mutations_are_refused_or_harmless(path, action, value):
    edited = _edit(_VALID, path, action, value)
    try: rep = ExportReport.from_json(json.dumps(edited))
    except ReportFileError as e:
        assert str(e).strip() and "\n" not in str(e).strip()
        return
    back = json.loads(rep.to_json())          # accepted: it reads back as what the file says, its verdict `ok` included
    for k in set(edited) | set(back):
        assert back.get(k) == edited.get(k) or k in ("guards", "meta") and edited.get(k) in (None, {}), k


def test_report_file_errors_name_the_field():
    bad = _edit(_VALID, ("stages", 0, "seconds"), "set", "fast")
    with pytest.raises(ReportFileError, match=r"report.stages\[0\].seconds"): ExportReport.from_json(json.dumps(bad))
    with pytest.raises(ReportFileError, match="not an export report"):
        ExportReport.from_json('{"schema": "static_dist.graph/2"}')
    with pytest.raises(ReportFileError, match="export report: not valid JSON"): ExportReport.from_json("{")


@pytest.mark.parametrize("edit,message", [
    (dict(ok="yes"), 'report.ok: expected true or false, found "yes"'),                    # issue #22: types checked
    (dict(ok=True), "report.ok: expected false (the verdict of the report's stages, findings and numerics), found "
                    "true"),
    (dict(targets="onnx"), 'report.targets: expected a list, each item a string, found "onnx"'),
    (dict(meta=None), "report.meta: expected an object, found null"),
    (dict(colour=1), "report.colour: unknown field; the fields here are schema, version, ok, "),
])
def test_report_file_types_are_checked(edit, message):
    with pytest.raises(ReportFileError) as e: ExportReport.from_json(json.dumps({**_VALID, **edit}))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_report_file_is_read_depth_limited():
    with pytest.raises(ReportFileError, match="nested deeper than 64 levels"):
        ExportReport.from_json('{"schema": "static_dist.export_report", "meta": ' + "[" * 10**5 + "]" * 10**5 + "}")


def test_report_file_is_read_bounded(tmp_path):
    """ExportReport.load reads through util.read_json: a 20 GB (sparse) file is refused by its size before a byte is
    read."""
    p = tmp_path / "rep.json"
    p.write_text(json.dumps(_VALID))
    assert json.loads(ExportReport.load(p).to_json()) == _VALID
    os.truncate(p, 20 * 2**30)
    with pytest.raises(ReportFileError, match=r"rep.json: 21,474,836,480 bytes, more than the [\d,]+ allowed"):
        ExportReport.load(p)
