"""Build the HTML docs site from the notebooks, with their stored outputs, into _docs/ (git-ignored).

    python tools/build_docs.py                 # index.ipynb -> _docs/index.html, nbs/NN_name.ipynb -> _docs/name.html
    python tools/build_docs.py --out DIR --nbs nbs --index index.ipynb -j 2
    python tools/build_docs.py --check-only    # check the links of an existing build

Uses nbconvert's HTML exporter (lab template); nbdev_docs needs quarto, which cannot be installed here. Cells marked
`#| hide` are left out and `#|` directive lines are dropped, as nbdev's docs do. Stored outputs are shown as they are:
plots (embedded PNG), tables, reports. A displayed widget harness is shown as a static snapshot from the saved widget
state (its controls and the plot/report it last drew). The notebooks are not executed here: run
`python tools/run_notebooks.py --write` first to refresh their outputs.

What nbdev's site gives a reader, built here without quarto and without network:
- API entries where the notebook documents them, as nbdev's `show_doc` does: after each `#| export` cell, one entry per
  public name it defines (an `@patch`ed method as `Class.method`), read from the source text (the AST), never from
  imported objects: signatures with their annotations as written, `Literal` aliases and Triton kernels as written,
  docstrings as Markdown, no reprs (so no memory addresses, and the same commit builds the same bytes).
- [source] links: to the notebook cell (an anchor on the page), to the exported line in a plain copy of the module
  under src/ (works offline and is link-checked), and to the line on GitHub (settings.ini git_url + branch).
- A sidebar grouped by chapter (`40_fsdp` and its stages `40a_...`), a per-page table of contents (h2/h3), and a search
  box over pages, sections and API entries (search_index.js, loaded on first use; docs.js and docs.css come from
  tools/docs_static/; the lab template's stylesheet is written once, as lab.css). Nothing is loaded from the network:
  no MathJax (no page has math), no require.js, no mermaid.
- Pages render in parallel (`-j`, default 2); the output does not depend on it.

Every internal link and image of the built site is checked (relative, target exists, anchor exists), and every page's
heading ids are unique; the command exits 1 on a problem.
"""
from __future__ import annotations

import argparse, ast, configparser, copy, dataclasses, html, json, os, re, shutil, sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

ROOT = Path(__file__).resolve().parent.parent
STATIC = Path(__file__).resolve().parent / "docs_static"   # docs.css, docs.js: copied into the site
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
SEARCH_INDEX = "search_index.js"


class DocsError(Exception):
    "A bad input to the docs build (one line)."


# ---------------------------------------------------------------- pages and chapters

@dataclasses.dataclass
class Page:
    src: Path          # notebook
    html: str          # output file name, e.g. "fsdp.html"
    title: str
    module: str | None  # "fsdp" from `#| default_exp fsdp`
    subtitle: str = ""  # the `> ...` line under the title


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
    stem = re.sub(r"^\d+[a-z]*_", "", nb.stem)
    return f"{stem}.html"


def read_page(nb_path: Path, index: Path | None) -> tuple[Page, dict]:
    nb = json.loads(nb_path.read_text(encoding="utf-8"))
    title, module, subtitle = nb_path.stem, None, ""
    for c in nb["cells"]:
        src = _src(c)
        if c["cell_type"] == "code" and module is None and "default_exp" in _directives(src):
            module = _directives(src)["default_exp"].split()[0]
        if c["cell_type"] == "markdown" and title == nb_path.stem:
            m = re.match(r"\s*#\s+(?:#\s+)?(.+)", src)   # tolerate a stray second '#' in the title
            if m:
                title = m.group(1).strip()
                sub = re.search(r"^>\s*(.+)$", src, re.M)
                subtitle = sub.group(1).strip() if sub else ""
    return Page(nb_path, page_name(nb_path, index), title, module, subtitle), nb


def chapters(pages: list[Page]) -> list[list[Page]]:
    """Pages grouped by the number their notebook starts with: `40_fsdp` (the overview) then its stages `40a_...`,
    in file order. A page without a number (the index) is a chapter of its own."""
    groups: dict[str, list[Page]] = {}
    for p in pages:
        m = re.match(r"(\d+)", p.src.stem)
        groups.setdefault(m.group(1) if m and p.html != "index.html" else p.html, []).append(p)
    return list(groups.values())


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


def saved_view_html(data: dict) -> str:
    """HTML for a widget saved without its state (a notebook saved without "Save widget state", or cleaned): what its
    display also carries (`harness.saved_view`: the controls table, the text and the picture as Markdown, else the
    picture), with a note; its text/plain ("interactive(...)") only when there is nothing else."""
    note = ('<div class="widget-snapshot"><div class="widget-note">Interactive in Jupyter; its state was not saved, '
            'so this is what it showed.</div>')
    for mime in ("text/markdown", "text/html", "image/png", "image/svg+xml"):
        if mime in data:
            return note + _output_html(dict(output_type="display_data", data={mime: data[mime]})) + "</div>"
    return f"<pre>{html.escape(_text(data.get('text/plain', 'widget')))}</pre>"


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


def _cell_id(c: dict, k: int) -> str:
    "The cell's id (nbformat 4.5), or one from its position for an older notebook: the anchor of its rendered cell."
    return c.get("id") or f"cell-{k}"


