"""Build the HTML docs site from the notebooks, with their stored outputs, into _docs/ (git-ignored).

    python tools/build_docs.py                 # index.ipynb -> _docs/index.html, nbs/NN_name.ipynb -> _docs/name.html
    python tools/build_docs.py --out DIR --nbs nbs --index index.ipynb
    python tools/build_docs.py --check-only    # check the links of an existing build

Uses nbconvert's HTML exporter (lab template); nbdev_docs needs quarto, which cannot be installed here. Each page gets
a sidebar linking every page. Cells marked `#| hide` are left out and `#|` directive lines are dropped, as nbdev's
docs do. Stored outputs are shown as they are: plots (embedded PNG), tables, reports. A displayed widget harness is
shown as a static snapshot from the saved widget state (its controls and the plot/report it last drew). For each
exported module (`#| default_exp NAME`) an "API" section lists the names in `static_dist.NAME.__all__` with their
signatures and docstrings, read with `inspect`. The notebooks are not executed here: run
`python tools/run_notebooks.py --write` first to refresh their outputs. Every internal link and image of the built site
is checked (relative, target exists, anchor exists); the command exits 1 on a broken one.
"""
from __future__ import annotations

import argparse, base64, copy, dataclasses, html, importlib, inspect, json, os, re, shutil, sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

ROOT = Path(__file__).resolve().parent.parent
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


class DocsError(Exception):
    "A bad input to the docs build (one line)."


# ---------------------------------------------------------------- pages

@dataclasses.dataclass
class Page:
    src: Path          # notebook
    html: str          # output file name, e.g. "fsdp.html"
    title: str
    module: str | None  # "fsdp" from `#| default_exp fsdp`


def _src(cell) -> str:
    s = cell.get("source", "")
    return "".join(s) if isinstance(s, list) else s


def _directives(src: str) -> dict[str, str]:
    out = {}
    for l in src.splitlines():
        m = re.match(r"\s*#\s*\|\s*([\w-]+)\s*:?\s*(.*)", l)
        if m: out[m.group(1)] = m.group(2).strip()
    return out


def page_name(nb: Path, index: Path | None) -> str:
    "`nbs/40_fsdp.ipynb` -> `fsdp.html` (number prefix dropped, as nbdev's URLs do); the index -> `index.html`."
    if index is not None and nb.resolve() == index.resolve(): return "index.html"
    stem = re.sub(r"^\d+[a-z]?_", "", nb.stem)
    return f"{stem}.html"


def read_page(nb_path: Path, index: Path | None) -> tuple[Page, dict]:
    nb = json.loads(nb_path.read_text(encoding="utf-8"))
    title, module = nb_path.stem, None
    for c in nb["cells"]:
        src = _src(c)
        if c["cell_type"] == "code" and module is None and "default_exp" in _directives(src):
            module = _directives(src)["default_exp"].split()[0]
        if c["cell_type"] == "markdown" and title == nb_path.stem:
            m = re.match(r"\s*#\s+(?:#\s+)?(.+)", src)   # tolerate a stray second '#' in the title
            if m: title = m.group(1).strip()
    return Page(nb_path, page_name(nb_path, index), title, module), nb


# ---------------------------------------------------------------- widget snapshots

def _widget_state(nb: dict) -> dict:
    return nb.get("metadata", {}).get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})


def _ref(v) -> str | None:
    return v[len("IPY_MODEL_"):] if isinstance(v, str) and v.startswith("IPY_MODEL_") else None


