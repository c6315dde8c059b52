"""Tests of tools/run_notebooks.py and tools/build_docs.py on small hand-made notebooks (no browser needed)."""
import importlib.util, json, subprocess, sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec); sys.modules[name] = mod; spec.loader.exec_module(mod)
    return mod


rn, bd = _load("run_notebooks"), _load("build_docs")
WS = rn.WIDGET_STATE


_ids = iter(range(10**6))


def code(src, outputs=()):
    return dict(cell_type="code", id=f"c{next(_ids)}", metadata={}, execution_count=None, source=src, outputs=list(outputs))


def nb_of(*cells, widgets=None):
    md = dict(kernelspec=dict(name="python3", display_name="python3", language="python"))
    if widgets is not None: md["widgets"] = {WS: dict(state=widgets, version_major=2, version_minor=0)}
    return dict(cells=list(cells), metadata=md, nbformat=4, nbformat_minor=5)


def widget_nb(err=False):
    "A harness as nbclient saves it: an interactive VBox holding a Dropdown and an Output widget."
    ids = ["a" * 32, "b" * 32, "c" * 32]
    out = [dict(output_type="error", ename="ValueError", evalue="bad mesh", traceback=["ValueError: bad mesh"])] if err else \
          [dict(output_type="display_data", metadata={}, data={"image/png": "iVBORw0KGgo=", "text/plain": "<Figure>"})]
    state = {ids[0]: dict(model_name="VBoxModel", state=dict(_model_name="VBoxModel", children=[f"IPY_MODEL_{ids[1]}", f"IPY_MODEL_{ids[2]}"])),
             ids[1]: dict(model_name="DropdownModel", state=dict(_model_name="DropdownModel", description="mesh",
                                                                  _options_labels=["2x4", "4x2"], index=1)),
             ids[2]: dict(model_name="OutputModel", state=dict(_model_name="OutputModel", outputs=out))}
    view = dict(output_type="execute_result", execution_count=1, metadata={},
                data={rn.WIDGET_MIME: dict(model_id=ids[0], version_major=2, version_minor=0), "text/plain": "interactive(...)"})
    return nb_of(code("w"), code("w", [view]), widgets=state)


def test_cell_and_widget_errors():
    err = dict(output_type="error", ename="ZeroDivisionError", evalue="division by zero",
               traceback=["\x1b[31mZeroDivisionError\x1b[39m: division by zero"])
    nb = nb_of(code("1"), code("#| hide\n1/0", [err]))
    (e,) = rn.cell_errors(nb)
    assert (e["cell"], e["ename"], e["source"], e["traceback"]) == (1, "ZeroDivisionError", "1/0", ["ZeroDivisionError: division by zero"])
    assert rn.widget_errors(widget_nb()) == [] and rn.has_widget(widget_nb()) and not rn.has_widget(nb)
    (w,) = rn.widget_errors(widget_nb(err=True))
    assert (w["cell"], w["ename"], w["evalue"]) == (1, "ValueError", ["bad mesh"])


def test_clean_outputs_strips_paths_and_renames_widget_ids(tmp_path):
    home = str(Path.home())
    text = f"{ROOT}/nbs/x.json /tmp/tmpab12/plan.json {home}/data\n"
    nb = widget_nb(); nb["cells"][0]["outputs"] = [dict(output_type="stream", name="stdout", text=[text])]
    a = rn.clean_outputs(json.loads(json.dumps(nb)), "nbs/40_fsdp.ipynb")
    b = rn.clean_outputs(json.loads(json.dumps(nb)), "nbs/40_fsdp.ipynb")
    assert a == b
    assert a["cells"][0]["outputs"][0]["text"] == ["nbs/x.json <tmp>/plan.json ~/data\n"]
    new_id = a["cells"][1]["outputs"][0]["data"][rn.WIDGET_MIME]["model_id"]
    state = a["metadata"]["widgets"][WS]["state"]
    assert new_id != "a" * 32 and new_id in state and not any(k in json.dumps(a) for k in ("a" * 32, "b" * 32, "c" * 32))
    assert state[new_id]["state"]["children"][0][len("IPY_MODEL_"):] in state   # references follow the rename
    # another notebook gets other ids, so two notebooks' widgets never collide
    c = rn.clean_outputs(json.loads(json.dumps(nb)), "nbs/50_offload.ipynb")
    assert c["cells"][1]["outputs"][0]["data"][rn.WIDGET_MIME]["model_id"] != new_id


def test_diff_runs():
    one = nb_of(code("t", [dict(output_type="stream", name="stdout", text="0.51\n")]))
    two = nb_of(code("t", [dict(output_type="stream", name="stdout", text="0.73\n")]))
    assert rn.diff_runs(one, one, "n") == []
    (d,) = rn.diff_runs(one, two, "n")
    assert d.startswith("  cell 0:") and "-0.51" in d and "+0.73" in d