# ---------------------------------------------------------------- API entries, from the source text

@dataclasses.dataclass
class Entry:
    "One documented name: where it is defined (notebook cell, exported line) and its definition."
    name: str            # "plan_fsdp", or "FSDPPlan.to_dict" for an @patch'ed method
    module: str          # "static_dist.fsdp.search"
    page: str            # "fsdp_search.html"
    cell_id: str         # the notebook cell that defines it
    node: ast.stmt       # its definition in that cell
    src: str             # that cell's code (the text annotations and defaults are read from)
    doc: str = ""        # docstring, or the string under a constant
    py: str | None = None     # "static_dist/fsdp/search.py", the exported file
    line: int | None = None   # its first line there (decorators included)

    @property
    def anchor(self) -> str: return f"{self.module}.{self.name}"


def _code(cell) -> str:
    "A code cell's source without its `#|` directive lines."
    return "\n".join(l for l in _src(cell).splitlines() if not re.match(r"\s*#\s*\|", l))


def _parse(code: str) -> ast.Module | None:
    try: return ast.parse(code)
    except SyntaxError: return None   # a cell with IPython magics, or a file someone is editing


def _is_patch(dec: ast.expr) -> bool:
    "fastcore's `@patch` or `@patch(as_prop=True)`."
    f = dec.func if isinstance(dec, ast.Call) else dec
    return ast.unparse(f) in ("patch", "fastcore.basics.patch")


def _patched_class(node: ast.stmt) -> str | None:
    "`Cls` for `@patch def meth(self: Cls, ...)`, else None."
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not any(map(_is_patch, node.decorator_list)):
        return None
    first = (node.args.posonlyargs + node.args.args)[:1]
    return ast.unparse(first[0].annotation) if first and first[0].annotation else None


def defined_names(tree: ast.Module) -> dict[str, ast.stmt]:
    "Top-level names a cell or module defines (functions, classes, assignments); an `@patch`ed method as `Cls.meth`."
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            cls = _patched_class(node)
            out[f"{cls}.{node.name}" if cls else node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                for n in _target_names(t): out[n] = node
    return out


def _target_names(t: ast.expr) -> list[str]:
    "Names an assignment binds: `a`, `a, (b, *c)`; not `Cls.attr = ...` or `d[k] = ...`, which bind no new name."
    if isinstance(t, ast.Name): return [t.id]
    if isinstance(t, ast.Starred): return _target_names(t.value)
    if isinstance(t, (ast.Tuple, ast.List)): return [n for e in t.elts for n in _target_names(e)]
    return []


def module_all(tree: ast.Module) -> list[str] | None:
    "The literal `__all__` nbdev writes at the top of an exported module (None when there is none)."
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            try: return list(ast.literal_eval(node.value))
            except ValueError: return None
    return None


def _public(name: str, exported: list[str] | None) -> bool:
    "nbdev documents public names: not `_private`, and (when the module lists them) in `__all__`."
    if any(part.startswith("_") for part in name.split(".")): return False
    return exported is None or name.split(".")[0] in exported


def _string_after(body: list[ast.stmt], i: int) -> str:
    "The string statement after `body[i]`, if that is what follows: how fastcore documents a field or a constant."
    nxt = body[i + 1] if i + 1 < len(body) else None
    ok = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)
    return nxt.value.value if ok else ""


def _doc(tree: ast.Module, node: ast.stmt) -> str:
    "A def's or class's docstring; for a constant, the string right after it."
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)): return ast.get_docstring(node) or ""
    return _string_after(tree.body, tree.body.index(node))


def module_file(root: Path, package: str, module: str) -> Path | None:
    "`fsdp.plan` -> static_dist/fsdp/plan.py; `fsdp.__init__` or a package `fsdp` -> static_dist/fsdp/__init__.py."
    parts = module.removesuffix(".__init__").split(".")
    for p in (root.joinpath(package, *parts).with_suffix(".py"), root.joinpath(package, *parts, "__init__.py")):
        if p.is_file(): return p
    return None


def _first_line(node: ast.stmt) -> int:
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])


def page_entries(page: Page, nb: dict, root: Path, package: str, texts: dict[str, str]) -> list[Entry]:
    """The API entries of a page, in notebook order: each public name an `#| export` cell defines, at the last cell
    that defines it, with its line in the exported module when that file has it. `texts` gets the module's text as
    read here (the src/ copy must be the text the line numbers come from)."""
    if not page.module: return []
    modname = f"{package}.{page.module}".removesuffix(".__init__")
    py = module_file(root, package, page.module)
    rel = py.relative_to(root).as_posix() if py else None
    if rel: texts[rel] = py.read_text(encoding="utf-8")
    tree = _parse(texts[rel]) if rel else None
    exported = module_all(tree) if tree else None
    lines = {n: _first_line(node) for n, node in defined_names(tree).items()} if tree else {}
    found: dict[str, Entry] = {}
    for k, c in enumerate(nb["cells"]):
        d = _directives(_src(c))
        if c["cell_type"] != "code" or not ("export" in d or "exports" in d): continue
        code = _code(c)
        cell_tree = _parse(code)
        for name, node in (defined_names(cell_tree) if cell_tree else {}).items():
            if not _public(name, exported): continue
            found.pop(name, None)   # a later definition wins, as it does on import
            found[name] = Entry(name, modname, page.html, _cell_id(c, k), node, code, _doc(cell_tree, node),
                                rel if name in lines else None, lines.get(name))
    return list(found.values())


