"""GPU check (< 3 min on one GPU): predicted reserved memory vs the CUDA caching allocator, FSDP2 under a fake group.

    python tests/gpu_reserved.py [OUT.json]

A Llama 3 8B-shaped model (width 4096, 32 heads, 8 KV heads, FFN 14336, vocabulary 128256) cut to 2 blocks, one
sequence of 2048 tokens, AdamW, per-block FSDP units, on one GPU under a fake process group of 8 and of 64 ranks: the
collectives move nothing, but FSDP2 allocates every buffer it would (shards, all-gather outputs, unsharded parameters,
reduce-scatter input and output) on its own streams. For each world size and allocator setting (expandable_segments
off and on): `torch.cuda.max_memory_reserved` and `max_memory_allocated` over the second step (after
`reset_peak_memory_stats`) vs `predict_fsdp_reserved`. The optimizer runs per tensor (`foreach=False`), as the CPU
capture runs it; `baseline_allocated` is what is allocated before the model exists (the batch, cuBLAS's workspace),
which the prediction does not count but the device does.

Target: reserved within MAX_REL_ERROR of the device's. Exit status 1 with the reasons under "failures" in the JSON when
a case misses it or anything raises; 0 otherwise. Without CUDA it says so in one line and exits 0.
"""
import json
import sys
import time

import torch

from static_dist.cost import profile_graph
from static_dist.fsdp import FSDPPlan, FSDPUnit, apply_plan, plan_mesh, predict_memory
from static_dist.fsdp.reserved import predict_fsdp_reserved
from static_dist.graph import capture
from static_dist.launch import process_group
from static_dist.step import train_step
from static_dist.zoo import Llama, LlamaConfig, get_model

MAX_REL_ERROR = 0.10
CFG = LlamaConfig(dim=4096, n_layers=2, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256, max_seq_len=2048)


def write(report: dict, out_path) -> None:
    with open(out_path, "w") as f: json.dump(report, f, indent=1)


def measure(plan: FSDPPlan, x, y, loss, expandable: bool) -> dict:
    "The device's peaks over the second of two steps of `plan` (fake group of `plan.world_size` ranks)."
    torch.cuda.memory._set_allocator_settings(f"expandable_segments:{expandable}")
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    with process_group(fake_world=plan.world_size):
        with torch.device("meta"): m = Llama(CFG)
        apply_plan(m, plan, plan_mesh(plan, "cuda"))
        m.to_empty(device="cuda")                      # only the shards are allocated
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=False)
        for step in range(2):
            if step == 1: torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
            train_step(m, opt, [((x,), y)], loss, plan=plan)
        torch.cuda.synchronize()
        out = dict(reserved=torch.cuda.max_memory_reserved(), allocated=torch.cuda.max_memory_allocated(),
                   baseline_allocated=base)
        del m, opt
    torch.cuda.empty_cache()
    return out


def main(out_path) -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device: this check needs one (the CPU tests cover the rest)"})); return 0
    results = []
    report = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, max_rel_error=MAX_REL_ERROR,
                  results=results, failures=["unfinished: stopped before every case was measured"])
    write(report, out_path)
    torch.cuda.set_device(0)
    loss = get_model("tiny").loss
    x = torch.randint(0, CFG.vocab_size, (1, 2048))
    y = torch.randint(0, CFG.vocab_size, (1, 2048))
    t0 = time.perf_counter()
    with torch.device("meta"): m0 = Llama(CFG)
    g = capture(m0, (x,), loss_fn=loss, targets=y, optimizer="adamw")
    prof = profile_graph(g)
    report["capture_seconds"] = round(time.perf_counter() - t0, 1)
    xc, yc = x.cuda(), y.cuda()
    torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda")    # cuBLAS's workspace, before the baseline
    try:
        for W in (8, 64):
            plan = FSDPPlan(W, (W,), (FSDPUnit(""), *(FSDPUnit(f"layers.{i}") for i in range(CFG.n_layers))),
                            forward_prefetch=0)
            for expandable in (False, True):
                t0 = time.perf_counter()
                pred = predict_fsdp_reserved(g, plan, profile=prof, expandable=expandable)
                dev = measure(plan, xc, yc, loss, expandable)
                results.append(dict(
                    world=W, expandable_segments=expandable, predicted_reserved=pred.peak_reserved,
                    cuda_max_reserved=dev["reserved"], rel_error=pred.peak_reserved / dev["reserved"] - 1,
                    predicted_allocated=pred.peak_allocated, cuda_max_allocated=dev["allocated"],
                    allocated_rel_error=pred.peak_allocated / dev["allocated"] - 1,
                    predict_memory_bytes=predict_memory(prof, plan).peak_bytes,
                    baseline_allocated=dev["baseline_allocated"], seconds=round(time.perf_counter() - t0, 1)))
                print(results[-1], flush=True)
                write(report, out_path)                  # after every case: a time limit keeps what ran
        report["failures"] = [f"world {r['world']} expandable {r['expandable_segments']}: predicted reserved "
                              f"{r['predicted_reserved']:,} B vs {r['cuda_max_reserved']:,} B ({r['rel_error']:+.1%})"
                              for r in results if abs(r["rel_error"]) > MAX_REL_ERROR]
    except Exception as e:
        report["failures"] = [f"error: {type(e).__name__}: {e}"]
        write(report, out_path)
        raise
    write(report, out_path)
    for f in report["failures"]: print("FAILED:", f, file=sys.stderr)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "gpu_reserved.json"))
