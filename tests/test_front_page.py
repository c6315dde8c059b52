"""The front page (index.ipynb, and the README made from it) tells the truth: every `static-dist` command it shows names
a verb and options that exist, every chapter it links exists and every chapter is linked, each chapter overview links
all of its notebooks, and the plan-then-torchrun commands it shows run exactly as written."""
import json, os, re, shlex, subprocess, sys
from pathlib import Path

import pytest

from static_dist.app.benches import BENCHES
from static_dist.app.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _subparsers(p):
    "name -> parser of each sub-command of argparse parser `p`."
    acts = [a for a in p._actions if a.__class__.__name__ == "_SubParsersAction"]
    return dict(acts[0].choices) if acts else {}


def _commands(text: str) -> list[list[str]]:
    "argv (after `static-dist`) of every static-dist command in code blocks and inline code, continuation lines joined."
    text = text.replace("\\\n", " ")
    found = re.findall(r"(?:^|[\s`(])(?:\.venv/bin/)?static-dist ([^`\n]+)", text)
    found += re.findall(r"-m static_dist\.app (?:-- )?([^`\n]+)", text)
    return [shlex.split(c.split("  #")[0]) for c in found]


def _check(argv: list[str]) -> list[str]:
    "What in `argv` the parser does not know: a verb, a sub-verb or an option; [] when all exist."
    p, words = build_parser(), list(argv)
    while words and (subs := _subparsers(p)):
        verb = words.pop(0)
        if verb not in subs: return [f"verb {verb!r} under {p.prog!r}"]
        p = subs[verb]
    if p.prog.endswith(" bench") and words:   # `bench a|b|c`: each name a registered bench
        bad = [f"bench {v}" for v in words.pop(0).split("|") if v not in BENCHES]
        if bad: return bad
    known = set(p._option_string_actions)
    return [w for w in words if w.startswith("--") and w.split("=")[0] not in known]


def test_the_checker_finds_made_up_verbs_and_options():
    assert _check(["plan", "--model", "tiny", "--world", "4"]) == []
    assert _check(["plan", "--model", "tiny", "--no-such-flag"]) == ["--no-such-flag"]
    assert _check(["plan-everything"]) == ["verb 'plan-everything' under 'static-dist'"]
    assert _check(["ops", "matrix", "softmax"]) == []
    assert _check(["bench", "plan|nothing"]) == ["bench nothing"]
    assert _commands(
        "run `static-dist plan --tp 2` then\n```sh\ntorchrun -m static_dist.app -- train \\\n  --steps 3\n```"
    ) == [["plan", "--tp", "2"], ["train", "--steps", "3"]]


def test_every_command_on_the_front_page_exists():
    cmds = _commands(README)
    verbs = {c[0] for c in cmds}
    # the headline verbs are shown, each with its arguments
    assert {"audit", "capture", "plan", "plan-fsdp", "train", "bench"} <= verbs, verbs
    wrong = {" ".join(c): bad for c in cmds if (bad := _check(c))}
    assert not wrong, f"the README names verbs or options that do not exist: {wrong}"


def _overviews() -> list[Path]:
    "The chapter overview notebooks: those that export a package's __init__."
    out = []
    for p in sorted((ROOT / "nbs").glob("*.ipynb")):
        src = "".join("".join(c["source"]) for c in json.loads(p.read_text())["cells"] if c["cell_type"] == "code")
        if re.search(r"#\|\s*default_exp\s+\S+\.__init__\b", src): out.append(p)
    return out


def test_front_page_links_every_chapter_and_nothing_missing():
    links = re.findall(r"\]\((nbs/[^)#]+)", README)
    assert links and all((ROOT / l).exists() for l in links), [l for l in links if not (ROOT / l).exists()]
    missing = [p.name for p in _overviews() if f"nbs/{p.name}" not in links]
    assert not missing, f"chapters the front page does not link: {missing}"


def test_each_overview_links_its_notebooks():
    for ov in _overviews():
        num = re.match(r"\d+", ov.name).group(0)
        text = ov.read_text()
        stages = [
            p.name for p in (ROOT / "nbs").glob(f"{num}*.ipynb") if p != ov and re.match(r"\d+", p.name)[0] == num
        ]
        missing = [s for s in stages if f"]({s}" not in text]
        assert not missing, f"{ov.name} does not link {missing}"


def _shell_block_after(marker: str) -> list[str]:
    "The commands of the first ```sh block after `marker` in the README, continuation lines joined."
    block = README[README.index(marker):].split("```sh\n", 1)[1].split("```", 1)[0]
    return [l.strip() for l in block.replace("\\\n", " ").splitlines() if l.strip()]


def test_plan_then_torchrun_run_as_written(tmp_path):
    lines = _shell_block_after("## A layout over every axis")
    assert [l.split()[0] for l in lines] == ["static-dist", "torchrun"], lines
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    bin_dir = Path(sys.executable).parent
    for line in lines:
        argv = shlex.split(line)
        exe = bin_dir / argv[0]
        argv = [str(exe)] + argv[1:] if exe.exists() else [sys.executable, "-m",
                                                            {"static-dist": "static_dist.app",
                                                             "torchrun": "torch.distributed.run"}[argv[0]]] + argv[1:]
        p = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
        assert p.returncode == 0, (line, p.stderr[-2000:])
    torchrun = shlex.split(lines[1])
    assert torchrun[torchrun.index("static_dist.app") + 1] == "--"   # torchrun would take --log for its --log-dir
    log = json.loads((tmp_path / torchrun[torchrun.index("--log") + 1]).read_text())
    assert log["world"] == 4 and len(log["peaks"]) == 4
    assert all(abs(r["predicted_bytes"] / r["peak_bytes"] - 1) < 0.03 for r in log["peaks"]), log["peaks"]


def test_front_page_plan_run_shows_a_plan():
    "The `plan` the front page runs (its saved output, in the README) found a layout and wrote it, as the text says."
    out = README[README.index("## A layout over every axis"):].split("```python\n", 1)[1].split("\n```\n\n```\n", 1)[1]
    out = out.split("```", 1)[0]
    assert "plan written to" in out and "no layout fits" not in out, out[-600:]