# ---------------------------------------------------------------- API entries: signatures as written

def _seg(src: str, node: ast.AST) -> str:
    "The source text of `node` as written (ast.unparse when it spans lines: a signature is laid out here)."
    s = ast.get_source_segment(src, node)
    return ast.unparse(node) if s is None or "\n" in s else s


def _param(src: str, a: ast.arg, default: ast.expr | None) -> str:
    s = a.arg + (f": {_seg(src, a.annotation)}" if a.annotation else "")
    if default is not None: s += (" = " if a.annotation else "=") + _seg(src, default)
    return s


def params(src: str, args: ast.arguments, drop_first: bool = False) -> list[str]:
    "Each parameter as written (`name: type = default`), with the `/` and `*` markers; `drop_first` drops self/cls."
    pos = args.posonlyargs + args.args
    defaults = [None] * (len(pos) - len(args.defaults)) + list(args.defaults)
    out = []
    for i, (a, d) in enumerate(zip(pos, defaults)):
        if not (drop_first and i == 0): out.append(_param(src, a, d))
        if args.posonlyargs and i == len(args.posonlyargs) - 1 and out: out.append("/")
    if args.vararg: out.append("*" + _param(src, args.vararg, None))
    elif args.kwonlyargs: out.append("*")
    out += [_param(src, a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg: out.append("**" + _param(src, args.kwarg, None))
    return out


def _layout(head: str, ps: list[str] | None, tail: str = "", width: int = 90) -> str:
    "`head(p1, p2)tail` on one line when it fits, else one parameter per line (as black lays out a long def)."
    if ps is None: return head + tail
    one = f"{head}({', '.join(ps)}){tail}"
    if len(one) <= width or not ps: return one
    return f"{head}(\n" + "".join(f"    {p},\n" for p in ps) + f"){tail}"


def _decorators(src: str, node: ast.stmt, skip=("property", "staticmethod", "classmethod")) -> list[str]:
    "Decorator lines as written (`@triton.jit`, `@dataclass(frozen=True)`); fastcore's `@patch` is the `Cls.` prefix."
    return [f"@{_seg(src, d)}" for d in getattr(node, "decorator_list", [])
            if not _is_patch(d) and ast.unparse(d) not in skip]


def _is_property(node: ast.stmt) -> bool:
    return any(ast.unparse(d) in ("property", "patch(as_prop=True)") or ast.unparse(d).endswith(".setter")
               for d in getattr(node, "decorator_list", []))


def def_signature(src: str, node: ast.FunctionDef, name: str, method: bool, width: int = 90) -> str:
    "`def name(params) -> ret` (self/cls dropped for a method), or `property name: type`."
    ret = f" -> {_seg(src, node.returns)}" if node.returns else ""
    static = any(ast.unparse(d) == "staticmethod" for d in node.decorator_list)
    if _is_property(node): return f"property {name}{ret.replace(' ->', ':', 1)}"
    kw = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    return _layout(f"{kw} {name}", params(src, node.args, drop_first=method and not static), ret, width)


def _fields(node: ast.ClassDef) -> list[tuple[ast.AnnAssign, str]]:
    "The annotated fields of a class body, each with the string under it (the field's doc, as fastcore writes it)."
    return [
        (b, _string_after(node.body, i))
        for i, b in enumerate(node.body)
        if isinstance(b, ast.AnnAssign)
        and isinstance(b.target, ast.Name)
        and "ClassVar" not in ast.unparse(b.annotation)
    ]


def _field_param(src: str, f: ast.AnnAssign) -> str:
    if ast.unparse(f.annotation) in ("KW_ONLY", "dataclasses.KW_ONLY"): return "*"
    return f.target.id + f": {_seg(src, f.annotation)}" + (f" = {_seg(src, f.value)}" if f.value is not None else "")


def class_signature(src: str, node: ast.ClassDef) -> str:
    """`class X(<__init__ parameters>)`: from its `__init__`, or from its fields for a dataclass or NamedTuple;
    `class X(Base)` otherwise."""
    init = next((b for b in node.body if isinstance(b, ast.FunctionDef) and b.name == "__init__"), None)
    decs, bases = [ast.unparse(d) for d in node.decorator_list], [ast.unparse(b) for b in node.bases]
    if init is not None: ps = params(src, init.args, drop_first=True)
    elif any(d.split("(")[0].endswith("dataclass") for d in decs) or any(b.endswith("NamedTuple") for b in bases):
        kw_only = any(d.split("(")[0].endswith("dataclass") and "kw_only=True" in d for d in decs)
        ps = ["*"] * kw_only + [_field_param(src, f) for f, _ in _fields(node)]
    else: ps = [_seg(src, b) for b in node.bases + node.keywords] or None
    return _layout(f"class {node.name}", ps)


def var_text(src: str, node: ast.stmt, max_lines: int = 8) -> str:
    "An assignment as written (`Clip = Literal[...]`), cut after `max_lines` lines."
    lines = (ast.get_source_segment(src, node) or ast.unparse(node)).splitlines()
    return "\n".join(lines[:max_lines] + (["…"] if len(lines) > max_lines else []))


_MD = None


def markdown(text: str, inline: bool = False) -> str:
    "A docstring as Markdown (raw HTML escaped); `inline` drops the paragraph around a one-paragraph text."
    global _MD
    if _MD is None:
        import mistune
        _MD = mistune.create_markdown(escape=True, plugins=["strikethrough", "table"])
    out = _MD(text).strip()
    if inline and out.startswith("<p>") and out.endswith("</p>") and out.count("<p>") == 1: out = out[3:-4]
    return out


def highlight(code: str) -> str:
    from pygments import highlight as hl
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import PythonLexer
    return ('<div class="highlight '
            f'api-sig"><pre>{hl(code, PythonLexer(), HtmlFormatter(nowrap=True)).rstrip()}</pre></div>')


def members_html(src: str, node: ast.ClassDef) -> str:
    "The public methods and properties of a class body, each with its signature and the first paragraph of its doc."
    rows = []
    for b in node.body:
        if not isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) or (
            b.name.startswith("_") and b.name != "__call__"
        ):
            continue
        if any(ast.unparse(d).endswith((".setter", ".deleter")) for d in b.decorator_list): continue
        sig = def_signature(src, b, b.name, method=True, width=10**6).removeprefix("def ")   # one line in a list
        first = (ast.get_docstring(b) or "").split("\n\n")[0]
        rows.append(f"<li><code>{html.escape(sig)}</code> {markdown(first, inline=True)}</li>")
    return f'<ul class="api-members">{"".join(rows)}</ul>' if rows else ""


def fields_html(src: str, node: ast.ClassDef) -> str:
    "A table of the fields (name, type, default, doc) when some have a doc string under them."
    rows = _fields(node)
    if not any(doc for _, doc in rows): return ""
    cells = "".join(
        f"<tr><td><code>{html.escape(f.target.id)}</code></td><td><code>{html.escape(_seg(src, f.annotation))}"
        f"</code></td><td>{'<code>' + html.escape(_seg(src, f.value)) + '</code>' if f.value else ''}</td>"
        f"<td>{markdown(doc, inline=True)}</td></tr>"
        for f, doc in rows
    )
    return f'<table class="api-fields"><thead><tr><th>field</th><th>type</th><th>default</th><th></th></tr></thead>' \
           f"<tbody>{cells}</tbody></table>"


def entry_code(e: Entry) -> str:
    "The code an entry shows: decorators and signature, or the assignment."
    n = e.node
    if isinstance(n, ast.ClassDef): return "\n".join(_decorators(e.src, n) + [class_signature(e.src, n)])
    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return "\n".join(_decorators(e.src, n) + [def_signature(e.src, n, e.name, method="." in e.name)])
    return var_text(e.src, n)


def source_links(e: Entry, py_pages: dict[str, str], gh: str | None, cell_shown: bool = True) -> str:
    """[source] -> the notebook cell (unless the cell is hidden); `static_dist/x.py:12` -> the line in the site's copy
    of the module; GitHub -> the line there."""
    out = [f'<a class="src-cell" href="#cell-id={html.escape(e.cell_id)}" title="the notebook cell that defines it">'
           '[source]</a>'] if cell_shown else []
    if e.py and e.line:
        out.append(f'<a class="src-py" href="{py_pages[e.py]}#L{e.line}" title="the exported line (offline copy)">'
                   f"{html.escape(e.py)}:{e.line}</a>")
        if gh: out.append(f'<a class="src-gh" href="{html.escape(gh)}/{html.escape(e.py)}#L{e.line}">GitHub</a>')
    return f'<span class="api-src">{" ".join(out)}</span>'


def entry_html(e: Entry, py_pages: dict[str, str], gh: str | None, cell_shown: bool = True) -> str:
    parts = [f'<div class="api-entry jp-RenderedHTMLCommon" id="{html.escape(e.anchor)}">',
             f'<div class="api-head"><h4 class="api-name"><code>{html.escape(e.name)}</code></h4>',
             source_links(e, py_pages, gh, cell_shown), "</div>", highlight(entry_code(e))]
    if e.doc: parts.append(f'<div class="api-doc">{markdown(e.doc)}</div>')
    if isinstance(e.node, ast.ClassDef): parts += [fields_html(e.src, e.node), members_html(e.src, e.node)]
    parts.append("</div>")
    return "".join(parts)


def reexport_html(code: str, by_module: dict[str, list[Entry]]) -> str:
    "For `from static_dist.fsdp.plan import *` in an exported cell: the names it brings in, linked to their entries."
    tree, out = _parse(code), []
    for node in tree.body if tree else []:
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names) and node.module in by_module:
            es = [e for e in by_module[node.module] if "." not in e.name]
            if not es: continue
            links = ", ".join(
                f'<a href="{e.page}#{html.escape(e.anchor)}"><code>{html.escape(e.name)}</code></a>' for e in es
            )
            out.append(
                f'<p class="api-reexport">From <a href="{es[0].page}"><code>{html.escape(node.module)}</code></a>: '
                f"{links}</p>"
            )
    return "".join(out)


