"""Write README.md from index.ipynb (nbdev_readme needs quarto, which cannot be installed here).

Markdown cells are copied; code cells become ```python blocks followed by their text output; cells marked
`#| hide` are left out and other `#|` directives are dropped. Terminal colour codes in a text output (a verb's rich
table run in a kernel) are dropped: a README is plain text. `--check` exits 1 if README.md is out of date.
"""
import json, re, sys
from pathlib import Path

root = Path(__file__).resolve().parent.parent

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")   # SGR colours and cursor codes


def render(nb: dict) -> str:
    parts = []
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        lines = src.splitlines()
        if any(l.strip().startswith("#| hide") for l in lines): continue
        if cell["cell_type"] == "markdown":
            parts.append(src.strip()); continue
        if cell["cell_type"] != "code": continue
        code = "\n".join(l for l in lines if not l.startswith("#|")).strip()
        if code: parts.append(f"```python\n{code}\n```")
        out = []
        for o in cell.get("outputs", []):
            if o.get("output_type") == "stream": out.append("".join(o["text"]))
            elif "data" in o and "text/markdown" in o["data"]: parts.append("".join(o["data"]["text/markdown"]).strip())
            elif "data" in o and "text/plain" in o["data"]: out.append("".join(o["data"]["text/plain"]))
        text = ANSI.sub("", "".join(out)).strip("\n")
        if text: parts.append(f"```\n{text}\n```")
    return "<!-- generated from index.ipynb by tools/readme.py: edit the notebook, not this file -->\n\n" + \
        "\n\n".join(parts) + "\n"

if __name__ == "__main__":
    text = render(json.loads((root / "index.ipynb").read_text()))
    readme = root / "README.md"
    if "--check" in sys.argv:
        if not readme.exists() or readme.read_text() != text:
            print("README.md is out of date with index.ipynb: run `python tools/readme.py` and commit it.")
            sys.exit(1)
    else:
        readme.write_text(text)