def widget_snapshot(model_id: str, state: dict) -> str | None:
    """HTML for a widget as last drawn: its controls (description = value) and the outputs its Output widgets hold.
    None when the state was not saved."""
    if model_id not in state: return None
    controls, outputs, seen = [], [], set()

    def walk(mid):
        if mid in seen or mid not in state: return
        seen.add(mid)
        m = state[mid].get("state", {})
        name = m.get("_model_name", "")
        if name == "OutputModel": outputs.extend(m.get("outputs", []))
        elif "_options_labels" in m and isinstance(m.get("index"), int):   # Dropdown, SelectionSlider, ...
            controls.append((m.get("description", "") or name.replace("Model", ""), m["_options_labels"][m["index"]]))
        elif "value" in m and not name.endswith(("LayoutModel", "StyleModel")):
            controls.append((m.get("description", "") or name.replace("Model", ""), m["value"]))
        for v in m.values():
            for x in (v if isinstance(v, list) else [v]):
                r = _ref(x)
                if r: walk(r)

    walk(model_id)
    parts = ['<div class="widget-snapshot"><div class="widget-note">Interactive in Jupyter; this is the state it was '
             'saved in.</div>']
    if controls:
        parts.append('<table class="widget-controls">' + "".join(
            f"<tr><th>{html.escape(str(d))}</th><td>{html.escape(str(v))}</td></tr>" for d, v in controls) + "</table>")
    for o in outputs:
        parts.append(_output_html(o))
    parts.append("</div>")
    return "".join(parts)


def _output_html(o: dict) -> str:
    "A small HTML rendering of one nbformat output (inside a widget snapshot)."
    if o.get("output_type") == "stream":
        return f"<pre>{html.escape(_text(o.get('text')))}</pre>"
    if o.get("output_type") == "error":
        return f"<pre class='widget-error'>{html.escape(o.get('ename', ''))}: {html.escape(o.get('evalue', ''))}</pre>"
    d = o.get("data", {})
    if "image/png" in d: return f'<img alt="plot" src="data:image/png;base64,{_text(d["image/png"]).strip()}">'
    if "image/svg+xml" in d: return _text(d["image/svg+xml"])
    if "text/html" in d: return _text(d["text/html"])
    if "text/markdown" in d:
        import mistune
        return mistune.html(_text(d["text/markdown"]))
    if "text/plain" in d: return f"<pre>{html.escape(_text(d['text/plain']))}</pre>"
    return ""


def _text(x) -> str: return "".join(x) if isinstance(x, list) else (x or "")


# ---------------------------------------------------------------- notebook -> notebook for the docs

def docs_notebook(nb: dict) -> dict:
    "Drop `#| hide` cells and `#|` lines, replace widget views by snapshots, drop the live-widget metadata."
    nb = copy.deepcopy(nb)
    state = _widget_state(nb)
    cells = []
    for k, c in enumerate(nb["cells"]):
        c.setdefault("id", f"cell-{k}")
        src = _src(c)
        d = _directives(src)
        if "hide" in d: continue
        if c["cell_type"] == "code":
            lines = [l for l in src.splitlines() if not re.match(r"\s*#\s*\|", l)]
            c["source"] = "\n".join(lines).strip("\n")
            if "hide_input" in d or d.get("echo", "").lower() == "false": c["source"] = ""
            if "hide_output" in d or d.get("output", "").lower() == "false": c["outputs"] = []
            if not c["source"].strip() and not c.get("outputs"): continue
            new_out = []
            for o in c.get("outputs", []):
                data = o.get("data", {})
                if WIDGET_MIME in data:
                    snap = widget_snapshot(data[WIDGET_MIME].get("model_id", ""), state)
                    o = dict(output_type="display_data", metadata={},
                             data={"text/html": snap} if snap else {"text/plain": _text(data.get("text/plain", "widget"))})
                new_out.append(o)
            c["outputs"] = new_out
        cells.append(c)
    nb["cells"] = cells
    nb.get("metadata", {}).pop("widgets", None)
    return nb


# ---------------------------------------------------------------- API entries (show_doc style)

def _sig(obj) -> str:
    try: return str(inspect.signature(obj))
    except (TypeError, ValueError): return ""


def _doc(obj) -> str:
    d = inspect.getdoc(obj) or ""
    return d


