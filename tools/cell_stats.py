"""Size of the literate units: lines per exported cell (per notebook) and lines per library module.

    python tools/cell_stats.py            # table; exit 1 if a notebook's median exported cell > 20 lines,
                                          # a module (other than nbdev's _modidx) is over 500 lines,
                                          # or a line of source is over 120 characters

A cell's length counts every line except nbdev directives (`#| ...`), blank lines included.
"""
from __future__ import annotations
import json, re, statistics, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The median cap was 15 while lines were packed past 120 characters; unpacked by ruff's rules (one argument per line
# where a call does not fit), the same cells measure 15-19 lines, so the cap is 20: the cells did not grow in content.
MAX_MEDIAN, MAX_MODULE, MAX_LINE = 20, 500, 120
_EXPORT = re.compile(r"^#\|\s*(export|exporti|exports)\b", re.M)


def exported_cell_lengths(nb: Path) -> list[int]:
    "Line counts of the exported code cells of notebook `nb` (directive lines left out)."
    cells = json.loads(nb.read_text())["cells"]
    out = []
    for c in cells:
        src = "".join(c["source"])
        if c["cell_type"] == "code" and _EXPORT.search(src):
            out.append(sum(1 for l in src.rstrip("\n").splitlines() if not l.startswith("#|")))
    return out


def notebook_medians(root: Path = ROOT) -> dict[str, float]:
    "Median exported-cell length of each notebook that exports code."
    return {p.name: statistics.median(L) for p in sorted((root / "nbs").glob("*.ipynb"))
            if (L := exported_cell_lengths(p))}


ONE_IDEA = "# One idea over 500 lines:"   # a module may pass the cap when its top says why splitting would scatter it


def module_lengths(root: Path = ROOT) -> dict[str, int]:
    """Lines of each library module under static_dist/ (nbdev's generated _modidx.py left out, and modules whose first
    30 lines say, after ONE_IDEA, why they stay whole)."""
    pkg = root / "static_dist"
    out = {}
    for p in sorted(pkg.rglob("*.py")):
        lines = p.read_text().splitlines()
        if p.name != "_modidx.py" and not any(l.startswith(ONE_IDEA) for l in lines[:30]):
            out[str(p.relative_to(pkg))] = len(lines)
    return out


def _nbdev_written(i: int, line: str) -> bool:
    """A line nbdev_export writes itself, which no notebook cell holds: the module docstring on line 1 (the notebook's
    description, prose) and the `__all__` list."""
    return (i == 1 and line.startswith('"""')) or line.startswith("__all__") or line.startswith("           '")


def long_lines(root: Path = ROOT, limit: int = MAX_LINE) -> list[str]:
    """'file:line' of every line over `limit` characters: in notebook code cells, in the index, in the library (what
    nbdev writes itself left out: `_modidx.py`, module docstrings, `__all__` lists), in tests/ and tools/."""
    out = []
    for nb in [root / "index.ipynb", *sorted((root / "nbs").glob("*.ipynb"))]:
        if not nb.exists(): continue
        for k, c in enumerate(json.loads(nb.read_text())["cells"]):
            if c["cell_type"] != "code": continue
            for i, l in enumerate("".join(c["source"]).splitlines(), 1):
                if len(l) > limit: out.append(f"{nb.relative_to(root)}:cell {k} line {i}")
    files = [p for d in ("static_dist", "tests", "tools") for p in sorted((root / d).rglob("*.py"))]
    for p in files:
        if p.name == "_modidx.py": continue
        for i, l in enumerate(p.read_text().splitlines(), 1):
            if len(l) > limit and not (root / "static_dist" in p.parents and _nbdev_written(i, l)):
                out.append(f"{p.relative_to(root)}:{i}")
    return out


def main() -> int:
    bad = []
    for name, med in notebook_medians().items():
        L = exported_cell_lengths(ROOT / "nbs" / name)
        flag = "  <-- over" if med > MAX_MEDIAN else ""
        if flag: bad.append(name)
        print(f"{name:36s} cells {len(L):3d}  median {med:5.1f}  max {max(L):4d}{flag}")
    for name, n in module_lengths().items():
        if n > MAX_MODULE: bad.append(name); print(f"module {name}: {n} lines  <-- over {MAX_MODULE}")
    long = long_lines()
    for where in long: print(f"{where}: over {MAX_LINE} characters")
    if long: bad.append(f"{len(long)} long lines")
    print("ok" if not bad else f"{len(bad)} over the limits: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__": sys.exit(main())
