"""Audit sections on one graph: what each reports, and the ones that do not apply."""
import json

import pytest

from static_dist.app.audit import (Context, NotApplicable, _run_section, export_section, passes_section,
                                   placement_section, stability_section)
from static_dist.workload import load_workload


def ctx(source, tmp_path, **kw):
    w = load_workload(source, **kw)
    return Context(w, w.graph(), tmp_path)


def test_export_section_finds_the_branch(tmp_path):
    # the control-flow model branches on tensor values, so it has no fake capture: export checks run without a graph
    md, data = export_section(Context(load_workload("control-flow", batch=2), None, tmp_path))
    assert export_section.title == "Export checks" and "data-dependent-branch" in md and not data["ok"]
    assert json.loads((tmp_path / "export_report.json").read_text())["model"] == "control-flow"


def test_passes_section_rewrites_tiny(tmp_path):
    md, data = passes_section(ctx("tiny", tmp_path, batch=2, seq=32))
    assert data["verified"] and data["matches"]["rms_norm"] == 5       # 2 per block x 2 blocks + the final norm
    assert (tmp_path / "ops_trace.json").exists()


def test_sections_that_do_not_apply(tmp_path):
    c = ctx("mlp", tmp_path, batch=4)
    with pytest.raises(NotApplicable, match="repeated blocks"): placement_section(c)
    with pytest.raises(NotApplicable, match="no RMSNorm/softmax/add"): passes_section(c)
    r = _run_section(placement_section, c, lambda s: None)
    assert r["status"] == "not applicable" and r["markdown"].count("\n") == 0
    assert r["title"] == "Placement (TP plan on dgx-h100, mesh dp=2 × tp=4)"
    big = ctx("llama3-70b", tmp_path, batch=1, seq=128)
    with pytest.raises(NotApplicable, match="parameters"): export_section(big)


def test_stability_section_on_the_users_model(tmp_path):
    md, data = stability_section(ctx("examples/gpt.py:GPT", tmp_path, batch=2, seq=32))
    assert data["detected"] == [data["fault"]["step"]]                   # the injected NaN gradient, and nothing else
    assert data["localized_to"].startswith(data["fault"]["module"])


def test_every_figure_is_a_report_file(tmp_path):
    """#22: a report over an earlier one (--force) keeps none of the earlier files: each figure a section saves is in
    REPORT_FILES."""
    from static_dist.app.audit import REPORT_FILES, audit, graph_section, layout_section
    sections = (graph_section, layout_section)
    audit(load_workload("tiny", batch=2, seq=32), tmp_path / "rep", sections=sections)
    written = {p.name for p in (tmp_path / "rep").iterdir()}
    assert "parallel_layout.png" in written and written <= set(REPORT_FILES), written - set(REPORT_FILES)
    audit(load_workload("mlp", batch=2), tmp_path / "rep", sections=sections, force=True)   # no layout for an MLP
    assert "parallel_layout.png" not in {p.name for p in (tmp_path / "rep").iterdir()}
