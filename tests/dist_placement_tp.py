"""Ranks' code (4 gloo ranks, 2x2 mesh dp x tp): apply sharding plans to the tiny Llama and compare with one process.

Launched by tests/test_placement.py with `static_dist.launch.launch("tests/dist_placement_tp.py:main", 4)`. Every
rank computes the single-process reference itself (same seed, full batch).
"""
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode

from static_dist.graph import capture
from static_dist.placement import (
    MEGATRON,
    LayoutError,
    ShardingPlan,
    apply_sharding_plan,
    evaluate_plan,
    llama_block_spec,
    search_plan,
    validate_plan,
)
from static_dist.topology import MeshSpec, preset
from static_dist.zoo import get_model

# DTensor (tp) issues functional collectives; FSDP2 (dp) issues c10d's in-place ones
TORCH_NAME = {("tp", "all_reduce"): "c10d_functional.all_reduce",
              ("tp", "all_gather"): "c10d_functional.all_gather_into_tensor",
              ("dp", "all_gather"): "c10d._allgather_base_", ("dp", "reduce_scatter"): "c10d._reduce_scatter_base_"}


class CommBytes(TorchDispatchMode):
    "Records (kind, full-buffer bytes) of every functional collective, read from the tensors it is given."
    def __init__(self):
        super().__init__(); self.seen = []
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        nb = lambda t: t.numel() * t.element_size()
        if name.startswith("_c10d_functional::"):
            op = name.split("::")[1]
            if op == "all_reduce": self.seen.append(("tp", "all_reduce", nb(args[0])))
            elif op == "all_gather_into_tensor": self.seen.append(("tp", "all_gather", nb(args[0]) * args[1]))
        elif name == "c10d::_allgather_base_": self.seen.append(("dp", "all_gather", nb(args[0])))      # output: full
        # input: full
        elif name == "c10d::_reduce_scatter_base_": self.seen.append(("dp", "reduce_scatter", nb(args[1])))
        return func(*args, **(kwargs or {}))


def main() -> dict:
    "Every plan on this rank of the running 4-rank group; the results (rank 0's are returned by the launcher)."
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    zm = get_model("tiny")
    B, S = 4, 32
    (tokens,), targets = zm.batch(B, S, seed=1)
    half = slice(dp_rank * B // 2, (dp_rank + 1) * B // 2)
    # the plan is made from the captured graph of one dp rank's batch
    g = capture(zm.build(device="meta"), (tokens[half],), loss_fn=zm.loss, targets=targets[half], optimizer="sgd")
    cfg = zm.build(device="meta").cfg
    topo, mspec = preset("cpu-2socket", ranks_per_socket=2), MeshSpec((2, 2), ("dp", "tp"))
    spec = llama_block_spec(g, cfg, topo)
    meg = evaluate_plan(spec, MEGATRON, topo, mspec, method="megatron")
    found = search_plan(spec, topo, mspec, memory_budget=meg.memory * 1.01, allow_dp_shard=False)
    mixed = evaluate_plan(spec, {"attention.wq": "colwise_gather", "attention.wk": "colwise_gather",
                                 "attention.wv": "colwise_gather", "attention.wo": "replicate",
                                 "feed_forward.w1": "replicate", "feed_forward.w3": "replicate",
                                 "feed_forward.w2": "rowwise_scatter"}, topo, mspec, method="mixed")

    ref = zm.build(device="cpu", seed=0)
    ref_out = ref(tokens)
    zm.loss(ref_out, targets).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    results = {}
    # a memory budget below Megatron's forces some weights to be sharded over dp as well (FSDP2)
    fsdp = search_plan(spec, topo, mspec, memory_budget=meg.memory * 0.8)
    assert any(f for *_, f in fsdp.styles), fsdp.styles
    # plans are data: rank 0's go to every rank (a solver tie broken differently on two ranks would deadlock)
    plans = [p.to_dict() for p in (found, meg, mixed, fsdp)]
    dist.broadcast_object_list(plans, src=0)
    found, meg, mixed, fsdp = (ShardingPlan.from_dict(d) for d in plans)
    for label, plan in (("found", found), ("megatron", meg), ("mixed", mixed), ("found_fsdp", fsdp)):
        m = apply_sharding_plan(zm.build(device="cpu", seed=0), mesh, spec, plan)
        rec = CommBytes()
        with CommDebugMode() as cdm, rec:
            out = m(tokens[half])
            zm.loss(out, targets[half]).backward()
        counts = {str(k): v for k, v in cdm.get_comm_counts().items()}
        colls = _collectives(spec, plan, topo, mspec) * plan.n_layers
        issued = [(d, k, n) for _ph, k, d, n in colls if not (d == "dp" and k == "all_reduce")]   # torch issues these
        predicted_counts = dict(Counter(TORCH_NAME[(d, k)] for d, k, _ in issued))
        # replicated weights: average the local gradients over dp ourselves (the plan's dp all-reduces);
        # FSDP-sharded ones arrive reduce-scattered and averaged. Then compare full grads with one process.
        dp_bytes, grad_err = 0, 0.0
        fsdp_linears = {n for n, _, f in plan.styles if f}
        for n, p in m.named_parameters():
            n = n.replace("._fsdp_wrapped_module", "")
            linear = n.rsplit(".", 1)[0].split(".", 2)[2] if n.startswith("layers.") else ""
            if linear not in fsdp_linears:
                local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                if linear in MEGATRON: dp_bytes += local.numel() * local.element_size()   # the plan's linears
                dist.all_reduce(local, group=mesh["dp"].get_group()); local /= 2
            full = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grad_err = max(grad_err, (full - ref_grads[n]).abs().max().item())
        pred_dp = sum(n for _ph, k, d, n in colls if d == "dp" and k == "all_reduce")
        results[label] = dict(
            styles=[[n, s, f] for n, s, f in plan.styles],
            predicted_seconds=plan.seconds,
            predicted_comm_bytes=plan.comm_bytes,
            out_err=(out - ref_out[half]).abs().max().item(),
            grad_err=grad_err,
            counts=counts,
            predicted_counts=predicted_counts,
            bytes=sorted(rec.seen),
            predicted_bytes=sorted(issued),
            dp_grad_bytes=dp_bytes,
            predicted_dp_bytes=pred_dp,
        )

    bad = evaluate_plan(spec, dict(MEGATRON, **{"feed_forward.w2": "colwise"}), topo, mspec, method="bad")
    try:
        validate_plan(spec, bad); caught = None
    except LayoutError as e:
        caught = [str(v) for v in e.violations]
    from torch.distributed.tensor.parallel import parallelize_module
    try:   # what torch does with it when nobody checks first
        parallelize_module(zm.build(device="cpu", seed=0), mesh["tp"], bad.parallelize_plan())(tokens[half])
        torch_error = None
    except Exception as e:
        torch_error = f"{type(e).__name__}: {str(e)[:200]}"
    results["bad_plan"] = dict(caught=caught, torch_error=torch_error)
    return results


def _collectives(spec, plan, topo, mspec):
    from static_dist.placement import choice_cost
    return [c for n, s, f in plan.styles
            for c in choice_cost(spec.linear(n), s, f, topo, mspec, plan.tp_dim).collectives]
