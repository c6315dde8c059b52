"""GPU check (run by the lead on a CUDA machine, < 3 min): predicted peak vs the CUDA caching allocator.

    python tests/gpu_fsdp.py [OUT.json]

One process, NCCL with world size 1 (FSDP2 still all-gathers into separate unsharded buffers and reduce-scatters),
a Llama of width 1024 and 8 blocks, AdamW. For each plan: `torch.cuda.max_memory_allocated` during the second step
(steady state) vs `predict_memory(...).peak_bytes`. The allocator's number includes what tensor-level models cannot see (cuBLAS
workspaces, rounding to 512 B blocks, fragmentation); the JSON records both so the gap can be read, not hidden.
"""
import dataclasses
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from static_dist.fsdp import FSDPPlan, FSDPUnit, apply_plan, predict_memory, profile_graph
from static_dist.graph import capture
from static_dist.zoo import Llama, LlamaConfig, get_model


def main(out_path):
    assert torch.cuda.is_available(), "needs a CUDA device"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    cfg = LlamaConfig(dim=1024, n_layers=8, n_heads=16, n_kv_heads=8, ffn_dim=2816, vocab_size=8192, max_seq_len=1024)
    zm = get_model("tiny")
    x = torch.randint(0, cfg.vocab_size, (4, 1024), device="cuda")
    y = torch.randint(0, cfg.vocab_size, (4, 1024), device="cuda")
    with torch.device("meta"): m0 = Llama(cfg)
    prof = profile_graph(capture(m0, (x.cpu(),), loss_fn=zm.loss, targets=y.cpu(), optimizer="adamw"))
    blocks = tuple(FSDPUnit(f"layers.{i}") for i in range(cfg.n_layers))
    plans = {"per-block": FSDPPlan(1, (1,), (FSDPUnit(""), *blocks), forward_prefetch=0),
             "checkpointed": FSDPPlan(1, (1,), (FSDPUnit(""), *(dataclasses.replace(b, activation_checkpointing=True)
                                                               for b in blocks)), forward_prefetch=1),
             "whole-model": FSDPPlan(1, (1,), (FSDPUnit(""),))}
    results = []
    for name, plan in plans.items():
        t0 = time.perf_counter()
        torch.cuda.empty_cache()
        with torch.device("cuda"): m = Llama(cfg)
        apply_plan(m, plan)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        for step in range(2):
            if step == 1:
                torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
            zm.loss(m(x), y).backward(); opt.step(); opt.zero_grad()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        pred = predict_memory(prof, plan).peak_bytes
        results.append(dict(plan=name, predicted=pred, cuda_max_allocated=peak, rel_error=pred / peak - 1,
                            seconds=round(time.perf_counter() - t0, 2)))
        print(results[-1], flush=True)
        del m, opt
    json.dump(dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, results=results),
              open(out_path, "w"), indent=1)
    dist.barrier(); dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gpu_fsdp.json")
