"""#13's shape of the literate source: small exported cells in every notebook, no library module over 500 lines, no
line over 120 characters."""
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


def test_finds_long_lines_in_notebooks_and_modules(tmp_path):
    # a hand-made project: one 121-character line in a notebook cell, one in a module, one nbdev __all__ line (allowed)
    long = "x = '" + "a" * 115 + "'"
    assert len(long) == 121
    nb = dict(cells=[dict(cell_type="code", source=["y = 1\n", long + "\n"])])
    (tmp_path / "nbs").mkdir(); (tmp_path / "nbs" / "x.ipynb").write_text(json.dumps(nb))
    (tmp_path / "static_dist").mkdir()
    (tmp_path / "static_dist" / "m.py").write_text("__all__ = [" + "'n', " * 30 + "]\n" + long + "\n")
    assert cell_stats.long_lines(tmp_path) == ["nbs/x.ipynb:cell 0 line 2", "static_dist/m.py:2"]


def test_no_line_over_120_characters():
    long = cell_stats.long_lines()
    assert not long, f"{len(long)} lines over {cell_stats.MAX_LINE} characters (wrap them), first: {long[:5]}"


def test_wrap_all_keeps_nbdev_names_within_120(tmp_path):
    "nbdev 2.4.7 wraps `__all__` at 120 and then prefixes it (up to 130); tools/wrap_all.py re-wraps, names kept."
    import ast, textwrap
    spec = importlib.util.spec_from_file_location("wrap_all", ROOT / "tools" / "wrap_all.py")
    wrap_all = importlib.util.module_from_spec(spec); spec.loader.exec_module(wrap_all)
    names = [f"name_{i:02d}_of_a_module" for i in range(30)]
    tw = textwrap.TextWrapper(width=120, initial_indent='', subsequent_indent=' ' * 11, break_long_words=False)
    module = f'"""doc"""\n\n# %% auto 0\n__all__ = ' + "\n".join(tw.wrap(str(names))) + "\n\n# %% cell\nx = 1\n"
    assert max(map(len, module.splitlines())) > 120                      # what nbdev writes, as nbdev builds it
    out = wrap_all.rewrapped(module)
    assert max(map(len, out.splitlines())) <= 120 and out.endswith("\n\n# %% cell\nx = 1\n")
    block = out.split("# %% auto 0\n")[1].split("\n\n")[0]
    assert ast.literal_eval(block.removeprefix("__all__ = ")) == names and wrap_all.rewrapped(out) == out
