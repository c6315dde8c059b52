"""Parallel plans run for real on 4 gloo ranks (the package's launcher) next to a single process: dp_shard 2 x tp 2 and
pp 2 x dp_shard 2 on the zoo's tiny Llama. Losses and parameters after 3 AdamW steps equal the single process, and
every rank's collectives per step equal the prediction, by mesh dim and kind. cp 2 needs CUDA attention kernels
(torch's ring attention has no CPU SDPA path): on CPU the run must say so; on a GPU it must match."""
import math

import pytest
import torch

from static_dist.fsdp import FSDPPlan, FSDPUnit
from static_dist.launch import launch
from static_dist.parallel import ParallelDims, ParallelPlan, predict_axis_counts, rank_profile
from static_dist.workload import load_workload

BATCH, SEQ = 4, 32


def _units(mesh, blocks):
    return FSDPPlan(math.prod(mesh), mesh, (FSDPUnit(""), *(FSDPUnit(b) for b in blocks)))


@pytest.fixture(scope="module")
def tiny():
    w = load_workload("tiny", batch=BATCH, seq=SEQ)
    return w, w.graph()


def _same_as_single_process(rep):
    assert len(rep["losses"]) == 3
    for a, b in zip(rep["losses"], rep["ref_losses"]): assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), rep["losses"]
    for r in rep["ranks"]:
        assert r["error"] is None and r["close"], (r["error"], r.get("max_abs"))


def test_gloo_dp2_tp2_and_pp2_dp2(tiny):
    w, g = tiny
    blocks = g.structure.main.blocks
    megatron = tuple(
        (l.name, "rowwise" if l.name.endswith(("wo", "w2")) else "colwise") for l in g.structure.main.linears
    )
    dp_tp = ParallelPlan(ParallelDims(dp_shard=2, tp=2), megatron, fsdp=_units((2,), blocks))
    pp_dp = ParallelPlan(ParallelDims(dp_shard=2, pp=2), stages=(1, 1), microbatches=2, fsdp=_units((2,), blocks))
    (r_tp, r_pp) = launch("static_dist.parallel.run:run_plans", 4,
                          [["tiny", dp_tp.to_json()], ["tiny", pp_dp.to_json()]], timeout=900)
    _same_as_single_process(r_tp)
    # the dp x tp prediction from the captured graph (a rank's view of a 2-row batch), not from the run
    wr = load_workload("tiny", batch=BATCH // 2, seq=SEQ)
    want = predict_axis_counts(rank_profile(wr.graph(), dp_tp), dp_tp)
    for r in r_tp["ranks"]:
        for c in r["counts"]: assert c == want, (c, want)
    _same_as_single_process(r_pp)
    for r in r_pp["ranks"]:                         # step 1 also carries the stages' one-time shape agreement
        for c in r["counts"][1:]: assert c == r["predicted"], (c, r["predicted"])


def test_gloo_cp2():
    cp = ParallelPlan(ParallelDims(dp_shard=2, cp=2), fsdp=FSDPPlan(4, (4,), (FSDPUnit(""),)))
    (rep,) = launch("static_dist.parallel.run:run_plans", 4, [["tiny", cp.to_json()]], timeout=900)
    if not torch.cuda.is_available():
        for r in rep["ranks"]: assert "needs CUDA attention kernels" in (r["error"] or ""), r
        return
    _same_as_single_process(rep)
    assert all(r["cp_shards_ok"] for r in rep["ranks"])


def test_gloo_chunked_loss_dp2_tp2_sequence_and_loss_parallel():
    "The chunked loss (step.ChunkedLoss) under dp_shard 2 x tp 2 with sequence and loss parallelism: losses and "
    "parameters equal the single process's, and each rank's collectives the prediction (3 loss all-reduces a chunk)."
    import pathlib
    from static_dist.parallel import tp_layout
    from static_dist.placement import block_spec, megatron_styles
    src = f"{pathlib.Path(__file__).parent / 'chunked_tiny.py'}:tiny_chunked"
    wr = load_workload(src, batch=BATCH // 2, seq=SEQ)                # a rank's view: its 2 rows
    g = wr.graph()
    styles, outer, sp = tp_layout(g, tuple(megatron_styles(block_spec(g)).items()))
    plan = ParallelPlan(ParallelDims(dp_shard=2, tp=2), styles, fsdp=_units((2,), g.structure.main.blocks),
                        sequence_parallel=sp, loss_parallel=True, tp_outer=outer)
    assert sp and dict((r, m) for m, r in outer)["output"] == "output"
    (rep,) = launch("static_dist.parallel.run:run_plans", 4, [[src, plan.to_json()]], timeout=900)
    _same_as_single_process(rep)
    want = predict_axis_counts(rank_profile(g, plan), plan)
    assert want["tp.all_reduce"] >= 3 * 4, want                     # the loss's three, once per chunk
    for r in rep["ranks"]:
        for c in r["counts"]: assert c == want, (c, want)


@pytest.mark.parametrize("sequence", [False, True])
def test_vocab_rows_keep_their_own_gradients(tiny, sequence):
    """Under tp 2 (a fake process group on real CPU tensors) the output projection's matmuls, forward and backward, run
    on the rank's half of the vocabulary, as torchtitan's vocab-parallel output does: no matmul of the step makes a
    tensor the whole vocabulary long (torch's ColwiseParallel there gathered the logits' gradient and made the whole
    table's weight gradient and the input gradient from it on every rank), and the embedding's and the output's
    weight gradients are `Shard(0)`, half the rows."""
    from torch.distributed.tensor import Shard
    from torch.utils._python_dispatch import TorchDispatchMode
    from static_dist.launch import process_group
    from static_dist.parallel import apply_parallel_plan, step_context, tp_layout
    from static_dist.placement import block_spec, megatron_styles
    w, g = tiny
    styles, outer, sp = tp_layout(g, tuple(megatron_styles(block_spec(g)).items()), sequence)
    plan = ParallelPlan(ParallelDims(tp=2), tp_styles=styles, sequence_parallel=sp, loss_parallel=True, tp_outer=outer)
    products = []
    class Products(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.mm.default: products.append(tuple(out.shape))
            return out
    with process_group(fake_world=2):
        m = apply_parallel_plan(w.build(device="cpu", dtype=torch.float32), plan, seq=SEQ)
        args, _, targets = w.inputs(dtype="float32")
        with step_context(plan)(), Products(): w.loss(m(*args), targets).backward()
        V = m.get_submodule(dict((r, x) for x, r in outer)["output"]).weight.shape[0]
        for module, role in outer:
            if role in ("embedding", "output"):
                wt = m.get_submodule(module).weight
                assert tuple(wt.grad.placements) == (Shard(0),) and wt.grad.to_local().shape[0] * 2 == V, role
    assert products and not [p for p in products if V in p], products
