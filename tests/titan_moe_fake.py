"""One-process, fake-process-group measurement of a torchtitan 0.3.0 mixture-of-experts job (DeepSeek-V3 or
Qwen3-MoE; by default EP=2, dp_shard=4, world=4; --tp 2 --ep 1 --dp-shard 2 for tensor parallelism inside the
experts) with FSDPMemTracker + CommDebugMode.

Run (from the repo root, in its .venv):
  python tests/titan_moe_fake.py [--job deepseek_v3_debugmodel|deepseek_v3_16b|qwen3_30b_a3b] [--layers 3]
         [--dp-shard 4] [--ep 2] [--tp 1] [--batch 2] [--seq 64]
         [--param-dtype bfloat16|float32] [--reshard default|always|never]
         [--no-mem] [--no-count-patch] [--debug-comm]
  (--backend defaults to partial_dtensor, the only spmd_backend that runs
  with torch 2.13 here; see --help.)

One untracked warm-up step first: the tracked step holds the optimizer state, as every step after the first does.

Everything here is built from torchtitan's own code:
  * config:      torchtitan.models.{deepseek_v3,qwen3}.config_registry.<--job>()
  * model cfg:   <its model>.Config.update_from_config(config=trainer_cfg)
                 (sets sharding configs + router._debug_force_load_balance)
  * mesh:        torchtitan.distributed.ParallelDims(...).build_mesh()
  * parallelize: the job's model_spec.parallelize_fn (parallelize_deepseekv3, parallelize_qwen3)
                 (model.parallelize(parallel_dims) -> EP sharding of experts +
                 AllToAllTokenDispatcher.wire_meshes(ep_mesh); then
                 apply_fsdp_to_mtp_decoder -> apply_fsdp_to_decoder / fully_shard)
  * optimizer:   torch.optim.AdamW over the (DTensor) params
  * loss:        torchtitan.components.loss.cross_entropy_loss (sum; vocabulary-parallel under tp)

Monkeypatches (script-local, documented where applied):
  1. torchtitan "device_type" globals -> "cpu" (torchtitan falls back to "cuda"
     when no accelerator is present; meshes must be CPU meshes here).
  2. AllToAllTokenDispatcher._token_count_exchange: the original collective is
     still issued (so CommDebugMode counts it), but its output is overwritten
     with the input (identity copy).  If the fake PG does not fill collective
     outputs, the received per-expert counts are garbage and would be used as
     all-to-all split sizes.  With forced balanced routing
     (debug.moe_force_load_balance -> router._debug_force_load_balance) every
     rank sends the same counts, so identity is exactly what a real
     all-to-all would return.  NOTE: measured on torch 2.13, the fake PG
     already fills outputs (c10d all_to_all_single = identity copy; funcol
     all_to_all_single puts this rank's self-chunk in every output chunk,
     i.e. "all ranks identical"; all_gather replicates the local shard), so
     with balanced routing this patch is a no-op safeguard (same counts, same
     results with --no-count-patch); it matters on fake-PG versions that leave
     outputs uninitialised.
  3. FSDPMemTracker multi-param-group support: torchtitan's EP path calls
     fully_shard(block, shard_placement_fn=...) with a per-param mesh (experts
     -> efsdp mesh, the rest -> dp_shard mesh), so each MoE block's FSDPState
     has 2 FSDPParamGroups, which torch's FSDPMemTracker refuses.  The step is
     tracked by static_dist.cost.measure.GroupsMemTracker (every group's
     backward wrapped, each state instrumented once: fully_shard([norm,
     lm_head]) is one state on two modules).  Checked: comm counts with the
     tracker == with --no-mem.
  4. TokenChoiceTopKRouter._debug_force_load_balance_routing under tensor
     parallelism: the router's scores are a DTensor there and torchtitan's
     round-robin index a plain tensor ("aten.gather.default got mixed
     torch.Tensor and DTensor"). The same round robin is computed on the
     rank's local scores and wrapped as a DTensor of the scores' placements
     (applied only with --tp > 1; without tp the original runs).
"""