def api_entry(modname: str, name: str, obj) -> str:
    kind = "class" if inspect.isclass(obj) else "def" if callable(obj) else "var"
    parts = [f'<div class="api-entry" id="{html.escape(modname)}.{html.escape(name)}">']
    if kind == "var":
        parts.append(f"<h4><code>{html.escape(name)}</code></h4><pre>{html.escape(repr(obj)[:300])}</pre></div>")
        return "".join(parts)
    sig = _sig(obj)
    parts.append(f"<h4><code>{kind} {html.escape(name)}{html.escape(sig)}</code></h4>")
    if _doc(obj): parts.append(f"<p class='api-doc'>{html.escape(_doc(obj))}</p>")
    if inspect.isclass(obj):
        rows = []
        if dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                rows.append(f"<li><code>{html.escape(f.name)}: {html.escape(getattr(f.type, '__name__', str(f.type)))}</code></li>")
        for mname, m in vars(obj).items():
            if mname.startswith("_") and mname not in ("__call__",): continue
            fn = m.__func__ if isinstance(m, (classmethod, staticmethod)) else m
            if isinstance(m, property):
                rows.append(f"<li><code>{html.escape(mname)}</code> (property) {html.escape((_doc(m) or '').splitlines()[0] if _doc(m) else '')}</li>")
            elif callable(fn):
                first = (_doc(fn) or "").split("\n\n")[0]
                rows.append(f"<li><code>{html.escape(mname)}{html.escape(_sig(fn))}</code> {html.escape(first)}</li>")
        if rows: parts.append("<ul class='api-members'>" + "".join(rows) + "</ul>")
    parts.append("</div>")
    return "".join(parts)


def api_section(module: str, package: str, pages_of: dict[str, str] | None = None) -> tuple[str, list[str]]:
    """HTML listing the public names of `package.module` (its `__all__`), and the names; an error note if it fails to import.

    A chapter overview (`default_exp fsdp.__init__`) re-exports its stages: those names are listed once, as links to
    the stage page (`pages_of`: module name -> page) that documents them, and only the overview's own names in full."""
    modname = f"{package}.{module}".removesuffix(".__init__")
    try: mod = importlib.import_module(modname)
    except Exception as e:  # a broken module should show, not stop the whole site
        return (f'<section class="api" id="api"><h2>API: <code>{html.escape(modname)}</code></h2>'
                f"<p class='api-error'>could not import: {html.escape(type(e).__name__)}: {html.escape(str(e))}</p></section>", [])
    names = list(getattr(mod, "__all__", []))
    body = [f'<section class="api" id="api"><h2>API: <code>{html.escape(modname)}</code></h2>']
    if not names: body.append("<p>This module exports no public names.</p>")
    staged: dict[str, list[str]] = {}
    for n in names:
        if not hasattr(mod, n): continue
        home = _home(n, getattr(mod, n), modname, pages_of or {})
        if home: staged.setdefault(home, []).append(n)
        else: body.append(api_entry(modname, n, getattr(mod, n)))
    for home, ns in staged.items():
        links = ", ".join(f'<a href="{pages_of[home]}#{html.escape(home)}.{html.escape(n)}"><code>{html.escape(n)}</code></a>'
                          for n in ns)
        body.append(f'<p>From <a href="{pages_of[home]}"><code>{html.escape(home)}</code></a>: {links}</p>')
    body.append("</section>")
    return "".join(body), names


def _home(name: str, obj, modname: str, pages_of: dict[str, str]) -> str | None:
    "The stage module (below `modname`, with a page listing `name`) that defines `obj`; None if `modname` documents it."
    home = getattr(obj, "__module__", None)
    if not (home and home != modname and home.startswith(modname + ".") and home in pages_of): return None
    return home if name in getattr(importlib.import_module(home), "__all__", ()) else None


# ---------------------------------------------------------------- the page shell

