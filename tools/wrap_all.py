"""Wrap each exported module's `__all__` within 120 characters.

nbdev 2.4.7 (`maker.ModuleMaker.make`) wraps the names at 120 characters and then writes `__all__ = ` before the first
line, so that line reaches up to 130. This re-wraps the list nbdev wrote (the statement after `# %% auto 0`) with the
prefix counted; the names and their order are nbdev's. Run it after `nbdev_export` (.ci/run does, before it checks
that the export left nothing to commit). Idempotent. `--check` exits 1 if a module would change.
"""
import ast, sys
from pathlib import Path
from textwrap import TextWrapper

root = Path(__file__).resolve().parent.parent
WRAP = TextWrapper(width=120, initial_indent="__all__ = ", subsequent_indent=" " * 11, break_long_words=False)


def rewrapped(text: str) -> str:
    "`text` (a module) with its nbdev `__all__` statement wrapped within 120 characters; unchanged without one."
    lines = text.split("\n")
    try: start = lines.index("# %% auto 0") + 1
    except ValueError: return text
    if start >= len(lines) or not lines[start].startswith("__all__ = ["): return text
    end = start
    while not lines[end].rstrip().endswith("]"): end += 1
    names = ast.literal_eval(" ".join(l.strip() for l in lines[start:end + 1])[len("__all__ = "):])
    return "\n".join(lines[:start] + WRAP.wrap(str(names)) + lines[end + 1:])


def main(argv) -> int:
    check, changed = "--check" in argv, []
    for p in sorted((root / "static_dist").rglob("*.py")):
        text = p.read_text(encoding="utf-8")
        new = rewrapped(text)
        if new == text: continue
        changed.append(p.relative_to(root))
        if not check: p.write_text(new, encoding="utf-8")
    if check and changed:
        print(f"__all__ wider than 120 characters in {', '.join(map(str, changed))}: run python tools/wrap_all.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
