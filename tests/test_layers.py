"""The library never imports the application layer, and the command line answers --help without torch."""
import ast
import pathlib
import subprocess
import sys

import static_dist

PKG = pathlib.Path(static_dist.__file__).parent
APP = ("static_dist.app", "static_dist.cli")


def _imports(path: pathlib.Path) -> set[str]:
    "Absolute module names a file imports (relative imports resolved against its package)."
    tree, out = ast.parse(path.read_text()), set()
    pkg = ".".join(path.relative_to(PKG.parent).with_suffix("").parts[:-1])
    for n in ast.walk(tree):
        if isinstance(n, ast.Import): out |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - n.level + 1]
                base = ".".join([*parts, base] if base else parts)
            out |= {base} | {f"{base}.{a.name}" for a in n.names}
    # importlib.import_module("static_dist.app...") in a string is an import too
    out |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and n.value.startswith(APP)}
    return out


def test_library_never_imports_the_app():
    lib = [p for p in PKG.rglob("*.py") if "app" not in p.relative_to(PKG).parts and p.name != "_modidx.py"]   # nbdev's index of names
    assert len(lib) > 10
    bad = {str(p.relative_to(PKG)): sorted(i for i in _imports(p) if i.startswith(APP)) for p in lib}
    assert not {k: v for k, v in bad.items() if v}, bad


def test_the_check_catches_an_upward_import(tmp_path):
    "The test above can fail: a library file importing the app is found, relative or absolute."
    f = PKG / "_probe_layers.py"
    try:
        f.write_text("from .app.cli import main\n")
        assert any(i.startswith(APP) for i in _imports(f))
        f.write_text("import importlib\nimportlib.import_module('static_dist.app.verbs')\n")
        assert any(i.startswith(APP) for i in _imports(f))
    finally:
        f.unlink()


def test_help_does_not_import_torch():
    from static_dist.app.cli import build_parser
    verbs = [a for a in build_parser()._actions if hasattr(a, "choices") and isinstance(a.choices, dict)][0].choices
    code = ("import sys, contextlib, io\nfrom static_dist.app.cli import main\n"
            f"for argv in [['--help']] + [[v, '--help'] for v in {sorted(verbs)!r}]:\n"
            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit): main(argv)\n"
            "print('torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.stdout.strip() == "False", p.stderr