CSS = """
body { margin: 0; }
nav.docs-nav { position: fixed; top: 0; left: 0; bottom: 0; width: 15rem; overflow-y: auto; padding: 1rem;
  background: #f6f7f9; border-right: 1px solid #ddd; font: 14px/1.5 system-ui, sans-serif; box-sizing: border-box; }
nav.docs-nav a { display: block; color: #234; text-decoration: none; padding: 2px 4px; border-radius: 3px; }
nav.docs-nav a.current { background: #dde6f3; font-weight: 600; }
nav.docs-nav .site { font-weight: 700; font-size: 16px; margin-bottom: .5rem; }
nav.docs-nav .mod { color: #777; font-size: 12px; margin-left: 4px; }
main.docs-main { margin-left: 15rem; }
.widget-snapshot { border: 1px dashed #bbb; padding: .5rem; margin: .25rem 0; }
.widget-snapshot img { max-width: 100%; }
.widget-note { color: #777; font-size: 12px; }
.widget-controls th { text-align: left; padding-right: 1rem; font-weight: 500; }
section.api { margin: 2rem 1rem 2rem 5.5rem; padding-top: 1rem; border-top: 2px solid #ccc; font-family: system-ui, sans-serif; }
.api-entry h4 code { font-size: 14px; background: #f3f3f3; padding: 2px 4px; }
.api-doc { white-space: pre-wrap; margin-left: 1rem; }
.api-members { font-size: 13px; }
.api-entry pre { white-space: pre-wrap; overflow-wrap: anywhere; }
"""


def nav_html(pages: list[Page], current: Page) -> str:
    items = []
    for p in pages:
        cls = ' class="current"' if p is current else ""
        mod = f'<span class="mod">{html.escape(p.module.removesuffix(".__init__"))}</span>' if p.module else ""
        title = re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(p.title))
        items.append(f'<a href="{p.html}"{cls}>{title}{mod}</a>')
    return '<nav class="docs-nav"><div class="site"><a href="index.html">static_dist</a></div>' + "".join(items) + "</nav>"


def link_map(pages: list[Page], root: Path) -> dict[str, str]:
    "Notebook references as written in prose (`40_fsdp.ipynb`, `nbs/40_fsdp.ipynb`, `/index.ipynb`) -> page file."
    m = {}
    for p in pages:
        for k in (p.src.name, str(p.src.relative_to(root)) if p.src.is_relative_to(root) else p.src.name,
                  "../" + p.src.name, "./" + p.src.name):
            m[k] = p.html
    return m


def render_page(page: Page, nb: dict, pages: list[Page], links: dict[str, str], package: str) -> tuple[str, list[str]]:
    from nbconvert import HTMLExporter
    import nbformat
    ex = HTMLExporter(template_name="lab", embed_images=True, exclude_input_prompt=True, exclude_output_prompt=True)
    body, _ = ex.from_notebook_node(nbformat.reads(json.dumps(docs_notebook(nb)), as_version=4),
                                    resources={"metadata": {"name": page.title, "path": str(page.src.parent)}})
    # requirejs only serves live widgets, which the docs show as snapshots: no external script needed for that
    body = re.sub(r'<script src="[^"]*require(?:\.min)?\.js"></script>\s*', "", body)
    body = re.sub(r"<title>.*?</title>", f"<title>{html.escape(page.title)} – static_dist</title>", body, count=1, flags=re.S)
    def relink(m):
        href = m.group(2); path, _, frag = href.partition("#")
        target = links.get(unquote(path))
        if target is None: return m.group(0)
        return f'{m.group(1)}="{target}{"#" + frag if frag else ""}"'
    body = re.sub(r'(href)="([^"#:]+\.ipynb(?:#[^"]*)?)"', relink, body)
    pages_of = {f"{package}.{p.module}".removesuffix(".__init__"): p.html for p in pages if p.module}
    api, names = api_section(page.module, package, pages_of) if page.module else ("", [])
    body = body.replace("</head>", f'<link rel="icon" href="data:,">\n<style>{CSS}</style>\n</head>', 1)
    body = re.sub(r"(<body[^>]*>)", lambda m: m.group(1) + nav_html(pages, page) + '<main class="docs-main">', body, count=1)
    body = body.replace("</body>", api + "</main></body>", 1)
    return body, names


# ---------------------------------------------------------------- link checking

class _Links(HTMLParser):
    def __init__(self):
        super().__init__(); self.refs, self.ids = [], set()
    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"): self.ids.add(a["id"])
        if tag == "a" and a.get("name"): self.ids.add(a["name"])
        for k in ("href", "src"):
            if a.get(k) is not None and tag in ("a", "img", "link", "script", "iframe", "source"): self.refs.append((tag, k, a[k]))