import argparse
import tempfile
import json
import sys
import time
from collections import Counter, defaultdict

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore



def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="partial_dtensor",
                   choices=["partial_dtensor", "spmd_types", "full_dtensor"],
                   help="parallelism.spmd_backend. Only partial_dtensor works with "
                        "torch 2.13 here: spmd_types fails in fully_shard (FSDP2 of "
                        "torch 2.13 needs DTensor params when dp_mesh_dims is given), "
                        "full_dtensor fails in router._debug_force_load_balance_routing "
                        "(gather of DTensor scores with a plain arange index).")
    p.add_argument("--job", default="deepseek_v3_debugmodel",
                   help="a torchtitan config-registry job of deepseek_v3 or qwen3 (deepseek_v3_16b, qwen3_30b_a3b, "
                        "...), cut to its first --layers")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--dp-shard", type=int, default=4)
    p.add_argument("--ep", type=int, default=2, help="expert-parallel degree (torchtitan draws it from dp_shard x tp)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree (with sequence parallelism, as torchtitan runs it)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--param-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--reshard", default="default", choices=["default", "always", "never"])
    p.add_argument("--debug-comm", action="store_true")
    p.add_argument("--trace-comm", action="store_true",
                   help="print each collective of the tracked step with its tensor shape (stderr)")
    p.add_argument("--no-count-patch", action="store_true",
                   help="do not apply monkeypatch 2 (token-count identity copy)")
    p.add_argument("--no-mem", action="store_true",
                   help="skip FSDPMemTracker (to check it does not change comm counts)")
    return p.parse_args()


def patch_device_type():
    # Monkeypatch 1: torchtitan computes device_type = _get_available_device_type() or "cuda"
    # at import time; on a CPU-only box that is "cuda". Force "cpu" in every
    # module that imported it by value.
    import torchtitan.tools.utils as tu
    import torchtitan.distributed.parallel_dims as pd
    import torchtitan.distributed.utils as du
    import torchtitan.models.common.token_dispatcher as td

    for m in (tu, pd, du, td):
        if hasattr(m, "device_type"):
            m.device_type = "cpu"
        if hasattr(m, "device_module"):
            m.device_module = torch.cpu


def patch_token_count_exchange():
    # Monkeypatch 2 (see module docstring).
    from torch.distributed._functional_collectives import wait_tensor
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    orig = AllToAllTokenDispatcher._token_count_exchange

    def _token_count_exchange_identity(self, num_local_tokens_per_expert_E, pg, ep_size):
        out = orig(self, num_local_tokens_per_expert_E, pg, ep_size)  # real collective call
        src = num_local_tokens_per_expert_E.view(ep_size, -1)
        if isinstance(out, torch.Tensor) and type(out).__name__ == "AsyncCollectiveTensor":
            out = wait_tensor(out)
        with torch.no_grad():
            out.copy_(src)  # fake PG leaves `out` unfilled; identity == real result when balanced
        return out

    AllToAllTokenDispatcher._token_count_exchange = _token_count_exchange_identity


def patch_balanced_routing_for_dtensor():
    # Monkeypatch 4 (see module docstring).
    from torch.distributed.tensor import DTensor
    from torchtitan.models.common.moe import TokenChoiceTopKRouter

    orig = TokenChoiceTopKRouter._debug_force_load_balance_routing

    def routing(self, scores_BLE):
        if not isinstance(scores_BLE, DTensor):
            return orig(self, scores_BLE)
        ids, _ = orig(self, scores_BLE.to_local())
        ids = DTensor.from_local(ids, scores_BLE.device_mesh, scores_BLE.placements, run_check=False)
        return ids, scores_BLE.gather(dim=-1, index=ids)

    TokenChoiceTopKRouter._debug_force_load_balance_routing = routing


