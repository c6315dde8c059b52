"""No verb writes over one of its own inputs: an output path that is the same file as the model's source file, a plan or
a topology is refused before any work, in one line, and the input is left as it was (`--force` or not)."""
import argparse
import pytest

from static_dist.app.cli import build_parser
from static_dist.topology import preset
from test_cli_inputs import _verbs, run_main

MODEL = """import torch.nn as nn

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ff = nn.Linear(16, 16)

    def forward(self, x): return x + self.ff(x)

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(16, 64)

    def forward(self, tokens):
        x = self.emb(tokens)
        for b in self.layers: x = b(x)
        return self.out(x)
"""


def _model_verbs_outputs():
    "(verb, output option) for every verb that takes --model and writes a file."
    for prefix, sp in _verbs(build_parser()):
        opts = {a.option_strings[-1]: a for a in sp._actions if a.option_strings}
        if "--model" not in opts: continue
        for name, a in opts.items():
            if getattr(a.type, "kind", None) == "outfile":
                yield pytest.param(prefix, name, id=f"{' '.join(prefix)} {name}")


def test_cases_reach_the_verbs_the_issue_names():
    ids = {p.id for p in _model_verbs_outputs()}
    for case in ("plan --out", "capture --save", "plan-fsdp --out", "train --log", "plan-offload --save"):
        assert case in ids, ids


@pytest.mark.parametrize("prefix,opt", list(_model_verbs_outputs()))
def test_output_over_the_model_file_refused(tmp_path, prefix, opt):
    m = tmp_path / "m.py"
    m.write_text(MODEL)
    code, err = run_main([*prefix, "--model", f"{m}:M", opt, str(m), "--force"])
    assert code == 2 and "the output is the same file as input" in err and len(err.strip().splitlines()) == 1, err
    assert m.read_text() == MODEL


def test_output_over_the_topology_refused(tmp_path):
    t = tmp_path / "t.json"
    preset("dgx-h100").save(t)
    before = t.read_text()
    code, err = run_main(["plan", "--model", "mlp", "--world", "8", "--topology", str(t), "--out", str(t), "--force"])
    assert code == 2 and "the output is the same file as input" in err, err
    assert t.read_text() == before


def test_output_over_the_plan_refused(tmp_path):
    code, err = run_main(["capture", "--model", "mlp", "--save", str(tmp_path / "g.json")])
    assert code == 0, err
    p = tmp_path / "p.json"
    code, err = run_main(["plan-fsdp", "--model", "mlp", "--world", "2", "--out", str(p)])
    assert code == 0, err
    before = p.read_text()
    code, err = run_main(["plan-fsdp", "--model", "mlp", "--plan", str(p), "--out", str(p), "--force"])
    assert code == 2 and "the output is the same file as input" in err and p.read_text() == before, err
