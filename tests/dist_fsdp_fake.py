"""One process, fake process group: predicted per-rank peak vs torch's FSDPMemTracker for many world sizes and plans.

Run: python tests/dist_fsdp_fake.py OUT.json [quick]
Each case: capture the model's step once (per-rank batch), predict with `predict_memory`, then build the model on
meta, `apply_plan` (real fully_shard calls), materialise under FakeTensorMode and track two steps (steady state).
"""
import dataclasses
import json
import sys
import time

import torch

from static_dist.cost import profile_graph
from static_dist.fsdp import FSDPPlan, FSDPUnit, memtracker_fsdp_peak, predict_memory
from static_dist.graph import capture
from static_dist.zoo import get_model

SMALL = get_model("small")      # the zoo's small Llama: 4 blocks of width 256, vocabulary 1024


def tracked_peak(plan: FSDPPlan, x, y, optimizer: str) -> int:
    "FSDPMemTracker's peak for the plan, on the meta-built small Llama materialised under fake tensors."
    return memtracker_fsdp_peak(SMALL.build, plan, (x,), y, SMALL.loss, optimizer)


def cases(quick: bool):
    blocks = tuple(FSDPUnit(f"layers.{i}") for i in range(len(SMALL.build().layers)))
    root = FSDPUnit("")
    per_block = lambda W, **kw: FSDPPlan(W, (W,), (root, *blocks), forward_prefetch=0, **kw)
    rep = lambda units, **kw: tuple(dataclasses.replace(u, **kw) for u in units)
    out = []
    for W in ((8, 1024) if quick else (8, 64, 256, 1024)):
        for batch, seq in ((4, 256), (1, 16)):
            if not quick or batch == 4:
                out.append((f"per-block W={W} b={batch}x{seq}", per_block(W), batch, seq, "adamw"))
            if not quick or batch == 1:
                out.append((f"no-reshard W={W} b={batch}x{seq}", dataclasses.replace(
                    per_block(W), units=(root, *rep(blocks, reshard_after_forward=False))), batch, seq, "adamw"))
        out.append((f"reshard-int-8 W={W}", dataclasses.replace(
            per_block(W), units=(root, *rep(blocks, reshard_after_forward=8))), 1, 16, "sgd"))
        out.append((f"checkpointed W={W}", dataclasses.replace(
            per_block(W), units=(root, *rep(blocks, checkpoint="full"))), 4, 256, "adamw"))
        out.append((f"ends+prefetch2 W={W}", dataclasses.replace(
            per_block(W), units=(root, FSDPUnit("tok_embeddings"), *blocks, FSDPUnit("output")),
            forward_prefetch=2, backward_prefetch=2), 2, 64, "adamw"))
        out.append((f"whole-model W={W}", dataclasses.replace(per_block(W), units=(root,), forward_prefetch=1),
                    2, 128, "adamw"))
        out.append((f"mixed-reshard+bwd-prefetch2 W={W}", dataclasses.replace(per_block(W), units=(root, *(
            dataclasses.replace(u, reshard_after_forward=i % 2 == 0) for i, u in enumerate(blocks))),
            backward_prefetch=2), 2, 128, "adamw"))
        out.append((f"bf16-mixed W={W}", dataclasses.replace(per_block(W), param_dtype="bfloat16",
                                                             reduce_dtype="float32"), 2, 64, "adamw"))
        out.append((f"hsdp W={W}", dataclasses.replace(per_block(W), mesh_shape=(2, W // 2)), 2, 64, "adamw"))
    return out


def main(out_path: str, quick: bool):
    results, graphs = [], {}
    for name, plan, batch, seq, optimizer in cases(quick):
        (x,), y = SMALL.batch(batch, seq, seed=0)
        bf16 = plan.param_dtype == "bfloat16"
        key = (batch, seq, optimizer, bf16)
        if key not in graphs:       # mixed precision: capture in bf16, fp32 masters
            m0 = SMALL.build(dtype=torch.bfloat16 if bf16 else torch.float32)
            graphs[key] = profile_graph(capture(m0, (x,), loss_fn=SMALL.loss, targets=y, optimizer=optimizer),
                                        master_dtype="float32" if bf16 else None)
        t0 = time.perf_counter()
        pred = predict_memory(graphs[key], plan).peak_bytes
        meas = tracked_peak(plan, x, y, optimizer)
        results.append(dict(case=name, world=plan.world_size, predicted=pred, tracked=meas,
                            error=pred / meas - 1, seconds=round(time.perf_counter() - t0, 2)))
        print(f"{name:40s} predicted {pred:>12,} tracked {meas:>12,} error {pred / meas - 1:+.4f}", flush=True)
    with open(out_path, "w") as f: json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "dist_fsdp_fake.json", "quick" in sys.argv[2:])
