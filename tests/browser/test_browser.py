"""Browser checks (marked `browser`): the built docs (every page; offline load, search, [source] links, sidebar; the
reader's path of issue 31), Run All in JupyterLab, every control of the four chapter harnesses, and the chapter
notebooks as a fresh clone opens them.

They need Debian's chromium and chromium-driver (installed by .ci/setup) and skip with one reason without them.
Screenshots go to $BROWSER_OUT (default /tmp/browser-shots). Run by hand: python tests/browser/browser_check.py
"""
import os, subprocess, sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import browser_check as bc  # noqa: E402
import harness_check as hc  # noqa: E402

if bc.MISSING_BROWSER:
    pytest.skip(bc.MISSING_BROWSER, allow_module_level=True)

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def shots():
    return bc.out_dir()


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    "The built site: $BROWSER_DOCS, else _docs/ when it is newer than every notebook, else a fresh build in a temp dir."
    if os.environ.get("BROWSER_DOCS"): return Path(os.environ["BROWSER_DOCS"])
    d = bc.ROOT / "_docs"
    nbs = [bc.ROOT / "index.ipynb", *(bc.ROOT / "nbs").rglob("*.ipynb")]
    if (d / "index.html").exists() and (d / "index.html").stat().st_mtime >= max(
        p.stat().st_mtime for p in nbs if p.exists()
    ):
        return d
    d = tmp_path_factory.mktemp("docs")
    subprocess.run([sys.executable, str(bc.ROOT / "tools" / "build_docs.py"), "--out", str(d)], check=True)
    return d


def test_docs_pages_load(docs, shots):
    info = bc.check_docs(docs, shots)
    n_chapters = len(list((bc.ROOT / "nbs").rglob("*.ipynb")))
    assert len(info) == n_chapters + 1, f"{len(info)} pages for {n_chapters} notebooks and the index"
    assert sum(v["api_entries"] for v in info.values()) > 0, "no API entries rendered"


def test_docs_features(docs, shots):
    "Offline load (file:// and localhost), search, [source] links, and the sidebar keeping the current page in view."
    r = bc.check_docs_features(docs, shots)
    assert r["search"]["api"].endswith(".plan_fsdp") and r["search"]["page"] == "zoo.html", r
    assert r["source_links"] > 0 and r["source"]["py"].startswith("src/static_dist/"), r


def test_docs_reader_path(docs, shots):
    """Issue 31's reader: front page commands and chapter links, each overview's stage links, plots and tables on the
    parallel plan/verify/run pages, no raw dicts, no spinner, no picture twice, page names, a TOC on every page."""
    r = bc.check_reader(docs, shots)
    assert r["chapters"] > 1 and r["snapshots"] >= len(hc.CHAPTERS), r


# the default notebook, the harness notebook (its test harnesses are discarded: 'No such comm' came from there) and the
# parallel plots (a pyplot figure returned was shown twice)
RUN_ALL = [None, "nbs/29_harness.ipynb", "nbs/45i_parallel_plots.ipynb"]


@pytest.mark.parametrize("notebook", RUN_ALL)
def test_lab_run_all_no_error(shots, notebook):
    "Run All: no error, nothing in the log console, no widget view but a harness's saved, no picture shown twice."
    r = bc.check_lab_run_all(shots, notebook=bc.ROOT / notebook if notebook else None)
    assert r["code_cells"] > 0


def test_harnesses_every_control(shots):
    """Each control of the placement, FSDP, offload and stability harnesses moved (BROWSER_HARNESS_FULL=1: every option
    and every strategy): the output changes, no plot is blank, nothing lands in the log console."""
    r = hc.check_harnesses(shots)
    for name in hc.HARNESS_CELLS:
        assert (
            r[name]["changes"] >= r[name]["controls_moved"] > 0
            and r[name]["blank_plots"] == r[name]["log_console"] == 0
        ), r


def test_fresh_clone_shows_pictures_and_opens_clean(shots):
    """Untrusted, not run: a picture and a table of the controls' values where each harness is; opening changes only
    the kernelspec's display name."""
    r = hc.check_fresh_clone(shots)
    assert all(r[n]["pictures"] >= 1 and r[n]["controls"] >= 1 for n in hc.CHAPTERS), r