# ---------------------------------------------------------------- notebook -> notebook for the docs

def _raw_html(s: str, cell_id: str) -> dict:
    "A raw cell that nbconvert copies into the page as it is (the API entries)."
    return dict(cell_type="raw", id=cell_id, metadata={"raw_mimetype": "text/html"}, source=s)


def docs_notebook(nb: dict, after_cell=lambda cell: "") -> dict:
    """Drop `#| hide` cells and `#|` lines, replace widget views by snapshots, drop the live-widget metadata.
    `after_cell(cell)` gives HTML to show after a cell (its API entries), as a raw cell."""
    nb = copy.deepcopy(nb)
    state = _widget_state(nb)
    cells = []
    for k, c in enumerate(nb["cells"]):
        c["id"] = _cell_id(c, k)
        src = _src(c)
        d = _directives(src)
        extra = after_cell(c) if c["cell_type"] == "code" else ""   # a hidden cell's entries still show, as in nbdev
        if "hide" in d: pass
        elif c["cell_type"] == "code":
            c["source"] = _code(c).strip("\n")
            if "hide_input" in d or d.get("echo", "").lower() == "false": c["source"] = ""
            if "hide_output" in d or d.get("output", "").lower() == "false": c["outputs"] = []
            new_out = []
            for o in c.get("outputs", []):
                data = o.get("data", {})
                if WIDGET_MIME in data:
                    snap = widget_snapshot(data[WIDGET_MIME].get("model_id", ""), state)
                    o = dict(output_type="display_data", metadata={}, data={"text/html": snap or saved_view_html(data)})
                new_out.append(o)
            c["outputs"] = new_out
            if c["source"].strip() or c["outputs"]: cells.append(c)
        else: cells.append(c)
        if extra: cells.append(_raw_html(extra, f"{c['id']}-api"))
    nb["cells"] = cells
    nb.get("metadata", {}).pop("widgets", None)
    return nb


