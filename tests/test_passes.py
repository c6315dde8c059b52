"Graph passes on exported programs: rewrite to bridged ops (tiny Llama logits unchanged), node profiler, safe pruning."
import os

os.environ.setdefault("TRITON_INTERPRET", "1")                       # before anything imports triton

import json

import pytest
import torch

from static_dist.passes import (GuardFailed, RewriteError, compare_programs, profile_nodes, prune_dead,
                                rewrite_ops, specialise_branches)
from static_dist.zoo import get_model


@pytest.fixture(scope="module")
def llama():
    zm = get_model("tiny")
    model = zm.build(device="cpu").eval()
    tokens, _ = zm.batch(2, 48, seed=3)
    return zm, model, tokens, torch.export.export(model, tokens)


def test_rewritten_tiny_llama_gives_the_same_logits(llama):
    zm, model, tokens, ep = llama
    new, rep = rewrite_ops(ep, tokens)
    assert rep.matches == {"add_relu": 0, "softmax": 0, "rms_norm": 2 * model.cfg.n_layers + 1}
    assert rep.verified and rep.nodes_after < rep.nodes_before
    # no RMSNorm arithmetic left: rsqrt only appeared inside the norms
    assert not any(n.target == torch.ops.aten.rsqrt.default for n in new.graph.nodes)
    for seed in (0, 1):                                             # inputs the rewrite never saw
        toks, _ = zm.batch(2, 48, seed=seed)              # export specialised the shapes
        with torch.no_grad(): ref = model(*toks)
        out = new.module()(*toks)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1.3e-6)


def test_rewritten_llama_through_triton_kernels(llama):
    "The rewritten program really calls the kernels: run it with the Triton backend (interpreted on CPU)."
    from static_dist.ops import kernel_backend
    zm, model, tokens, ep = llama
    new, _ = rewrite_ops(ep)
    toks = tokens[0]
    with kernel_backend("triton"), torch.no_grad(): out, ref = new.module()(toks), model(toks)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_rewrite_survives_save_load(llama, tmp_path):
    zm, model, tokens, ep = llama
    new, _ = rewrite_ops(ep)
    torch.export.save(new, tmp_path / "llama.pt2")
    loaded = torch.export.load(tmp_path / "llama.pt2")
    torch.testing.assert_close(loaded.module()(*tokens), new.module()(*tokens))


class _Patterns(torch.nn.Module):
    def forward(self, x, y, w):
        a = torch.relu(x + y)
        b = torch.relu(torch.add(x, y, alpha=2))                   # alpha: not add_relu
        s = torch.softmax(x, 1)
        xf = x.float()
        n = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x) * w
        n0 = (xf * torch.rsqrt(xf.pow(2).mean(0, keepdim=True) + 1e-6)).type_as(x) * w   # mean over dim 0: not rmsnorm
        return a, b, s, n, n0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patterns_and_near_misses(dtype):
    args = (torch.randn(6, 10).to(dtype), torch.randn(6, 10).to(dtype), (torch.rand(10) + 0.5).to(dtype))
    ep = torch.export.export(_Patterns(), args)
    new, rep = rewrite_ops(ep, args)
    assert rep.matches == {"add_relu": 1, "softmax": 1, "rms_norm": 1}
    outs, ref = new.module()(*args), _Patterns()(*args)
    for o, r in zip(outs, ref): torch.testing.assert_close(o, r)
    names = [n.name for n in new.graph.nodes if n.op == "output"]
    assert names                                                    # outputs renamed consistently: module() ran


def test_rewrite_bad_pattern_name():
    ep = torch.export.export(_Patterns(), (torch.randn(2, 3), torch.randn(2, 3), torch.ones(3)))
    with pytest.raises(ValueError, match="choose from"): rewrite_ops(ep, patterns=("gelu",))


def test_compare_programs_catches_a_change():
    class A(torch.nn.Module):
        def forward(self, x): return torch.relu(x)
    class B(torch.nn.Module):
        def forward(self, x): return torch.relu(x) + 1e-3
    x = torch.randn(4, 4)
    with pytest.raises(RewriteError, match="differs"): compare_programs(torch.export.export(A(), (x,)), B(), (x,))


class _Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(6, 6)
    def forward(self, x):
        dead = x.exp()                                              # unused
        h = torch.cond(x.mean() > 0, lambda x: self.l(x).relu(), lambda x: self.l(x).sigmoid(), (x,))
        return torch.cond(h.sum() > 1e6, lambda h: h * 0, lambda h: h + 1, (h,))


