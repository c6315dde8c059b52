"""Triton kernels (interpreted on CPU) on irregular shapes against torch, per-dtype tolerances; CUDA sources build with
nvcc."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")                       # before triton is imported

import shutil

import pytest
import torch

from static_dist.ops import TOLERANCES, add_relu, compile_cuda_sources, kernel_backend, rms_norm, softmax
from static_dist.triton_kernels import interpreting
from static_dist.zoo import RMSNorm

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _close(actual, expected, scale=1.0):
    atol, rtol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=atol * scale, rtol=rtol * scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,dim", [((1823, 781), -1), ((3, 1000, 7), 1), ((2, 70000), -1)])
def test_softmax_fwd_bwd(shape, dim, dtype):
    if shape == (1823, 781) and dtype != torch.float32: shape = (301, 781)     # the interpreter is slow; one big case
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 4).to(dtype)
    dy = torch.randn(shape, generator=g).to(dtype)
    xr = x.clone().requires_grad_()
    yr = torch.softmax(xr.float(), dim)                             # reference in float32, rounded once
    yr.backward(dy.float())
    with kernel_backend("triton"):
        xk = x.clone().requires_grad_()
        y = softmax(xk, dim)
        y.backward(dy)
    assert y.dtype == dtype and y.shape == x.shape
    _close(y, yr.to(dtype))
    _close(xk.grad, xr.grad.to(dtype), scale=2.0)                  # two roundings (y, then dx)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_relu(dtype):
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(1823, 781, generator=g).to(dtype), torch.randn(781, generator=g).to(dtype)
    with kernel_backend("triton"): out = add_relu(a, b)
    if dtype == torch.bfloat16: _close(out, torch.relu(a + b))      # the interpreter's bf16 cast may differ by 1 ulp
    else: torch.testing.assert_close(out, torch.relu(a + b), atol=0, rtol=0)   # one rounding, as torch does it


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_fwd_bwd(dtype):
    rows = 601 if dtype == torch.float32 else 257                  # interpreted: one program per row
    g = torch.Generator().manual_seed(2)
    norm = RMSNorm(781).to(dtype)
    with torch.no_grad(): norm.weight.copy_(torch.rand(781, generator=g) + 0.5)
    x = torch.randn(rows, 781, generator=g).to(dtype)
    dy = torch.randn(rows, 781, generator=g).to(dtype)
    xr = x.clone().requires_grad_()
    yr = norm(xr); yr.backward(dy)
    w = norm.weight.detach().clone().requires_grad_()
    with kernel_backend("triton"):
        xk = x.clone().requires_grad_()
        y = rms_norm(xk, w, norm.eps); y.backward(dy)
    _close(y, yr)
    _close(xk.grad, xr.grad, scale=2.0)
    # dweight sums `rows` products in a different order: judge both against float64 truth instead of each other
    x64, w64 = x.double().requires_grad_(), w.detach().double().requires_grad_()
    xhat = (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + norm.eps)).to(dtype).double()
    (xhat * w64).backward(dy.double())
    err_kernel = (w.grad.double() - w64.grad).abs().max().item()
    err_torch = (norm.weight.grad.double() - w64.grad).abs().max().item()
    # Triton 3.9's interpreter casts to bfloat16 by truncation (GPUs round to nearest even): allow two more ulps there
    ulp = 2.0 ** (torch.floor(torch.log2(w64.grad.abs().max())).item() - 7)
    slack = 2 * ulp if dtype == torch.bfloat16 and interpreting() else 0.0
    assert err_kernel <= 2 * err_torch + TOLERANCES[dtype][0] + slack, (err_kernel, err_torch, slack)


def test_kernel_outputs_keep_reference_layout():
    x = torch.randn(4, 9, 6).transpose(0, 2)                       # non-contiguous input
    with kernel_backend("triton"): y = softmax(x, 1)
    ref = torch.softmax(x, 1)
    assert y.stride() == ref.stride()
    torch.testing.assert_close(y, ref)


def test_backend_on_cpu_without_interpreter_is_explained(monkeypatch):
    import static_dist.triton_kernels as tk
    monkeypatch.setattr(tk, "interpreter_ready", lambda: False)
    with kernel_backend("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        softmax(torch.randn(2, 3), -1)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_sources_compile(tmp_path):
    res = compile_cuda_sources(tmp_path)
    assert res and all(rc == 0 for rc, _ in res.values()), res
    assert (tmp_path / "softmax.o").stat().st_size > 0
    # and the kernels it exports are the ones the bridge asks NVRTC for
    src = (compile_cuda_sources.__globals__["kernels_dir"]() / "softmax.cu").read_text()
    for dt in ("f32", "f16", "bf16"):
        assert f"sd_softmax_fwd_{dt}(" in src and f"sd_softmax_bwd_{dt}(" in src


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_softmax(backend, dtype):
    x = torch.randn(1823, 781, device="cuda").to(dtype)
    with kernel_backend(backend): y = softmax(x, -1)
    _close(y, torch.softmax(x.float(), -1).to(dtype))


def test_interpreter_must_precede_triton_import():
    """A process that imports triton (here via torch.compile's inductor) before setting TRITON_INTERPRET gets a clear
    skip/error."""
    import subprocess, sys
    code = (
        "import os, torch; os.environ.pop('TRITON_INTERPRET', None); import triton; "
        "from static_dist.ops import compat_matrix, kernel_backend, softmax\n"
        "rep = compat_matrix('softmax', paths=('triton_interpreter',)); print(rep.cell('triton_interpreter').status)\n"
        "try:\n    with kernel_backend('triton'): softmax(torch.randn(2, 3), -1)\nexcept RuntimeError as e: print(e)"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "skip" and "TRITON_INTERPRET=1" in lines[1]


@pytest.mark.parametrize("first", ["static_dist.ops.matrix", "static_dist.ops.bench", "static_dist.ops.register",
                                   "static_dist.passes", "static_dist.ops"])
def test_builtin_ops_register_once_whichever_module_comes_first(first):
    "Importing any submodule of static_dist.ops first registers the built-in ops once, shared by every module."
    import subprocess, sys
    code = (f"import importlib, torch; importlib.import_module({first!r})\n"
            "import static_dist.ops as ops, static_dist.ops.builtin as b, static_dist.ops.matrix as m\n"
            "assert ops.REGISTRY is m.REGISTRY and ops.softmax is b.softmax is ops.REGISTRY['static_dist::softmax']\n"
            "assert torch.ops.static_dist.softmax.default is ops.softmax.overload\n"
            "print(sorted(ops.REGISTRY))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(
        [
            'static_dist::add_relu',
            'static_dist::rms_norm',
            'static_dist::rms_norm_backward',
            'static_dist::softmax',
            'static_dist::softmax_backward',
        ]
    )


def test_bridge_once_returns_the_registered_op_and_refuses_another_declaration():
    from static_dist.ops import OpDecl, bridge, bridge_once
    from static_dist.ops.builtin import _softmax_ref
    assert bridge_once(OpDecl("static_dist::softmax", _softmax_ref)) is softmax
    with pytest.raises(ValueError, match="already bridged"): bridge_once(OpDecl("static_dist::softmax", torch.tanh))
    with pytest.raises(ValueError, match="already bridged"): bridge(OpDecl("static_dist::softmax", _softmax_ref))