# ---------------------------------------------------------------- the page shell: sidebar, contents, search

# nbconvert's lab page without the scripts it loads from the network: require.js only serves live widgets (the docs
# show snapshots), MathJax (no page has math: TeX would stay as text) and mermaid (no diagrams).
TEMPLATE = """{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js -%}{%- endblock html_head_js -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
"""
_EXPORTER = None


def exporter():
    "One exporter for every page (compiling the templates per page cost a third of the build)."
    global _EXPORTER
    if _EXPORTER is None:
        import jinja2
        from nbconvert import HTMLExporter
        # The lab template runs clean_html (bleach) on each code cell's highlighted (escaped) source and on raw
        # cells, the API entries: it took half the build, and would strip the entries' headings. Markdown and
        # outputs are not sanitized either way (sanitize_html is off; SVG is embedded as an image), so this
        # leaves nothing unsanitized that was sanitized before.
        _EXPORTER = HTMLExporter(template_name="lab", template_file="docs.html.j2",
                                 extra_loaders=[jinja2.DictLoader({"docs.html.j2": TEMPLATE})],
                                 exclude_input_prompt=True, exclude_output_prompt=True,
                                 filters={"clean_html": lambda s: s})
    return _EXPORTER


_LAB_STYLES = None


def lab_styles() -> str:
    """The <style> elements the lab template puts in every page's head (its 260 kB stylesheet), read once from an
    empty page: build() writes them once as lab.css, and each page links that file instead."""
    global _LAB_STYLES
    if _LAB_STYLES is None:
        import nbformat
        head = exporter().from_notebook_node(nbformat.v4.new_notebook())[0].split("</head>", 1)[0]
        _LAB_STYLES = "".join(re.findall(r"<style[^>]*>.*?</style>\s*", head, re.S))
    return _LAB_STYLES


def lab_css() -> str:
    return re.sub(r"</?style[^>]*>", "", lab_styles())


def _title_html(title: str) -> str:
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(title))


def nav_html(groups: list[list[Page]], current: Page) -> str:
    "The sidebar: the search box, then one entry per chapter; the current page's chapter is open, the others folded."
    def link(p: Page, cls: str = "") -> str:
        attrs = (
            f' title="{html.escape(p.module.removesuffix(".__init__"))}"' if p.module else ""
        )  # the module, on hover
        classes = " ".join(c for c in (cls, "current" if p.html == current.html else "") if c)
        if classes: attrs += f' class="{classes}"'
        return f'<a href="{p.html}"{attrs}>{_title_html(p.title)}</a>'
    items = []
    for head, *stages in groups:
        if not stages: items.append(f'<div class="chapter">{link(head)}</div>'); continue
        is_open = " open" if current.html in [q.html for q in (head, *stages)] else ""
        items.append(f'<details class="chapter"{is_open}><summary>{link(head)}</summary>'
                     + "".join(link(s, "stage") for s in stages) + "</details>")
    return ('<nav class="docs-nav"><div class="docs-nav-head"><a class="site" href="index.html">static_dist</a>'
            '<input id="docs-search" type="search" placeholder="Search  ( / )" autocomplete="off" '
            'aria-label="Search pages and API"><div id="docs-search-results" role="listbox" hidden></div></div>'
            f'<div class="docs-nav-list">{"".join(items)}</div></nav>')


