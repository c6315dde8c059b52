"""The package's layers and seams: the library never imports the application layer, no sub-package imports another's
private names, the sub-packages import each other without a cycle, and the command line answers --help without torch."""
import ast
import pathlib
import subprocess
import sys

import static_dist

PKG = pathlib.Path(static_dist.__file__).parent
APP = ("static_dist.app", "static_dist.cli")


def _modname(path: pathlib.Path) -> str:
    "static_dist.fsdp.plan for static_dist/fsdp/plan.py; static_dist.fsdp.__init__ for a package's __init__.py."
    return ".".join(path.relative_to(PKG.parent).with_suffix("").parts)


def _sources() -> dict[str, str]:
    "{module name: source} of every file of the package but nbdev's index of names."
    return {_modname(p): p.read_text() for p in PKG.rglob("*.py") if p.name != "_modidx.py"}


def _import_froms(source: str, modname: str):
    "(absolute module, names) of every import in `source` (module level and inside functions), relative ones resolved."
    pkg = modname.split(".")[:-1]
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Import):
            for a in n.names: yield a.name, ()
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                parts = pkg[: len(pkg) - n.level + 1]
                base = ".".join([*parts, base] if base else parts)
            yield base, tuple(a.name for a in n.names)


def _imports(source: str, modname: str) -> set[str]:
    "Absolute module names a file imports, and `module.name` for each name it imports from a module."
    out = set()
    for base, names in _import_froms(source, modname):
        out |= {base} | {f"{base}.{x}" for x in names}
    # importlib.import_module("static_dist.app...") in a string is an import too
    out |= {n.value for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and n.value.startswith(APP)}
    return out


def _subpackage(mod: str) -> str:
    "The sub-package (or top-level module) of the package that owns `mod`: static_dist.fsdp for static_dist.fsdp.plan."
    return ".".join(mod.split(".")[:2])


def _private_crossings(sources: dict[str, str], packages: set[str]) -> list[str]:
    "Every `from X import _name` across sub-packages, and every private name a package's __init__ re-exports."
    bad = []
    for mod, src in sources.items():
        for base, names in _import_froms(src, mod):
            if not base.startswith("static_dist"): continue
            for x in names:
                if not x.startswith("_") or x.startswith("__") or f"{base}.{x}" in packages | set(sources): continue
                if _subpackage(base) != _subpackage(mod): bad.append(f"{mod} imports {base}.{x}")
                elif mod.endswith(".__init__") and mod.count(".") == 2: bad.append(f"{mod} re-exports {base}.{x}")
    return bad


def _graph(sources: dict[str, str]) -> dict[str, set[str]]:
    "Sub-package -> the sub-packages it imports (at module level or inside functions)."
    g: dict[str, set[str]] = {}
    for mod, src in sources.items():
        me = _subpackage(mod)
        for base, _ in _import_froms(src, mod):
            if base.startswith("static_dist.") and _subpackage(base) != me:
                g.setdefault(me, set()).add(_subpackage(base))
        g.setdefault(me, set())
    return g


def _cycle(g: dict[str, set[str]]) -> list[str] | None:
    "One import cycle of `g` as a path [a, b, ..., a], or None."
    state, stack = {}, []
    def visit(u):
        state[u] = 1; stack.append(u)
        for v in sorted(g.get(u, ())):
            if state.get(v) == 1: return stack[stack.index(v):] + [v]
            if v not in state and (c := visit(v)): return c
        state[u] = 2; stack.pop()
    for u in sorted(g):
        if u not in state and (c := visit(u)): return c
    return None


def _packages() -> set[str]:
    return {_modname(p.parent / "x")[:-2] for p in PKG.rglob("__init__.py")}


def test_library_never_imports_the_app():
    lib = {m: s for m, s in _sources().items() if not m.startswith(APP)}
    assert len(lib) > 10
    bad = {m: sorted(i for i in _imports(s, m) if i.startswith(APP)) for m, s in lib.items()}
    assert not {k: v for k, v in bad.items() if v}, bad


def test_the_check_catches_an_upward_import():
    "The test above can fail: a library file importing the app is found, relative or absolute."
    assert any(i.startswith(APP) for i in _imports("from .app.cli import main\n", "static_dist._probe"))
    src = "import importlib\nimportlib.import_module('static_dist.app.verbs')\n"
    assert any(i.startswith(APP) for i in _imports(src, "static_dist._probe"))


def test_no_private_name_crosses_a_subpackage():
    assert not _private_crossings(_sources(), _packages())


def test_the_private_check_can_fail():
    "A probe in memory: a private import from another sub-package, and a private re-export, are both found."
    probe = {"static_dist.compile.step": "def f():\n    from ..fsdp.verify import _fake_group\n",
             "static_dist.fsdp.__init__": "from .profile import _expand\nfrom .plan import FSDPPlan\n",
             "static_dist.fsdp.plan": "from .profile import _DTYPES\n"}          # inside one sub-package: allowed
    assert _private_crossings(probe, {"static_dist.fsdp", "static_dist.compile"}) == [
        "static_dist.compile.step imports static_dist.fsdp.verify._fake_group",
        "static_dist.fsdp.__init__ re-exports static_dist.fsdp.profile._expand"]


def test_subpackages_import_without_a_cycle():
    g = _graph(_sources())
    assert len(g) > 10
    assert _cycle(g) is None, " -> ".join(_cycle(g))


def test_the_cycle_check_can_fail():
    probe = {"static_dist.fsdp.apply": "def f():\n    from static_dist.compile import apply_compiled\n",
             "static_dist.compile.apply": "from ..fsdp import apply_plan\n", "static_dist.util": "import os\n"}
    assert _cycle(_graph(probe)) == ["static_dist.compile", "static_dist.fsdp", "static_dist.compile"]


def test_help_does_not_import_torch():
    from static_dist.app.cli import build_parser
    verbs = [a for a in build_parser()._actions if hasattr(a, "choices") and isinstance(a.choices, dict)][0].choices
    code = ("import sys, contextlib, io\nfrom static_dist.app.cli import main\n"
            f"for argv in [['--help']] + [[v, '--help'] for v in {sorted(verbs)!r}]:\n"
            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit): main(argv)\n"
            "print('torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.stdout.strip() == "False", p.stderr
