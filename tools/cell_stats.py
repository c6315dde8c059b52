"""Size of the literate units: lines per exported cell (per notebook) and lines per library module.

    python tools/cell_stats.py            # table; exit 1 if a notebook's median exported cell > 15 lines
                                          # or a module (other than nbdev's _modidx) is over 500 lines

A cell's length counts every line except nbdev directives (`#| ...`), blank lines included.
"""
from __future__ import annotations
import json, re, statistics, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_MEDIAN, MAX_MODULE = 15, 500
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


def main() -> int:
    bad = []
    for name, med in notebook_medians().items():
        L = exported_cell_lengths(ROOT / "nbs" / name)
        flag = "  <-- over" if med > MAX_MEDIAN else ""
        if flag: bad.append(name)
        print(f"{name:36s} cells {len(L):3d}  median {med:5.1f}  max {max(L):4d}{flag}")
    for name, n in module_lengths().items():
        if n > MAX_MODULE: bad.append(name); print(f"module {name}: {n} lines  <-- over {MAX_MODULE}")
    print("ok" if not bad else f"{len(bad)} over the limits: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__": sys.exit(main())
