"""Train your own model with a planned FSDP2 configuration, in your own loop.

    python -m torch.distributed.run --standalone --nproc_per_node 2 examples/train_fsdp.py --steps 20
    python -m torch.distributed.run --standalone --nproc_per_node 2 examples/train_fsdp.py --model examples/gpt.py:GPT

`--model` takes any workload source (a zoo name, path/file.py:NAME, package.module:NAME or hf:CONFIG). Every rank
captures the step on fake tensors and plans it (the same inputs give the same plan on every rank), or reads the plan
that `static-dist plan-fsdp --out plan.json` wrote. What your own script needs are the three lines marked below:
`apply_plan`, an optimizer, and `train_step` given the plan (it accumulates the plan's micro-batches and syncs
gradients as the plan says). Works on CPU (gloo) and GPU (nccl).
"""
import argparse

import torch
import torch.distributed as dist

from static_dist.cost import profile_graph
from static_dist.fsdp import FSDPPlan, apply_plan, plan_fsdp, predict_memory
from static_dist.graph import fmt_bytes
from static_dist.launch import close_process_group, init_process_group
from static_dist.step import make_optimizer, train_step
from static_dist.util import parse_bytes
from static_dist.workload import load_workload


def batches(w, step: int, plan, rank: int, device) -> list:
    "This rank's micro-batches for `step`: fresh seeded tokens for a token model, else the workload's example batch."
    out = []
    for i in range(plan.accumulation_steps):
        if w.from_tokens is None: out.append(w.micro_batch(device=device)); continue
        g = torch.Generator().manual_seed(1 + step * 1000 + i * plan.world_size + rank)
        out.append(w.token_batch(torch.randint(w.vocab, (w.batch, w.seq + 1), generator=g).to(device)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", help="zoo name, path/to/file.py:NAME, package.module:NAME or hf:CONFIG")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=4, help="micro-batch per rank")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--accumulation", type=int, default=2)
    ap.add_argument("--optimizer", default="sgd", choices=["sgd", "adam", "adamw"])
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--budget", default="1GiB")
    ap.add_argument("--plan", help="use this plan JSON instead of planning")
    args = ap.parse_args()
    init_process_group()                              # torchrun's group: nccl on GPUs, gloo on CPU
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda: torch.cuda.set_device(device)
    w = load_workload(args.model, batch=args.batch, seq=args.seq, optimizer=args.optimizer)
    prof = profile_graph(w.graph())
    if args.plan: plan = FSDPPlan.from_json(args.plan)
    else:
        plan = plan_fsdp(prof, world_size=world, budget=parse_bytes(args.budget), param_dtype=None,
                         reduce_dtype=None, accumulation_steps=args.accumulation).plan
    model = w.build_model(device=device, seed=0)
    apply_plan(model, plan)                                                        # 1. shard as planned
    opt = make_optimizer(args.optimizer, model.parameters(), lr=args.lr)          # 2. the optimizer
    if rank == 0:
        print(f"{w.source}: plan {plan.name}, {len(plan.units)} units, predicted peak/rank "
              f"{fmt_bytes(predict_memory(prof, plan).peak_bytes)}")
    for step in range(args.steps):
        loss = train_step(model, opt, batches(w, step, plan, rank, device), w.loss, plan=plan)   # 3. the step
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1): print(f"step {step:3d} loss {float(loss):.4f}")
    close_process_group()


if __name__ == "__main__":
    main()