def test_harness_names(tmp_path):
    assert rn.harness_matches(["nbs/40_fsdp"], ROOT / "nbs" / "40_fsdp.ipynb")
    assert not rn.harness_matches(["nbs/40_fsdp"], ROOT / "nbs" / "50_offload.ipynb")
    assert rn.main(["--check", "--harness", "nbs/no_such_nb", str(ROOT / "index.ipynb")]) == 2


def test_run_check_and_write(tmp_path, capsys):
    "End to end in a real kernel: an error cell and a harness without a widget fail --check; --write keeps outputs."
    bad = tmp_path / "bad.ipynb"; bad.write_text(json.dumps(nb_of(code("import os\nprint(os.getcwd())"), code("1/0"))))
    good = tmp_path / "good.ipynb"; good.write_text(json.dumps(nb_of(
        code("import os, matplotlib.pyplot as plt\nprint(os.environ.get('PYTHONHASHSEED'), os.environ.get('MPLBACKEND'))"),
        code("fig, ax = plt.subplots(figsize=(2, 1), dpi=40); ax.plot([0, 1]); plt.show()"))))
    assert rn.main(["--check", "-j", "2", "--harness", str(good), "--timing", str(tmp_path / "t.json"), str(bad), str(good)]) == 1
    out = capsys.readouterr().out
    assert "bad.ipynb cell 1 ('1/0'): ZeroDivisionError: division by zero" in out
    assert "good.ipynb: harness notebook shows no widget" in out
    t = json.loads((tmp_path / "t.json").read_text())["notebooks"]
    assert {Path(k).name: v["errors"] for k, v in t.items()} == {"bad.ipynb": 1, "good.ipynb": 0}
    # --write --out: outputs kept, machine paths gone, nbdev_clean leaves the file as it is, sources untouched
    src_before = good.read_text()
    assert rn.main(["--write", "--harness", "--out", str(tmp_path / "o"), str(good)]) == 0
    saved_path = tmp_path / "o" / "good.ipynb"
    saved = json.loads(saved_path.read_text())
    assert good.read_text() == src_before
    outs = [o for c in saved["cells"] for o in c["outputs"]]
    assert outs[0]["text"] == ["0 module://matplotlib_inline.backend_inline\n"]   # as in JupyterLab, even under MPLBACKEND=Agg
    assert "image/png" in outs[1]["data"] and str(tmp_path) not in saved_path.read_text()
    # a notebook with an error is not written (unless --keep-errors)
    assert rn.main(["--write", "--harness", "--out", str(tmp_path / "o"), str(bad)]) == 1
    assert "not written: " in capsys.readouterr().out and not (tmp_path / "o" / "bad.ipynb").exists()
    before = saved_path.read_text()
    subprocess.run([str(Path(sys.executable).parent / "nbdev_clean"), "--fname", str(saved_path)], cwd=ROOT, check=True)
    assert saved_path.read_text() == before


def test_build_docs_site(tmp_path):
    "A two-page site: widget snapshot, hidden cells, sidebar, API section, and the link checker."
    nbs = tmp_path / "nbs"; nbs.mkdir()
    md = lambda s: dict(cell_type="markdown", id=f"m{next(_ids)}", metadata={}, source=s)
    w = widget_nb(); w["cells"] = [md("# Harness\n\n> sub\n\nSee [util](00a_util.ipynb#Utilities)."), code("#| hide\nsecret_hidden_cell = 1")] + w["cells"]
    (nbs / "10_harness.ipynb").write_text(json.dumps(w))
    (nbs / "00a_util.ipynb").write_text(json.dumps(nb_of(md("# Utilities"), code("#| default_exp util\n#| export\nx = 1"))))
    (tmp_path / "index.ipynb").write_text(json.dumps(nb_of(md("# Home"))))
    s = bd.build(tmp_path / "site", nbs, tmp_path / "index.ipynb", root=tmp_path, progress=lambda m: None)
    assert s["problems"] == [] and [p["page"] for p in s["pages"]] == ["index.html", "util.html", "harness.html"]
    h = (tmp_path / "site" / "harness.html").read_text()
    assert "secret_hidden_cell" not in h and 'href="util.html#Utilities"' in h
    assert "<th>mesh</th><td>4x2</td>" in h and 'src="data:image/png;base64,iVBORw0KGgo="' in h
    assert h.count('class="docs-nav"') == 1 and 'href="index.html"' in h
    u = (tmp_path / "site" / "util.html").read_text()
    assert "API: <code>static_dist.util</code>" in u and "parse_bytes" in u and "#| export" not in u
    # the checker finds what is broken
    (tmp_path / "site" / "bad.html").write_text('<a href="/abs.html">a</a><a href="nope.html">b</a>'
                                                '<a href="util.html#no-such-id">c</a><img src="">')
    probs = bd.check_site(tmp_path / "site")
    assert len(probs) == 4 and all(p.startswith("bad.html") for p in probs)
