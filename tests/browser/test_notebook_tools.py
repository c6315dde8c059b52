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
    return dict(
        cell_type="code", id=f"c{next(_ids)}", metadata={}, execution_count=None, source=src, outputs=list(outputs)
    )


def nb_of(*cells, widgets=None):
    md = dict(kernelspec=dict(name="python3", display_name="python3", language="python"))
    if widgets is not None: md["widgets"] = {WS: dict(state=widgets, version_major=2, version_minor=0)}
    return dict(cells=list(cells), metadata=md, nbformat=4, nbformat_minor=5)


def widget_nb(err=False):
    "A harness as nbclient saves it: an interactive VBox holding a Dropdown and an Output widget."
    ids = ["a" * 32, "b" * 32, "c" * 32]
    out = (
        [dict(output_type="error", ename="ValueError", evalue="bad mesh", traceback=["ValueError: bad mesh"])]
        if err
        else [
            dict(output_type="display_data", metadata={}, data={"image/png": "iVBORw0KGgo=", "text/plain": "<Figure>"})
        ]
    )
    state = {
        ids[0]: dict(
            model_name="VBoxModel",
            state=dict(_model_name="VBoxModel", children=[f"IPY_MODEL_{ids[1]}", f"IPY_MODEL_{ids[2]}"]),
        ),
        ids[1]: dict(
            model_name="DropdownModel",
            state=dict(_model_name="DropdownModel", description="mesh", _options_labels=["2x4", "4x2"], index=1),
        ),
        ids[2]: dict(model_name="OutputModel", state=dict(_model_name="OutputModel", outputs=out)),
    }
    view = dict(
        output_type="execute_result",
        execution_count=1,
        metadata={},
        data={
            rn.WIDGET_MIME: dict(model_id=ids[0], version_major=2, version_minor=0),
            "text/plain": "interactive(...)",
        },
    )
    return nb_of(code("w"), code("w", [view]), widgets=state)


def test_cell_and_widget_errors():
    err = dict(output_type="error", ename="ZeroDivisionError", evalue="division by zero",
               traceback=["\x1b[31mZeroDivisionError\x1b[39m: division by zero"])
    nb = nb_of(code("1"), code("#| hide\n1/0", [err]))
    (e,) = rn.cell_errors(nb)
    assert (e["cell"], e["ename"], e["source"], e["traceback"]) == (
        1,
        "ZeroDivisionError",
        "1/0",
        ["ZeroDivisionError: division by zero"],
    )
    assert rn.widget_errors(widget_nb()) == [] and rn.has_widget(widget_nb()) and not rn.has_widget(nb)
    assert rn.widgets_without_picture(widget_nb()) == [1]  # interactive(...) text is all an untrusted copy shows
    pictured = widget_nb(); pictured["cells"][1]["outputs"][0]["data"]["image/png"] = "iVBORw0KGgo="
    assert rn.widgets_without_picture(pictured) == []
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
    assert (
        new_id != "a" * 32 and new_id in state and not any(k in json.dumps(a) for k in ("a" * 32, "b" * 32, "c" * 32))
    )
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
        code("import os, matplotlib.pyplot as plt\nprint(os.environ.get('PYTHONHASHSEED'), "
             "os.environ.get('MPLBACKEND'))"),
        code("fig, ax = plt.subplots(figsize=(2, 1), dpi=40); ax.plot([0, 1]); plt.show()"))))
    assert (
        rn.main(
            ["--check", "-j", "2", "--harness", str(good), "--timing", str(tmp_path / "t.json"), str(bad), str(good)]
        )
        == 1
    )
    out = capsys.readouterr().out
    assert "bad.ipynb cell 1 ('1/0'): ZeroDivisionError: division by zero" in out, out
    assert "good.ipynb: harness notebook shows no widget" in out, out
    t = json.loads((tmp_path / "t.json").read_text())["notebooks"]
    assert {Path(k).name: v["errors"] for k, v in t.items()} == {"bad.ipynb": 1, "good.ipynb": 0}
    # --write --out: outputs kept, machine paths gone, nbdev_clean leaves the file as it is, sources untouched
    src_before = good.read_text()
    assert rn.main(["--write", "--harness", "--out", str(tmp_path / "o"), str(good)]) == 0
    saved_path = tmp_path / "o" / "good.ipynb"
    saved = json.loads(saved_path.read_text())
    assert good.read_text() == src_before
    outs = [o for c in saved["cells"] for o in c["outputs"]]
    assert outs[0]["text"] == [
        "0 module://matplotlib_inline.backend_inline\n"
    ]  # as in JupyterLab, even under MPLBACKEND=Agg
    assert "image/png" in outs[1]["data"] and str(tmp_path) not in saved_path.read_text()
    # a notebook with an error is not written (unless --keep-errors)
    assert rn.main(["--write", "--harness", "--out", str(tmp_path / "o"), str(bad)]) == 1
    assert "not written: " in capsys.readouterr().out and not (tmp_path / "o" / "bad.ipynb").exists()
    before = saved_path.read_text()
    subprocess.run([str(Path(sys.executable).parent / "nbdev_clean"), "--fname", str(saved_path)], cwd=ROOT, check=True)
    assert saved_path.read_text() == before


