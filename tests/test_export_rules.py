"""The ONNX/TorchScript rule table against reality: for each rule, a model where onnxruntime (or TorchScript, or
torch.export itself) really shows the problem, the report naming it with the right source line, and the fix
removing it. References are independent of check_export: eager torch and onnxruntime called directly."""
import inspect
import warnings

import pytest
import torch
import onnxruntime  # noqa: F401  (dev dependencies: missing them must fail, not skip)
import onnxscript  # noqa: F401
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from static_dist.export import (  # noqa: E402
    MatmulResize, RULES, apply_rewrite, check_export, onnx_export, ort_run, ort_session, quiet)


def line_of(cls, pattern: str) -> str:
    """'file.py:N' of the first line of cls.forward containing `pattern` (an independent way to get the line)."""
    lines, first = inspect.getsourcelines(cls.forward)
    i = next(i for i, l in enumerate(lines) if pattern in l)
    return f"{inspect.getsourcefile(cls.forward).rsplit('/', 1)[-1]}:{first + i}"


# --- where with a uint8 mask --------------------------------------------------------------------------------------
class WhereU8(nn.Module):
    def forward(self, x, m):
        return torch.where(m, x, 0.0) * 2


class WhereFixed(nn.Module):
    def forward(self, x, m):
        return torch.where(m.bool(), x, 0.0) * 2


def test_where_bool_condition():
    x = torch.randn(4, 5)
    m = (x > 0).to(torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = WhereU8()(x, m)  # eager accepts it...
    with quiet(), pytest.raises(RuntimeError, match="expected predicate to be bool"):
        torch.export.export(WhereU8(), (x, m), strict=False)  # ...export does not
    rep = check_export(WhereU8(), (x, m), targets=["onnx"])
    assert [f.source for f in rep.by_rule("where-bool-condition")] == [line_of(WhereU8, "torch.where")]
    assert not rep.ok
    fixed = check_export(WhereFixed(), (x, m), targets=["onnx"])
    assert fixed.ok and not fixed.findings
    got = ort_run(ort_session(onnx_export(WhereFixed(), (x, m))), (x, m))[0]
    assert torch.equal(got, eager)


# --- interpolate antialias with a fractional scale ----------------------------------------------------------------
class Downscale(nn.Module):
    def forward(self, x):
        return F.interpolate(x, scale_factor=0.4, mode="bicubic", antialias=True)


def test_resize_antialias_drift_and_fix():
    x = torch.randn(2, 3, 19, 14)  # 19×0.4 and 14×0.4 are fractional
    eager = Downscale()(x)
    drift = (ort_run(ort_session(onnx_export(Downscale(), (x,))), (x,))[0] - eager).abs().max().item()
    assert drift > 0.05, drift  # the problem is real
    rep = check_export(Downscale(), (x,), targets=["onnx"])
    f = rep.by_rule("resize-antialias")
    assert [x.severity for x in f] == ["error"] and f[0].source == line_of(Downscale, "interpolate")
    assert any(n.target == "onnx" and not n.ok for n in rep.numerics)  # the report measured it too
    fix = MatmulResize((19, 14), mode="bicubic", antialias=True, scale_factor=0.4)
    assert (fix(x) - eager).abs().max().item() < 1e-5
    assert (ort_run(ort_session(onnx_export(fix, (x,))), (x,))[0] - eager).abs().max().item() < 1e-5
    assert check_export(fix, (x,), targets=["onnx"]).ok


def test_resize_antialias_integral_is_info_and_matches():
    class Half(nn.Module):
        def forward(self, x):
            return F.interpolate(x, scale_factor=0.5, mode="bilinear", antialias=True)

    x = torch.randn(1, 2, 16, 12)
    rep = check_export(Half(), (x,), targets=["onnx"])
    assert [f.severity for f in rep.by_rule("resize-antialias")] == ["info"]
    assert rep.ok
    assert (ort_run(ort_session(onnx_export(Half(), (x,))), (x,))[0] - Half()(x)).abs().max().item() < 1e-5


# --- custom op without an ONNX translation ------------------------------------------------------------------------
@torch.library.custom_op("sd_test_rules::cube", mutates_args=())
def cube(x: torch.Tensor) -> torch.Tensor:
    return x * x * x


@cube.register_fake
def _(x):
    return torch.empty_like(x)


class UsesCube(nn.Module):
    def forward(self, x):
        return cube(x) + 1


def test_custom_op_translation():
    from onnxscript import opset18 as op

    def cube_onnx(x):
        return op.Mul(op.Mul(x, x), x)

    x = torch.randn(7)
    with pytest.raises(Exception, match="No ONNX function found"):
        onnx_export(UsesCube(), (x,))
    rep = check_export(UsesCube(), (x,), targets=["onnx"])
    assert [f.source for f in rep.by_rule("custom-op-no-onnx")] == [line_of(UsesCube, "cube(x)")]
    assert rep.stage("onnx").status == "fail"
    table = {torch.ops.sd_test_rules.cube.default: cube_onnx}
    fixed = check_export(UsesCube(), (x,), targets=["onnx"], custom_translation_table=table)
    assert fixed.ok, fixed.to_markdown()
    assert torch.allclose(ort_run(ort_session(onnx_export(UsesCube(), (x,), custom_translation_table=table)), (x,))[0],
                          x ** 3 + 1, atol=1e-5)


# --- bfloat16 on onnxruntime CPU ----------------------------------------------------------------------------------
class BF16MM(nn.Module):
    def forward(self, x):
        return x @ x.T


def test_bf16_no_ort_cpu_kernel():
    x = torch.randn(4, 4).bfloat16()
    with pytest.raises(Exception, match="NOT_IMPLEMENTED"):
        ort_session(onnx_export(BF16MM(), (x,)))
    rep = check_export(BF16MM(), (x,), targets=["onnx"])
    assert [f.source for f in rep.by_rule("bf16-no-ort-cpu-kernel")] == [line_of(BF16MM, "x @ x.T")]
    assert rep.stage("onnx").status == "fail"
    assert check_export(BF16MM(), (x.float(),), targets=["onnx"]).ok


# --- data-dependent branch and trace-frozen values ----------------------------------------------------------------
class Branch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x):
        h = torch.tanh(x)
        if h.mean() > 0:
            return self.a(h)
        return self.b(h) * 3


