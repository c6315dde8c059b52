"""Every option of every verb, fed bad values of its kind: exit status 2, one line, no traceback.

The cases are generated from the argparse tree (`static_dist.app.cli.build_parser`), so a verb or option added later is
covered without touching this file. Value checks that happen in argparse run in-process (fast); a few checks that need
the verb's handler (output paths, inputs that must differ from outputs) run the handler too, still in-process, and two
run as a user would, in a subprocess.
"""
import argparse
import contextlib
import io
import subprocess
import sys

import pytest

from static_dist.app.cli import build_parser, main

BAD = {
    "count": ["0", "-1", "99999999999999999999", "1.5", "inf", "nan", "abc", ""],
    "number": ["0", "-1", "inf", "-inf", "nan", "abc", "1e999"],
    "size": ["-1", "inf", "nan", "1e99GiB", "12 apples", "GiB", ""],
    "mesh": ["axb", "0x4", "-2x4", "", "x", "1000000x1000000"],
    "infile": ["/nonexistent/file.json", "/", "/dev/zero", "", "x" * 300],
    "outfile": [""],
    "outdir": ["/etc/hostname", "", "x" * 300],
    "prefix": ["", "/", "/tmp/", "x" * 300 + "/", "x" * 300, "d/" + "x" * 300],
    "routing": ["", "imbalance", "imbalance=0.5", "imbalance=inf", "capacity=0", "capacity=nan", "balanced=2", "top2"],
}


def _verbs(parser, prefix=()):
    "(argv prefix, subparser) for every leaf verb, nested subcommands included."
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield prefix, parser
        return
    for name, sp in subs[0].choices.items():
        yield from _verbs(sp, (*prefix, name))


def _required(sp):
    "A minimal valid argv tail for the verb's required options and positionals (values that parse)."
    out, pos = [], []
    for a in sp._actions:
        kind = getattr(a.type, "kind", None)
        good = {"infile": __file__, "outfile": "/tmp/x.out", "outdir": "/tmp", "count": "1", "size": "1", "mesh": "1",
                "prefix": "/nonexistent-static-dist/k"}.get(kind, "x")
        if not a.option_strings and a.dest not in ("help",) and a.nargs is None: pos.append(good)
        elif a.required: out += [a.option_strings[-1], good]
    return pos + out


def _cases():
    for prefix, sp in _verbs(build_parser()):
        base = _required(sp)
        for a in sp._actions:
            kind = getattr(a.type, "kind", None)
            if kind in BAD:
                for v in BAD[kind]:
                    if a.option_strings:
                        yield pytest.param(
                            [*prefix, *base, a.option_strings[-1], v],
                            id=f"{' '.join(prefix)} {a.option_strings[-1]}={v!r}",
                        )
            elif a.choices and a.option_strings and not isinstance(a, argparse._SubParsersAction):
                yield pytest.param(
                    [*prefix, *base, a.option_strings[-1], "nosuch"],
                    id=f"{' '.join(prefix)} {a.option_strings[-1]}=nosuch",
                )


def run_main(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try: code = main(argv)
        except SystemExit as e: code = e.code
    return code, err.getvalue()


@pytest.mark.parametrize("argv", list(_cases()))
def test_bad_value_is_one_line_exit_2(argv):
    code, err = run_main(argv)
    assert code == 2, (argv, code, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_cases_cover_every_verb():
    "The generator reaches every verb and the options of each kind the issue lists."
    ids = [c.id for c in _cases()]
    verbs = {" ".join(p) for p, _ in _verbs(build_parser())}
    assert len(verbs) >= 14, verbs
    for opt in ("plan-fsdp --mesh", "plan-fsdp --world", "plan-offload --min-bytes", "plan-offload --host-limit",
                "stability --lr", "check-export --opset", "capture --batch", "passes rewrite --seq", "sign --key"):
        assert any(i.startswith(opt + "=") for i in ids), opt


OUTPUT_CASES = [
    ["capture", "--model", "mlp", "--save", "/nonexistent/dir/g.json"],
    ["plan-fsdp", "--model", "mlp", "--out", "/nonexistent/p.json"],
    ["plan-offload", "--model", "mlp", "--save", "/"],
    ["stability", "--plot", "/tmp"],
    ["keygen", "--out", "/nonexistent/k"],
    ["sign", __file__, "--key", __file__, "--out", __file__],          # output = an input
]


@pytest.mark.parametrize("argv", OUTPUT_CASES, ids=[" ".join(a[:1] + a[-2:]) for a in OUTPUT_CASES])
def test_unwritable_or_input_output_refused_before_work(argv):
    code, err = run_main(argv)
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_existing_output_needs_force(tmp_path):
    out = tmp_path / "g.json"
    out.write_text("keep me")
    code, err = run_main(["capture", "--model", "mlp", "--save", str(out)])
    assert code == 2 and "--force" in err and out.read_text() == "keep me"
    code, err = run_main(["capture", "--model", "mlp", "--save", str(out), "--force"])
    assert code == 0, err
    assert out.read_text().startswith("{")


def test_meta_without_value_refused(tmp_path):
    code, err = run_main(["sign", __file__, "--key", __file__, "--out", str(tmp_path / "a.sdxa"), "--meta", "novalue"])
    assert code == 2 and "Traceback" not in err


@pytest.mark.parametrize("argv,words", [
    (["plan-fsdp", "--mesh", "axb"], "axb"),
    (["capture", "--model", "nosuch_model"], "nosuch_model"),
])
def test_as_a_user_runs_it(argv, words):
    p = subprocess.run([sys.executable, "-m", "static_dist.app", *argv], capture_output=True, text=True)
    assert p.returncode == 2 and words in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