_HEADING = re.compile(r'<h([1-6])([^>]*?) id="([^"]+)"(.*?)</h\1>', re.S)


def unique_heading_ids(body: str) -> str:
    "Give a repeated heading id (two sections, or a report printed twice, with one title) a `-2`, `-3` suffix."
    seen: dict[str, int] = {}
    def fix(m):
        level, pre, hid, rest = m.groups()
        n = seen[hid] = seen.get(hid, 0) + 1
        if n == 1: return m.group(0)
        new = f"{hid}-{n}"
        while new in seen: n += 1; new = f"{hid}-{n}"
        seen[new] = 1
        return f'<h{level}{pre} id="{new}"' + rest.replace(f'href="#{hid}"', f'href="#{new}"') + f"</h{level}>"
    return _HEADING.sub(fix, body)


def _plain(fragment: str) -> str:
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", fragment)).split())


def markdown_headings(body: str) -> list[dict]:
    """The h2/h3 headings of the page's Markdown cells (not those inside outputs): level, id, html, text, and the
    first words of the prose under each (for search results)."""
    starts = [(m.start(), m.group(1)) for m in re.finditer(r'<div[^>]*? class="jp-Cell (jp-\w+Cell)', body)]
    out = []
    for (a, kind), (b, _) in zip(starts, starts[1:] + [(len(body), "")]):
        if kind != "jp-MarkdownCell": continue
        seg = body[a:b]
        ms = list(_HEADING.finditer(seg))
        for i, m in enumerate(ms):
            if m.group(1) not in "23": continue
            inner = re.sub(r'<a class="anchor-link".*?</a>', "", m.group(4).split(">", 1)[1], flags=re.S)
            after = seg[m.end(): ms[i + 1].start() if i + 1 < len(ms) else len(seg)]
            out.append(dict(level=int(m.group(1)), id=m.group(3), html=inner.strip(), text=_plain(inner),
                            snippet=_plain(after)[:160]))
    return out


def toc_html(headings: list[dict]) -> str:
    if not headings: return ""
    items = "".join(
        f'<li class="toc-h{h["level"]}"><a href="#{html.escape(h["id"])}">{h["html"]}</a></li>' for h in headings
    )
    return f'<aside class="docs-toc"><div class="toc-title">On this page</div><ul>{items}</ul></aside>'


def search_records(page: Page, headings: list[dict], entries: list[Entry]) -> list[dict]:
    "What the search box finds: k(ind), t(itle), u(rl), c(ontext), d(escription)."
    title = page.title.replace("`", "")
    mod = (page.module or "").removesuffix(".__init__")
    recs = [dict(k="page", t=title, u=page.html, c=mod, d=page.subtitle.replace("`", ""))]
    recs += [dict(k="section", t=h["text"], u=f'{page.html}#{h["id"]}', c=title, d=h["snippet"]) for h in headings]
    for e in entries:
        doc = e.doc.split("\n\n")[0].replace("`", "")
        recs.append(dict(k="api", t=e.name, u=f"{e.page}#{e.anchor}", c=e.module, d=" ".join(doc.split())[:160]))
    return recs


@dataclasses.dataclass
class Site:
    "What rendering a page needs to know of the others."
    groups: list[list[Page]]          # the sidebar's chapters
    links: dict[str, str]             # notebook references in prose -> page
    entries: dict[str, list[Entry]]   # page -> its API entries
    by_module: dict[str, list[Entry]]  # "static_dist.fsdp.plan" -> its entries (for an overview's re-export notes)
    py_pages: dict[str, str]          # "static_dist/fsdp/plan.py" -> "src/static_dist/fsdp/plan.py.html"
    gh: str | None                    # "https://github.com/<user>/<repo>/blob/<branch>"


def render_page(page: Page, nb: dict, site: Site) -> tuple[str, list[dict]]:
    "The page's HTML and its headings."
    return page_shell(notebook_html(page, nb, site), page, site)


def notebook_html(page: Page, nb: dict, site: Site) -> str:
    "The notebook as nbconvert renders it, API entries after their cells, links to notebooks pointing at their pages."
    import nbformat
    by_cell: dict[str, list[Entry]] = {}
    for e in site.entries[page.html]: by_cell.setdefault(e.cell_id, []).append(e)
    def after_cell(c) -> str:
        d = _directives(_src(c))
        if not ("export" in d or "exports" in d): return ""
        shown = "hide" not in d
        return reexport_html(_code(c), site.by_module) + "".join(
            entry_html(e, site.py_pages, site.gh, shown) for e in by_cell.get(c.get("id"), []))
    body, _ = exporter().from_notebook_node(nbformat.reads(json.dumps(docs_notebook(nb, after_cell)), as_version=4),
                                            resources={"metadata": {"name": page.title, "path": str(page.src.parent)}})
    body = re.sub(r"<title>.*?</title>", f"<title>{html.escape(page.title.replace('`', ''))} – static_dist</title>",
                  body, count=1, flags=re.S)
    def relink(m):
        href = m.group(2); path, _, frag = href.partition("#")
        target = site.links.get(unquote(path))
        if target is None: return m.group(0)
        return f'{m.group(1)}="{target}{"#" + frag if frag else ""}"'
    return re.sub(r'(href)="([^"#:]+\.ipynb(?:#[^"]*)?)"', relink, body)