def test_data_dependent_branch_and_checked_rewrite():
    m = Branch().eval()
    x = torch.rand(3, 6) + 0.5  # takes the `a` branch
    rep = check_export(m, (x,), targets=["onnx", "torchscript"], flags={})
    f = rep.by_rule("data-dependent-branch")
    assert f and {x.source for x in f} == {line_of(Branch, "if h.mean()")}
    assert [s.status for s in rep.stages[:3]] == ["fail", "fail", "warn"]  # strict, non-strict, draft fallback
    assert rep.by_rule("trace-frozen-value")[0].source == line_of(Branch, "if h.mean()")
    # the traced module really freezes the branch: independent check with torch.jit.trace
    with quiet():
        traced = torch.jit.trace(m, (x,), check_trace=False)
    neg = -x
    assert not torch.allclose(traced(neg), m(neg))
    rewrite = rep.guards["breaks"][0]["rewrite"]
    assert "torch.cond(" in rewrite
    fixed = apply_rewrite(m, rewrite)
    for inp in (x, neg):
        assert torch.allclose(fixed(inp), m(inp))
    frep = check_export(fixed, (x,), targets=["onnx"])
    assert frep.ok, frep.to_markdown()
    sess = ort_session(onnx_export(torch.export.export(fixed, (x,)), (x,)))
    for inp in (x, neg):  # ONNX If node: both branches match eager
        assert torch.allclose(ort_run(sess, (inp,))[0], m(inp), atol=1e-5)


class SplitLens(nn.Module):
    def forward(self, x, lens):
        return torch.split(x, lens.tolist(), dim=1)[0] * 2


def test_split_dynamic_sizes_onnx_ok_trace_frozen():
    x = torch.randn(2, 6)
    rep = check_export(SplitLens(), (x, torch.tensor([2, 4])), targets=["onnx", "torchscript"])
    src = line_of(SplitLens, "torch.split")
    assert {f.source for f in rep.by_rule("split-dynamic-sizes")} == {src}
    assert {f.source for f in rep.by_rule("trace-frozen-value")} == {src}
    sess = ort_session(onnx_export(SplitLens(), (x, torch.tensor([2, 4]))))
    with quiet():
        traced = torch.jit.trace(SplitLens(), (x, torch.tensor([2, 4])), check_trace=False)
    for lens in ([2, 4], [3, 3], [5, 1]):
        t = torch.tensor(lens)
        assert torch.allclose(ort_run(sess, (x, t))[0], SplitLens()(x, t))
    assert traced(x, torch.tensor([3, 3])).shape != SplitLens()(x, torch.tensor([3, 3])).shape


def test_every_rule_has_checked_evidence():
    for r in RULES.values():
        assert r.fix and r.what and r.evidence and r.severity in ("error", "warning", "info")
