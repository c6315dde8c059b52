"""GPU checks for static_dist.ops, in one run (< 3 min on one GPU): kernel correctness on irregular and wide shapes
(Triton and CUDA C++, fwd + bwd, fp32/fp16/bf16), the compatibility matrix on CUDA, and `static-dist bench kernels`.

    python tests/gpu_ops.py            # writes $OUT/gpu_ops.json (or ./gpu_ops.json) and prints a summary
"""
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))       # run from a checkout without installing

T0 = time.perf_counter()
OUT = Path(os.environ.get("OUT", ".")) / "gpu_ops.json"


def section(name, fn, report):
    t = time.perf_counter()
    try: report[name] = fn()
    except Exception as e:
        report[name] = dict(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
    print(f"[{time.perf_counter() - T0:6.1f}s] {name}: {time.perf_counter() - t:.1f}s", flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(report, indent=2, default=str))      # after every section: a time limit keeps what ran


def correctness():
    from static_dist.ops import TOLERANCES, add_relu, kernel_backend, rms_norm, softmax
    rows = []
    def check(op, backend, shape, dtype, dim, fn_ref, fn):
        g = torch.Generator(device="cuda").manual_seed(0)
        x = (torch.randn(shape, device="cuda", generator=g) * 3).to(dtype)
        dy = torch.randn(shape, device="cuda", generator=g).to(dtype)
        xr = x.clone().float().requires_grad_(); yr = fn_ref(xr); yr.backward(dy.float())
        row = dict(op=op, backend=backend, shape=list(shape), dtype=str(dtype), dim=dim)
        try:
            with kernel_backend(backend):
                xk = x.clone().requires_grad_(); y = fn(xk); y.backward(dy)
            torch.cuda.synchronize()
            atol, rtol = TOLERANCES[dtype]
            row["fwd_max_abs"] = (y.float() - yr).abs().max().item()
            row["bwd_max_abs"] = (xk.grad.float() - xr.grad).abs().max().item()
            torch.testing.assert_close(y, yr.to(dtype), atol=atol, rtol=rtol)
            torch.testing.assert_close(xk.grad, xr.grad.to(dtype), atol=2 * atol, rtol=2 * rtol)
            row["ok"] = True
        except Exception as e:
            row["ok"], row["error"] = False, f"{type(e).__name__}: {str(e)[:400]}"
        rows.append(row)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for shape, dim in (((1823, 781), -1), ((4096, 4096), -1), ((64, 100_000), -1), ((3, 1000, 7), 1), ((8, 1), -1)):
            for backend in ("triton", "cuda"):
                check("softmax", backend, shape, dtype, dim, lambda t: torch.softmax(t, dim), lambda t: softmax(t, dim))
        b = torch.randn(781, device="cuda").to(dtype)
        check(
            "add_relu", "triton", (1823, 781), dtype, -1, lambda t: torch.relu(t + b.float()), lambda t: add_relu(t, b)
        )
        for nrows, n in ((1823, 781), (2048, 8192)):
            w = (torch.rand(n, device="cuda") + 0.5).to(dtype)
            def rn_ref(t, w=w):                                    # the zoo's RMSNorm formula, float32 inside
                tf = t.float()
                return (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype).float() * w.float()
            check("rms_norm", "triton", (nrows, n), dtype, -1, rn_ref, lambda t, w=w: rms_norm(t, w, 1e-5))
    return dict(passed=sum(r["ok"] for r in rows), failed=[r for r in rows if not r["ok"]], rows=rows)


def matrices():
    from static_dist.ops import KERNEL_OPS, compat_matrix
    out = {}
    for op in KERNEL_OPS:
        rep = compat_matrix(op, device="cuda", skip=("triton_interpreter",))
        out[op.short_name] = dict(ok=rep.ok, statuses=rep.statuses(), markdown=rep.to_markdown(),
                                  errors={c.path: c.error for c in rep.cells if c.status == "fail"})
    return out


def bench():
    from static_dist.ops import bench_kernels
    return bench_kernels(progress=lambda m: print("   ", m, flush=True))


def main():
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to do here (the CPU tests cover the rest)"); return 2
    from static_dist.util import environment
    report = dict(script="tests/gpu_ops.py", environment=environment(), triton=__import__("triton").__version__)
    section("correctness", correctness, report)
    section("bench_kernels", bench, report)                # the targets before the (compile-heavy) matrices
    section("compat_matrix_cuda", matrices, report)
    report["seconds"] = round(time.perf_counter() - T0, 1)
    OUT.write_text(json.dumps(report, indent=2, default=str))
    c = report["correctness"]
    print("correctness:", c.get("error") or f"{c['passed']} passed, {len(c['failed'])} failed")
    for f in c.get("failed", []): print("   FAIL", f)
    for name, m in report["compat_matrix_cuda"].items() if "error" not in report["compat_matrix_cuda"] else []:
        print(
            f"matrix {name}: ok={m['ok']}", {k: v for k, v in m["statuses"].items() if v != "pass"}, m["errors"] or ""
        )
    b = report["bench_kernels"]
    if "error" in b: print("bench error:", b["error"])
    else:
        print(f"copy bandwidth {b['copy_bandwidth_GBps']} GB/s")
        for r in b["results"]:
            print(
                f"  {r['op']:9} {r['pass_']} {str(r['shape']):16} {r['dtype']:9} triton {r.get('triton_frac_copy')} of "
                "copy, "
                f"x{r.get('triton_speedup_vs_eager')} vs eager, x{r.get('triton_speedup_vs_compile')} vs compile"
                + (f", cuda {r.get('cuda_frac_copy')}" if "cuda_us" in r else "")
            )
    print(f"wrote {OUT} in {report['seconds']} s")
    return 0 if "error" not in c and not c["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