def describe_fsdp_units(model):
    """List every fully_shard unit, its param groups, mesh and reshard setting."""
    from torch.distributed.fsdp import FSDPModule

    pname = {id(p): n for n, p in model.named_parameters()}
    units, seen_groups = [], {}
    for fqn, mod in model.named_modules():
        if not isinstance(mod, FSDPModule):
            continue
        st = mod._get_fsdp_state()
        groups = []
        for g in st._fsdp_param_groups:
            if id(g) in seen_groups:  # fully_shard([norm, lm_head]) -> one shared group
                groups.append({"same_group_as": seen_groups[id(g)]})
                continue
            seen_groups[id(g)] = fqn or "<root>"
            mi = g.mesh_info
            pmi = g.post_forward_mesh_info
            fqns = [pname.get(id(fp.sharded_param), "?") for fp in g.fsdp_params]
            groups.append({
                "mesh_dim_names": list(mi.mesh.mesh_dim_names or ()),
                "shard_mesh_size": getattr(mi, "shard_mesh_size", None),
                "reshard_after_forward": pmi is not None,
                "num_params": len(fqns),
                "numel_before_fsdp": sum(fp._orig_size.numel() for fp in g.fsdp_params),
                "shard_dims": sorted({str(fp.fsdp_placement) for fp in g.fsdp_params}),
                "param_dtype": str(g.mp_policy.param_dtype),
                "params": fqns,
            })
        units.append({"module": fqn or "<root>", "type": type(mod).__name__,
                      "param_groups": groups})
    return units