UTIL_CELLS = [  # (source, is the notebook's code) of a small module notebook, in the style of the repo's
    "#| default_exp util",
    '#| export\nfrom __future__ import annotations\nfrom typing import Literal\nimport triton, triton.language as '
    'tl\nfrom fastcore.basics import patch\nfrom dataclasses import dataclass',
    '#| export\nKind = Literal["a", "b"]\n"Which kind of thing."',
    '#| export\n@dataclass(frozen=True)\nclass Pt:\n    "A point."\n    x: int = 0\n    "across"\n    y: int | None = '
    'None',
    '#| export\ndef f_one(a: int, b: Pt | None = None, *, c=print) -> str:\n    "Uses `a` and **b**; never <b>raw</b> '
    'HTML."\n    return str(a)',
    "f_one(1)",
    '#| export\n@patch\ndef norm(self: Pt) -> float:\n    "Its length."\n    return 0.0',
    "#| exporti\ndef _hidden(): pass",
    "#| export\n@triton.jit\ndef add_kernel(X, n, BLOCK: tl.constexpr):\n    pass",
]
UTIL_PY = """__all__ = ['Kind', 'Pt', 'f_one', 'add_kernel']

from typing import Literal

Kind = Literal["a", "b"]

@dataclass(frozen=True)
class Pt:
    x: int = 0

def f_one(a: int, b=None, *, c=print) -> str:
    return str(a)

@patch
def norm(self: Pt) -> float:
    return 0.0

@triton.jit
def add_kernel(X, n, BLOCK):
    pass
"""


def _docs_project(tmp_path):
    "A project with three notebooks in two chapters, an exported module, settings.ini, and an index."
    nbs = tmp_path / "nbs"; nbs.mkdir()
    md = lambda s: dict(cell_type="markdown", id=f"m{next(_ids)}", metadata={}, source=s)
    w = widget_nb()
    w["cells"] = [
        md("# Harness\n\n> sub\n\nSee [util](00a_util.ipynb#Utilities)."),
        code("#| hide\nsecret_hidden_cell = 1"),
    ] + w["cells"]
    (nbs / "10_harness.ipynb").write_text(json.dumps(w))
    (nbs / "00_core.ipynb").write_text(json.dumps(nb_of(md("# Core\n\n> The chapter's overview"))))
    util = [
        md("# Utilities\n\n> Small helpers"),
        md("## Section A\n\nThe first one."),
        md("## Section A\n\nSame title."),
        md("### Sub part"),
    ] + [code(c) for c in UTIL_CELLS]
    (nbs / "00a_util.ipynb").write_text(json.dumps(nb_of(*util)))
    (tmp_path / "index.ipynb").write_text(json.dumps(nb_of(md("# Home"))))
    (tmp_path / "static_dist").mkdir(); (tmp_path / "static_dist" / "util.py").write_text(UTIL_PY)
    (tmp_path / "settings.ini").write_text("[DEFAULT]\ngit_url = https://github.com/o/r\nbranch = main\n")
    return nbs, util


