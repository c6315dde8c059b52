"""Train the tiny Llama with a planned FSDP2 configuration.

    python -m torch.distributed.run --standalone --nproc_per_node 2 examples/train_fsdp.py --steps 20

Rank 0 plans (from a capture on fake tensors), every rank applies the same plan with `apply_plan`, and the loop
uses `train_step` (gradient accumulation with `set_requires_gradient_sync`). Works on CPU (gloo) and GPU (nccl).
"""
import argparse

import torch
import torch.distributed as dist

from static_dist.fsdp import (FSDPPlan, apply_plan, parse_bytes, plan_fsdp, predict_memory, profile_graph,
                              train_step)
from static_dist.graph import capture, fmt_bytes
from static_dist.zoo import get_model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=4, help="micro-batch per rank")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--accumulation", type=int, default=2)
    ap.add_argument("--budget", default="1GiB")
    ap.add_argument("--plan", help="use this plan JSON instead of planning")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda: torch.cuda.set_device(device)
    zm = get_model("tiny")
    x, y = zm.batch(args.batch, args.seq)
    graph = capture(zm.build(device="meta"), x, loss_fn=zm.loss, targets=y, optimizer="sgd")
    if args.plan: plan = FSDPPlan.from_json(args.plan)
    else:
        plan = plan_fsdp(graph, world_size=world, budget=parse_bytes(args.budget), param_dtype=None,
                         reduce_dtype=None, accumulation_steps=args.accumulation).plan
    model = zm.build(device=device, seed=0)
    apply_plan(model, plan)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    if rank == 0:
        print(f"plan {plan.name}: {len(plan.units)} units, predicted peak/rank "
              f"{fmt_bytes(predict_memory(profile_graph(graph), plan).peak_bytes)}")
    for step in range(args.steps):
        mbs = []
        for i in range(plan.accumulation_steps):
            (xi,), yi = zm.batch(args.batch, args.seq, device=device, seed=1 + step * 1000 + i * world + rank)
            mbs.append((xi, yi))
        loss = train_step(model, opt, mbs, zm.loss, plan)
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1): print(f"step {step:3d} loss {float(loss):.4f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