def main():
    args = parse()
    torch.manual_seed(0)
    world = args.dp_shard * args.tp
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    patch_device_type()
    if not args.no_count_patch:
        patch_token_count_exchange()
    if args.tp > 1:
        patch_balanced_routing_for_dtensor()

    from torchtitan.config import ParallelismConfig, TORCH_DTYPE_MAP
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.components.loss import cross_entropy_loss
    import importlib
    family = "deepseek_v3" if args.job.startswith("deepseek_v3") else "qwen3"
    cfg = getattr(importlib.import_module(f"torchtitan.models.{family}.config_registry"), args.job)()
    cfg.parallelism = ParallelismConfig(
        data_parallel_shard_degree=args.dp_shard,
        tensor_parallel_degree=args.tp,
        expert_parallel_degree=args.ep,
        spmd_backend=args.backend,
        fsdp_reshard_after_forward=args.reshard,
    )
    cfg.training.local_batch_size = args.batch
    cfg.training.seq_len = args.seq
    cfg.training.mixed_precision_param = args.param_dtype
    cfg.debug.moe_force_load_balance = True  # -> router._debug_force_load_balance
    cfg.activation_checkpoint = None  # keep AC out of the measurement
    model_spec = cfg.model_spec
    mcfg = model_spec.model
    del mcfg.layers[args.layers:]
    for layer in mcfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()

    mcfg.update_from_config(config=cfg)
    dist_utils.set_spmd_backend(args.backend)

    parallel_dims = ParallelDims.from_config(cfg.parallelism, world)
    parallel_dims.build_mesh()

    with torch.device("meta"):
        model = mcfg.build()

    model = model_spec.parallelize_fn(
        model,
        parallel_dims=parallel_dims,
        training=cfg.training,
        parallelism=cfg.parallelism,
        compile_config=cfg.compile,
        ac_config=cfg.activation_checkpoint,
        dump_folder=tempfile.mkdtemp(),
    )
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()

    fsdp_units = describe_fsdp_units(model)

    optim = torch.optim.AdamW(model.parameters(), lr=8e-4, foreach=True)
    train_context = dist_utils.get_spmd_context(parallel_dims=parallel_dims)

    B, L = args.batch, args.seq
    vocab = mcfg.vocab_size
    tokens = torch.randint(0, vocab, (B, L))
    labels = torch.randint(0, vocab, (B, L))

    from torch.distributed.tensor.debug import CommDebugMode
    from static_dist.cost.measure import GroupsMemTracker, eager_sharding_propagation

    import contextlib
    # warm-up step (untracked): the optimizer state exists in the tracked step, as in every step after the first
    with train_context():
        _p = model(tokens)
        cross_entropy_loss(_p, labels).backward()
    optim.step(); optim.zero_grad(); del _p
    mem = None if args.no_mem else GroupsMemTracker(model, optim)
    comm = CommDebugMode()
    t0 = time.time()
    if mem is not None:
        mem.track_inputs((tokens, labels))
    model_in, model_labels = tokens, labels
    if args.backend == "full_dtensor":
        # as Trainer.post_dataloading_process does for full_dtensor
        from torchtitan.distributed import full_dtensor
        model_in, model_labels, _ = full_dtensor.parallelize_inputs(
            parallel_dims, tokens, labels, {})
    trace = contextlib.nullcontext()
    if args.trace_comm:
        from torch.utils._python_dispatch import TorchDispatchMode

        class Trace(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = str(func)
                if "c10d" in name and args and isinstance(args[0], torch.Tensor):
                    print("collective", name, tuple(args[0].shape), file=sys.stderr)
                return func(*args, **(kwargs or {}))
        trace = Trace()
    # DTensor's sharding propagation as an eager run on a device does it: cached, nothing counted per op
    with (mem if mem is not None else contextlib.nullcontext()), comm, trace, eager_sharding_propagation():
        with train_context():
            pred = model(model_in)
            if args.backend == "full_dtensor":  # DTensor logits: local CE
                pred = pred.to_local()
            loss = cross_entropy_loss(pred, labels)  # vocabulary-parallel when tp shards the logits
            loss.backward()
        optim.step()
        optim.zero_grad()
    dt = time.time() - t0

    # ---- collect
    def _k(k):
        return getattr(k, "name", str(k))

    counts = comm.get_comm_counts()
    comm_counts = {str(getattr(k, "__name__", k)): v for k, v in counts.items()}
    if args.debug_comm:
        import pprint
        name = lambda k: str(getattr(k, "__name__", k))
        pprint.pprint({m: {name(k): v for k, v in d.get("forward", {}).items()}
                       | {"bw:" + name(k): v for k, v in d.get("backward", {}).items()}
                       for m, d in comm.comm_module_counts.items()}, stream=sys.stderr, width=120)
    dev = torch.device("cpu")
    peak_cats = {} if mem is None else {
        _k(k): int(v) for k, v in mem.get_tracker_snapshot("peak").get(dev, {}).items()}

    # Per-phase peaks: max over every tracked FSDP unit's PEAK_FW / PEAK_BW snapshot.
    # (The root DeepSeekV3Model owns no direct params -> no param group -> the
    # tracker does not instrument it, so we take the max over the units.)
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPModState
    phase_peaks = {}
    for state in (_FSDPModState.PEAK_FW, _FSDPModState.PEAK_BW):
        snaps = [] if mem is None else [sn for st in mem.memory_tracking.values()
                 for sn in st.snapshots.get(state, [])]
        if snaps:
            best = max(snaps, key=lambda sn: sn.get(dev, {}).get("Total", 0))
            phase_peaks[state.name] = {_k(k): int(v) for k, v in best.get(dev, {}).items() if v}

    out = {
        "backend": args.backend,
        "world": world, "ep": args.ep, "dp_shard": args.dp_shard, "tp": args.tp,
        "efsdp": parallel_dims.get_mesh("efsdp").size() if args.ep > 1 else None,
        "layers": args.layers, "batch": B, "seq": L, "param_dtype": args.param_dtype,
        "reshard_after_forward_policy": args.reshard,
        "loss": float(loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach()),
        "step_seconds": round(dt, 2),
        "peak_bytes_total": peak_cats.get("Total"),
        "peak_bytes_by_category": peak_cats,
        "phase_peaks": phase_peaks,
        "comm_counts": comm_counts,
        "fsdp_units": fsdp_units,
    }
    print(json.dumps(out, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