def _sig(page: str, anchor: str) -> str:
    "The signature shown in an entry, as text."
    import html, re
    entry = page.split(f'id="{anchor}"', 1)[1]
    return html.unescape(
        re.sub(r"<[^>]+>", "", entry.split('<div class="highlight api-sig"><pre>', 1)[1].split("</pre>", 1)[0])
    )


def test_build_docs_site(tmp_path):
    "Widget snapshot, hidden cells, chapters in the sidebar, contents, search index, unique ids, the link checker."
    nbs, _ = _docs_project(tmp_path)
    s = bd.build(tmp_path / "site", nbs, tmp_path / "index.ipynb", root=tmp_path, progress=lambda m: None)
    assert s["problems"] == [] and [p["page"] for p in s["pages"]] == [
        "index.html",
        "core.html",
        "util.html",
        "harness.html",
    ]
    h = (tmp_path / "site" / "harness.html").read_text()
    assert "secret_hidden_cell" not in h and 'href="util.html#Utilities"' in h
    assert "<th>mesh</th><td>4x2</td>" in h and 'src="data:image/png;base64,iVBORw0KGgo="' in h
    assert h.count('class="docs-nav"') == 1 and 'href="index.html"' in h
    # nothing from the network: no MathJax, require.js or mermaid; the shell's own files are local
    assert "cdnjs" not in h and "mathjax" not in h.lower().replace(".mathjax", "") and '<script src="docs.js">' in h
    u = (tmp_path / "site" / "util.html").read_text()
    # the sidebar: chapter 00 (Core, then Utilities) open on its stage page, chapter 10 a single link
    assert '<details class="chapter" open><summary><a href="core.html"' in u and 'class="stage current"' in u
    assert '<div class="chapter"><a href="harness.html"' in u
    # two sections with one title get two ids; the contents list them (h2, h3), not the title
    assert 'id="Section-A"' in u and 'id="Section-A-2"' in u and 'href="#Section-A-2">¶' in u
    toc = u.split('<aside class="docs-toc">', 1)[1].split("</aside>", 1)[0]
    assert [l.split('"')[0] for l in toc.split('href="#')[1:]] == ["Section-A", "Section-A-2", "Sub-part"]
    search = (tmp_path / "site" / "search_index.js").read_text()
    assert search.startswith("window.DOCS_SEARCH = [")
    recs = json.loads(search.removeprefix("window.DOCS_SEARCH = ").rstrip().rstrip(";"))
    assert {"k": "page", "t": "Utilities", "u": "util.html", "c": "util", "d": "Small helpers"} in recs
    assert any(r["k"] == "api" and r["t"] == "f_one" and r["u"] == "util.html#static_dist.util.f_one" for r in recs)
    assert any(r["k"] == "section" and r["u"] == "util.html#Section-A-2" for r in recs)
    # the checker finds what is broken
    (tmp_path / "site" / "bad.html").write_text(
        '<a href="/abs.html">a</a><a href="nope.html">b</a>'
        '<a href="util.html#no-such-id">c</a><img src="">'
        '<script src="https://cdn.example/x.js"></script><h2 id="d">1</h2><h3 id="d">2</h3>'
    )
    probs = bd.check_site(tmp_path / "site")
    assert len(probs) == 6 and all(p.startswith("bad.html") for p in probs), probs