def page_shell(body: str, page: Page, site: Site) -> tuple[str, list[dict]]:
    "Unique heading ids, the shared stylesheets, the sidebar, the contents and the script around a rendered notebook."
    body = unique_heading_ids(body)
    headings = markdown_headings(body)
    shared = lab_styles() in body   # always, unless a page's template output differs: then it keeps its own
    body = body.replace(lab_styles(), "", 1).replace(
        "</head>",
        '<link rel="icon" href="data:,">\n'
        + '<link rel="stylesheet" href="lab.css">\n' * shared
        + '<link rel="stylesheet" href="docs.css">\n</head>',
        1,
    )
    body = re.sub(
        r"(<body[^>]*>)", lambda m: m.group(1) + nav_html(site.groups, page) + toc_html(headings), body, count=1
    )
    body = body.replace("<main>", '<main class="docs-main">', 1)   # the lab template's one <main>: the page itself
    body = body.replace("</body>", '<script src="docs.js"></script></body>', 1)
    return body, headings


def link_map(pages: list[Page], root: Path) -> dict[str, str]:
    "Notebook references as written in prose (`40_fsdp.ipynb`, `nbs/40_fsdp.ipynb`, `/index.ipynb`) -> page file."
    m = {}
    for p in pages:
        for k in (p.src.name, str(p.src.relative_to(root)) if p.src.is_relative_to(root) else p.src.name,
                  "../" + p.src.name, "./" + p.src.name):
            m[k] = p.html
    return m


# ---------------------------------------------------------------- the site's copy of the exported modules

def source_page(py: str, text: str, docs_page: str, gh: str | None) -> str:
    "An exported module as plain text with a `#L<n>` anchor on each line: what the API entries' line links open."
    depth = py.count("/") + 1   # the page is src/<py>.html
    up = "../" * depth
    # split where Python counts lines (not str.splitlines, which also splits at a form feed inside a string)
    lines = "".join(f'<span class="line" id="L{i}"><a class="ln" href="#L{i}">{i}</a>{html.escape(l) or " "}</span>'
                    for i, l in enumerate(re.split(r"\r\n|\r|\n", text.removesuffix("\n")), 1))
    gh_link = f' · <a href="{html.escape(gh)}/{html.escape(py)}">GitHub</a>' if gh else ""
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(py)} – static_dist</title>'
        f'<link rel="icon" href="data:,"><link rel="stylesheet" href="{up}docs.css"></head><body class="source-page">'
        f'<header><a href="{up}{docs_page}">← docs</a> · <code>{html.escape(py)}</code>{gh_link} · '
        f'generated by nbdev from the notebook: edit the notebook, not this file</header>'
        f'<pre class="source">{lines}</pre></body></html>\n'
    )


def github_blob(root: Path) -> str | None:
    "`<git_url>/blob/<branch>` from settings.ini, the prefix of a link to a file's line on GitHub."
    ini = root / "settings.ini"
    if not ini.is_file(): return None
    cfg = configparser.ConfigParser(); cfg.read(ini, encoding="utf-8")
    d = cfg["DEFAULT"]
    return f"{d['git_url'].rstrip('/')}/blob/{d.get('branch', 'main')}" if d.get("git_url") else None


# ---------------------------------------------------------------- link checking

class _Links(HTMLParser):
    def __init__(self):
        super().__init__(); self.refs, self.ids, self.heading_ids = [], set(), []
    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"): self.ids.add(a["id"])
        if a.get("id") and re.fullmatch(r"h[1-6]", tag): self.heading_ids.append(a["id"])
        if tag == "a" and a.get("name"): self.ids.add(a["name"])
        for k in ("href", "src"):
            if a.get(k) is not None and tag in ("a", "img", "link", "script", "iframe", "source"):
                self.refs.append((tag, k, a[k]))


def check_site(out: Path) -> list[str]:
    """Problems in the built site: an internal link or image that is absolute, points to a missing file, or to a
    missing anchor; an <img> with an empty src; a script, stylesheet or image loaded from the network; a heading id
    used twice on a page."""
    pages = {p.relative_to(out).as_posix(): p for p in out.rglob("*.html")}
    parsed = {}
    for name, p in pages.items():
        lp = _Links(); lp.feed(p.read_text(encoding="utf-8")); parsed[name] = lp
    bad = []
    for name, lp in parsed.items():
        dup = sorted({i for i in lp.heading_ids if lp.heading_ids.count(i) > 1})
        if dup: bad.append(f"{name}: heading id used twice: {dup[:3]}")
        for tag, attr, ref in lp.refs:
            if tag == "img" and not ref.strip(): bad.append(f"{name}: <img> with an empty src"); continue
            u = urlsplit(ref)
            if (u.scheme in ("http", "https") or u.netloc) and tag != "a":
                bad.append(f"{name}: <{tag} {attr}={ref!r}> loads from the network (the docs must load offline)")
                continue
            if u.scheme in ("http", "https", "mailto", "data", "javascript") or u.netloc: continue
            if ref.startswith("/"):
                bad.append(f"{name}: absolute internal link {ref!r} (links must be relative)")
                continue
            target = name if not u.path else os.path.normpath(os.path.join(os.path.dirname(name), unquote(u.path)))
            if not (out / target).exists():
                bad.append(f"{name}: {tag} {attr}={ref!r} points to a missing file")
                continue
            ids = parsed[target].ids if target in parsed else set()
            if u.fragment and target in parsed and u.fragment not in ids and unquote(u.fragment) not in ids:
                bad.append(f"{name}: link {ref!r}: no anchor #{u.fragment} in {target}")
    return bad