def check_site(out: Path) -> list[str]:
    """Problems in the built site: an internal link or image that is absolute, points to a missing file, or to a
    missing anchor; an <img> with an empty src."""
    pages = {p.name: p for p in out.glob("*.html")}
    parsed = {}
    for name, p in pages.items():
        lp = _Links(); lp.feed(p.read_text(encoding="utf-8")); parsed[name] = lp
    bad = []
    for name, lp in parsed.items():
        for tag, attr, ref in lp.refs:
            if tag == "img" and not ref.strip(): bad.append(f"{name}: <img> with an empty src"); continue
            u = urlsplit(ref)
            if u.scheme in ("http", "https", "mailto", "data", "javascript") or u.netloc: continue
            if ref.startswith("/"): bad.append(f"{name}: absolute internal link {ref!r} (links must be relative)"); continue
            target = name if not u.path else os.path.normpath(unquote(u.path))
            tpath = out / target
            if not tpath.exists(): bad.append(f"{name}: {tag} {attr}={ref!r} points to a missing file"); continue
            ids = parsed[target].ids if target in parsed else set()
            if u.fragment and target in parsed and u.fragment not in ids and unquote(u.fragment) not in ids:
                bad.append(f"{name}: link {ref!r}: no anchor #{u.fragment} in {target}")
    return bad


# ---------------------------------------------------------------- main

def build(out: Path, nbs_dir: Path, index: Path | None, package: str = "static_dist", root: Path = ROOT,
          progress=print) -> dict:
    "Build the site; return a summary {pages: [...], api: {module: n_names}, problems: [...]}."
    if not nbs_dir.is_dir(): raise DocsError(f"no notebook folder {nbs_dir}: give --nbs DIR")
    srcs = ([index] if index and index.exists() else []) + sorted(
        p for p in nbs_dir.rglob("*.ipynb") if not any(s.startswith((".", "_")) for s in p.relative_to(nbs_dir).parts))
    if not srcs: raise DocsError(f"no notebooks under {nbs_dir}")
    read = [read_page(s, index) for s in srcs]
    pages = [p for p, _ in read]
    dup = {p.html for p in pages if sum(q.html == p.html for q in pages) > 1}
    if dup: raise DocsError(f"two notebooks map to the same page {sorted(dup)}: rename one")
    if out.exists(): shutil.rmtree(out)
    out.mkdir(parents=True)
    links = link_map(pages, root)
    summary = dict(pages=[], api={}, problems=[])
    for page, nb in read:
        body, names = render_page(page, nb, pages, links, package)
        (out / page.html).write_text(body, encoding="utf-8")
        n_img = body.count("<img ")
        summary["pages"].append(dict(page=page.html, source=str(page.src.relative_to(root)) if page.src.is_relative_to(root) else str(page.src),
                                     title=page.title, images=n_img, api_names=len(names)))
        if page.module: summary["api"][page.module] = len(names)
        progress(f"  {page.html:28s} {n_img:3d} images  {len(names):3d} API entries  <- {page.src.name}")
    summary["problems"] = check_site(out)
    (out / "site.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "_docs")
    ap.add_argument("--nbs", type=Path, default=ROOT / "nbs")
    ap.add_argument("--index", type=Path, default=ROOT / "index.ipynb")
    ap.add_argument("--package", default="static_dist")
    ap.add_argument("--check-only", action="store_true", help="only check the links of an existing build in --out")
    a = ap.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1") if shutil.which("nvidia-smi") is None else None
    try:
        if a.check_only:
            if not a.out.is_dir(): raise DocsError(f"no built site in {a.out}: run python tools/build_docs.py first")
            problems = check_site(a.out)
        else:
            print(f"building docs into {a.out}")
            s = build(a.out, a.nbs, a.index, a.package)
            problems = s["problems"]
            print(f"{len(s['pages'])} pages, {sum(p['images'] for p in s['pages'])} images, "
                  f"{sum(s['api'].values())} API entries in {len(s['api'])} modules")
    except DocsError as e:
        print(f"build_docs: {e}", file=sys.stderr); return 2
    if problems:
        print(f"FAIL: {len(problems)} broken link(s) or image(s):"); [print("  " + p) for p in problems]
        return 1
    print(f"links OK; open {a.out / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