def test_build_docs_api_entries(tmp_path):
    """API entries after the cell that defines them, read from the source text: signatures, Markdown docs, [source]
    links."""
    nbs, util = _docs_project(tmp_path)
    s = bd.build(tmp_path / "site", nbs, tmp_path / "index.ipynb", root=tmp_path, progress=lambda m: None)
    assert s["problems"] == [] and s["api"] == {"util": 5}
    u = (tmp_path / "site" / "util.html").read_text()
    cell_of = lambda k: util[4 + k]["id"]    # UTIL_CELLS[k]'s cell id
    # each entry right after its cell, before the next cell
    for k, anchor in [(2, "Kind"), (3, "Pt"), (4, "f_one"), (6, "Pt.norm"), (8, "add_kernel")]:
        at = u.index(f'id="static_dist.util.{anchor}"')
        assert u.index(f'id="cell-id={cell_of(k)}"') < at, anchor
        if k + 1 < len(UTIL_CELLS): assert at < u.index(f'id="cell-id={cell_of(k + 1)}"'), anchor
    assert 'id="static_dist.util._hidden"' not in u and u.count('class="api-entry') == 5
    # signatures and code as written: annotations unquoted, a default by name (no repr, no address)
    assert _sig(u, "static_dist.util.f_one") == "def f_one(a: int, b: Pt | None = None, *, c=print) -> str"
    assert _sig(u, "static_dist.util.Kind") == 'Kind = Literal["a", "b"]'
    assert _sig(u, "static_dist.util.Pt") == "@dataclass(frozen=True)\nclass Pt(x: int = 0, y: int | None = None)"
    assert _sig(u, "static_dist.util.Pt.norm") == "def Pt.norm() -> float"
    assert _sig(u, "static_dist.util.add_kernel") == "@triton.jit\ndef add_kernel(X, n, BLOCK: tl.constexpr)"
    assert " at 0x" not in u and "&#x27;int&#x27;" not in u
    # docstrings as Markdown, raw HTML escaped; a constant's doc string; a field table
    doc = u.split('id="static_dist.util.f_one"', 1)[1].split('<div class="api-doc">', 1)[1].split("</div>", 1)[0]
    assert doc == "<p>Uses <code>a</code> and <strong>b</strong>; never &lt;b&gt;raw&lt;/b&gt; HTML.</p>"
    assert "<p>Which kind of thing.</p>" in u and "<td>across</td>" in u
    # [source]: the cell on this page; the exported line in the site's copy of the module, and on GitHub
    line = UTIL_PY.splitlines().index("def f_one(a: int, b=None, *, c=print) -> str:") + 1
    entry = u.split('id="static_dist.util.f_one"', 1)[1].split('<div class="highlight', 1)[0]
    assert f'href="#cell-id={cell_of(4)}"' in entry and f'href="src/static_dist/util.py.html#L{line}"' in entry
    assert f'href="https://github.com/o/r/blob/main/static_dist/util.py#L{line}"' in entry
    src = (tmp_path / "site" / "src" / "static_dist" / "util.py.html").read_text()
    assert f'id="L{line}"><a class="ln" href="#L{line}">{line}</a>def f_one(' in src
    assert 'href="../../util.html"' in src   # back to the page that documents it
    deco = UTIL_PY.splitlines().index("@patch") + 1   # a decorated def's link starts at its first decorator
    assert f'util.py.html#L{deco}"' in u.split('id="static_dist.util.Pt.norm"', 1)[1].split("</div>", 1)[0]


def test_build_docs_is_reproducible(tmp_path):
    "The same sources build the same bytes, whether the pages render in one process or two."
    nbs, _ = _docs_project(tmp_path)
    for out, jobs in (("a", 1), ("b", 2)):
        bd.build(tmp_path / out, nbs, tmp_path / "index.ipynb", root=tmp_path, progress=lambda m: None, jobs=jobs)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*") if p.is_file())
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)


def test_docs_widget_saved_without_state():
    """A widget view whose state was not saved shows what its display also carries (the harness's controls table,
    text and picture as Markdown) in the docs, not `interactive(...)`; only a bare view falls back to its text."""
    view = widget_nb()["cells"][1]["outputs"][0]
    md = "| control | value |\n|---|---|\n| mesh | 4x2 |\n\n![plot](data:image/png;base64,iVBORw0KGgo=)"
    rich = dict(view, data={**view["data"], "text/markdown": md, "image/png": "iVBORw0KGgo="})
    (out,) = bd.docs_notebook(nb_of(code("w", [rich])))["cells"][0]["outputs"]
    h = out["data"]["text/html"]
    assert "state was not saved" in h and "<td>mesh</td>" in h and "<td>4x2</td>" in h, h
    assert 'src="data:image/png;base64,iVBORw0KGgo="' in h and "interactive(...)" not in h, h
    (bare,) = bd.docs_notebook(nb_of(code("w", [view])))["cells"][0]["outputs"]
    assert bare["data"]["text/html"] == "<pre>interactive(...)</pre>"