# ---------------------------------------------------------------- main

_SITE: Site | None = None


def _set_site(site: Site):
    global _SITE
    _SITE = site


def _render(job: tuple[Page, dict]) -> tuple[str, list[dict]]:
    return render_page(*job, _SITE)


def _render_all(read: list[tuple[Page, dict]], site: Site, jobs: int):
    """Each page's (HTML, headings), in page order, rendered in `jobs` processes (pages do not depend on each other).
    Each worker gets the site once: sent with every page, its pickled AST nodes cost more than the rendering saves."""
    if jobs <= 1 or len(read) < 2:
        _set_site(site); yield from map(_render, read); return
    from concurrent.futures import ProcessPoolExecutor
    with ProcessPoolExecutor(min(jobs, len(read)), initializer=_set_site, initargs=(site,)) as pool:
        yield from pool.map(_render, read)


def write_shared_files(out: Path, site: Site, texts: dict[str, str], records: list[dict]):
    "The files every page uses: the modules' copies under src/, the stylesheets, the script, the search index."
    home = {e.py: e.page for es in site.entries.values() for e in es if e.py}
    for py, rel in site.py_pages.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(source_page(py, texts[py], home[py], site.gh), encoding="utf-8")
    for f in ("docs.css", "docs.js"): shutil.copy(STATIC / f, out / f)
    (out / "lab.css").write_text(lab_css(), encoding="utf-8")
    # a script, not JSON: pages opened from file:// may not fetch() a JSON file, but may load a script
    (out / SEARCH_INDEX).write_text(
        "window.DOCS_SEARCH = " + json.dumps(records, ensure_ascii=False, separators=(",", ":")) + ";\n",
        encoding="utf-8",
    )


def build(out: Path, nbs_dir: Path, index: Path | None, package: str = "static_dist", root: Path = ROOT,
          progress=print, jobs: int = 1) -> dict:
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
    # entries first: an overview's re-export notes link to its stages' entries, on pages not rendered yet
    texts: dict[str, str] = {}
    entries = {p.html: page_entries(p, nb, root, package, texts) for p, nb in read}
    by_module: dict[str, list[Entry]] = {}
    for es in entries.values():
        for e in es: by_module.setdefault(e.module, []).append(e)
    py_pages = {py: f"src/{py}.html" for py in sorted({e.py for es in entries.values() for e in es if e.py})}
    site = Site(chapters(pages), link_map(pages, root), entries, by_module, py_pages, github_blob(root))
    summary, records = dict(pages=[], api={}, problems=[]), []
    for (page, nb), (body, headings) in zip(read, _render_all(read, site, jobs)):
        (out / page.html).write_text(body, encoding="utf-8")
        records += search_records(page, headings, entries[page.html])
        n_img, n_api = body.count("<img "), len(entries[page.html])
        summary["pages"].append(
            dict(
                page=page.html,
                source=str(page.src.relative_to(root)) if page.src.is_relative_to(root) else str(page.src),
                title=page.title,
                images=n_img,
                api_names=n_api,
                headings=len(headings),
            )
        )
        if page.module: summary["api"][page.module] = n_api
        progress(f"  {page.html:28s} {n_img:3d} images  {n_api:3d} API entries  <- {page.src.name}")
    write_shared_files(out, site, texts, records)
    summary["problems"] = check_site(out)
    (out / "site.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "_docs")
    ap.add_argument("--nbs", type=Path, default=ROOT / "nbs")
    ap.add_argument("--index", type=Path, default=ROOT / "index.ipynb")
    ap.add_argument("--package", default="static_dist")
    ap.add_argument("-j", "--jobs", type=int, default=min(2, os.cpu_count() or 1),
                    help="pages rendered in parallel (default 2: each worker costs ~3 s of start-up)")
    ap.add_argument("--check-only", action="store_true", help="only check the links of an existing build in --out")
    a = ap.parse_args(argv)
    try:
        if a.check_only:
            if not a.out.is_dir(): raise DocsError(f"no built site in {a.out}: run python tools/build_docs.py first")
            problems = check_site(a.out)
        else:
            print(f"building docs into {a.out}")
            s = build(a.out, a.nbs, a.index, a.package, jobs=a.jobs)
            problems = s["problems"]
            print(f"{len(s['pages'])} pages, {sum(p['images'] for p in s['pages'])} images, "
                  f"{sum(s['api'].values())} API entries in {len(s['api'])} modules")
    except DocsError as e:
        print(f"build_docs: {e}", file=sys.stderr); return 2
    if problems:
        print(f"FAIL: {len(problems)} problem(s) in the site:"); [print("  " + p) for p in problems]
        return 1
    print(f"links OK; open {a.out / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
