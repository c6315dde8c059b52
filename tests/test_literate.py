"""#13's shape of the literate source: small exported cells in every notebook, no library module over 500 lines."""
import importlib.util, json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("cell_stats", ROOT / "tools" / "cell_stats.py")
cell_stats = importlib.util.module_from_spec(spec); spec.loader.exec_module(cell_stats)


def test_counts_lines_of_exported_cells_only(tmp_path):
    # a hand-made notebook: one exported cell of 3 counted lines (directive left out, blank line kept), one test cell
    nb = dict(cells=[dict(cell_type="code", source=["#| export\n", "def f():\n", "\n", "    return 1\n"]),
                     dict(cell_type="code", source=["assert f() == 1\n"]),
                     dict(cell_type="markdown", source=["#| export\n", "not code\n"])])
    (tmp_path / "nbs").mkdir(); (tmp_path / "nbs" / "x.ipynb").write_text(json.dumps(nb))
    assert cell_stats.exported_cell_lengths(tmp_path / "nbs" / "x.ipynb") == [3]
    assert cell_stats.notebook_medians(tmp_path) == {"x.ipynb": 3}


def test_every_notebook_has_small_exported_cells():
    over = {n: m for n, m in cell_stats.notebook_medians().items() if m > cell_stats.MAX_MEDIAN}
    assert not over, f"median lines per exported cell over {cell_stats.MAX_MEDIAN}: {over}"


def test_no_module_over_500_lines():
    over = {n: k for n, k in cell_stats.module_lengths().items() if k > cell_stats.MAX_MODULE}
    assert not over, f"modules over {cell_stats.MAX_MODULE} lines (split them by stage): {over}"