def test_profile_prune_specialise():
    m = _Branchy().eval()
    pos = [(torch.rand(3, 6) + 0.5,) for _ in range(4)]
    ep = torch.export.export(m, pos[0])
    prof = profile_nodes(ep, inputs_list=pos)
    assert prof.branches == {"cond": {"true": 4, "false": 0}, "cond_1": {"true": 0, "false": 4}}
    inner = [s for s in prof.nodes if s.name.startswith("cond.true.")]
    assert inner and all(s.calls == 4 for s in inner)              # the taken branch's nodes, once per run
    assert not any(s.name.startswith("cond.false.") for s in prof.nodes)
    pruned, rep = prune_dead(ep)
    assert "exp" in rep.removed
    torch.testing.assert_close(pruned(*pos[0]), m(*pos[0]))
    g = specialise_branches(ep, prof)
    assert {c for c, _, _ in g.report.specialised} == {"cond", "cond_1"}
    neg = -torch.rand(3, 6) - 0.5
    for x in (pos[1][0], neg, pos[2][0]):
        torch.testing.assert_close(g(x), m(x))
    assert (g.hits, g.fallbacks) == (2, 1)
    with pytest.raises(GuardFailed): g.specialised(neg)             # the guard, not a silent wrong answer


def test_specialise_refuses_mutating_programs():
    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__(); self.register_buffer("calls", torch.zeros(()))
        def forward(self, x):
            self.calls.add_(1)                                      # a side effect a re-run would repeat
            return torch.cond(x.sum() > 0, lambda x: x + 1, lambda x: x - 1, (x,))
    x = torch.rand(3, 4)
    ep = torch.export.export(Counting(), (x,))
    with pytest.raises(ValueError, match="mutates"):
        specialise_branches(ep, profile_nodes(ep, x))


def test_chrome_trace(tmp_path, llama):
    zm, model, tokens, ep = llama
    prof = profile_nodes(ep, *tokens, runs=2)
    tr = json.loads(prof.to_chrome_trace(tmp_path / "t.json").read_text())
    evs = tr["traceEvents"]
    assert len(evs) == len(prof.events) and all(e["ph"] == "X" and e["dur"] >= 0 for e in evs)
    lin = [s for s in prof.nodes if s.target == "aten.linear.default"]
    assert lin and all(s.calls == 2 for s in lin)                   # each node once per run


def test_passes_cli(tmp_path, capsys):
    from static_dist.app.cli import main
    assert main(["passes", "rewrite", "--seq", "16", "--trace", str(tmp_path / "t.json")]) == 0
    out = capsys.readouterr().out
    assert json.loads(out.split("wrote")[0])["matches"]["rms_norm"] == 5 and (tmp_path / "t.json").exists()
    assert main(["passes", "rewrite", "--model", "control-flow"]) == 2


def test_rewritten_tiny_moe_router_softmax():
    "The MoE's router softmax (one per block) is rewritten too; logits unchanged on a fresh batch."
    zm = get_model("tiny-moe")
    model = zm.build(device="cpu").eval()
    inputs, _ = zm.batch(2, 32)
    new, rep = rewrite_ops(torch.export.export(model, inputs), inputs)
    assert rep.matches == {"add_relu": 0, "softmax": model.cfg.n_layers, "rms_norm": 2 * model.cfg.n_layers + 1}
    fresh, _ = zm.batch(2, 32, seed=5)
    with torch.no_grad(): torch.testing.assert_close(new.module()(*fresh), model(*fresh), atol=1e-5, rtol=1.3e-6)


def test_cli_prints_one_line_for_a_refused_rewrite(monkeypatch, capsys):
    "RewriteError is a StaticDistError: `static-dist passes` prints one line and exits 2 instead of a traceback."
    import static_dist.passes as passes
    from static_dist.app.cli import main
    real = passes.compare_programs
    def off_by_a_little(a, b, inputs):                              # the rewritten program, its output moved by 1e-3
        return real(a, lambda *x: b.module()(*x) + 1e-3, inputs)
    monkeypatch.setattr(passes, "compare_programs", off_by_a_little)
    assert main(["passes", "rewrite", "--model", "mlp"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("static-dist passes: error: rewritten program differs from the original")
        and err.count("\n") == 1
    ), err
