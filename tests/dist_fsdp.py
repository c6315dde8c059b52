"""Ranks' code (launched by tests/test_fsdp.py with `static_dist.launch.launch("tests/dist_fsdp.py:main", N)`): apply
FSDP plans to the tiny Llama on gloo and check them against a single-process run.
For each plan: parameters after STEPS SGD steps vs a single-process model trained on the same global batch,
collectives per step (CommDebugMode) vs `predict_comms`, and (first plan) tracked peak vs `predict_memory`.
"""
import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from static_dist.cost import comm_counts, profile_graph
from static_dist.fsdp import FSDPPlan, FSDPUnit, apply_plan, plan_fsdp, predict_comms, predict_memory
from static_dist.step import make_optimizer, train_step
from static_dist.graph import capture
from static_dist.graph.policies import FullCheckpoint
from static_dist.zoo import get_model

STEPS, B, S, LR = 3, 2, 32, 0.5


def batches(step, rank, world, k):
    "Micro-batches of this rank for `step` (seeded so the reference can rebuild the global batch)."
    zm = get_model("tiny")
    return [zm.batch(B, S, seed=1000 * step + 10 * (world * i + rank) + 1) for i in range(k)]


def reference(world, k):
    "Single process, global batch = every rank's micro-batches; loss = mean over all of them."
    zm = get_model("tiny")
    m = zm.build(device="cpu", seed=0)
    opt = make_optimizer("sgd", m.parameters(), lr=LR)
    for step in range(STEPS):                        # the one step over every rank's micro-batches: their mean loss
        train_step(m, opt, [mb for r in range(world) for mb in batches(step, r, world, k)], zm.loss)
    return {n: p.detach() for n, p in m.named_parameters()}


def run_plan(plan, profile, rank, world, track_memory=False):
    zm = get_model("tiny")
    m = zm.build(device="cpu", seed=0)
    names = ("replicate", "shard")[-len(plan.mesh_shape):]
    mesh = init_device_mesh("cpu", plan.mesh_shape, mesh_dim_names=names)
    apply_plan(m, plan, mesh)
    opt = make_optimizer("sgd", m.parameters(), lr=LR)
    k = plan.accumulation_steps
    counts, peak = [], None
    for step in range(STEPS):
        mbs = batches(step, rank, world, k)
        if track_memory and step == STEPS - 1:
            from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
            fmt = FSDPMemTracker(m, opt)
            fmt.track_inputs(tuple(t for (x,), y in mbs for t in (x, y)))
            with fmt: train_step(m, opt, mbs, zm.loss, plan=plan)
            peak = int(sum(d["Total"] for d in fmt.get_tracker_snapshot("peak").values()))
            continue
        modes = []
        def around():
            modes.append(CommDebugMode())
            return modes[-1]
        train_step(m, opt, mbs, zm.loss, plan=plan, around=around)
        per = [comm_counts(c) for c in modes]
        counts.append({key: sum(c[key] for c in per) for key in per[0]})
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in m.named_parameters()}
    return full, counts, peak


def main() -> dict:
    "Every plan on this rank of the running group, against the single process; the results (rank 0's are returned)."
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    zm = get_model("tiny")
    x, y = zm.batch(B, S, seed=1)
    g = capture(zm.build(device="meta"), x, loss_fn=zm.loss, targets=y, optimizer="sgd")
    prof = profile_graph(g)
    planned = plan_fsdp(prof, world_size=world, budget=2**30, param_dtype=None, reduce_dtype=None).plan
    blocks = tuple(FSDPUnit(f"layers.{i}") for i in range(2))
    base = FSDPPlan(world, (world,), (FSDPUnit(""), *blocks), forward_prefetch=0)
    plans = {
        "planned": planned,
        "per-block": base,
        "no-reshard+prefetch2": dataclasses.replace(
            base,
            units=(FSDPUnit(""), *(dataclasses.replace(u, reshard_after_forward=False) for u in blocks)),
            forward_prefetch=2,
        ),
        "checkpointed+ends": dataclasses.replace(
            base,
            units=(
                FSDPUnit(""),
                FSDPUnit("tok_embeddings"),
                *(dataclasses.replace(u, checkpoint=FullCheckpoint()) for u in blocks),
                FSDPUnit("output"),
            ),
            forward_prefetch=1,
        ),
        "accumulate-4-nosync": dataclasses.replace(base, accumulation_steps=4),
        "accumulate-3-sync-every": dataclasses.replace(base, accumulation_steps=3, sync_every_microbatch=True),
    }
    if world >= 4:
        plans["reshard-int-2"] = dataclasses.replace(
            base, units=(FSDPUnit(""), *(dataclasses.replace(u, reshard_after_forward=2) for u in blocks))
        )
        plans["hsdp-2x2"] = dataclasses.replace(base, mesh_shape=(2, world // 2))
    results = {}
    for name, plan in plans.items():
        if rank == 0: print("PLAN", name, flush=True)
        ref = reference(world, plan.accumulation_steps)
        full, counts, peak = run_plan(plan, prof, rank, world, track_memory=name == "per-block")
        err = max(float((full[n] - ref[n]).abs().max()) for n in ref)
        res = dict(max_param_error=err, counts_per_step=counts, predicted_counts=predict_comms(prof, plan))
        if peak is not None:
            res.update(tracked_peak=peak, predicted_peak=predict_memory(prof, plan).peak_bytes)
        results[name] = res
    return dict(world=world, results=results)
