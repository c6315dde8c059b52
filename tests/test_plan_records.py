"""The faster `plan` computes what the straightforward one did: an expanded profile equals one laid out op by op from
its definition (block 1's forward and backward repeated, each copy's bytes offset by what a block leaves behind), the
search's records of its layouts equal the same layouts evaluated directly, outside the search's memos, and FSDP's layout
memo is shared by exactly the profiles whose ops and parameters are the very same objects."""
import dataclasses
import math
import re

import numpy as np
import pytest
import torch

from static_dist.cost import expand_profile, profile_graph
from static_dist.fsdp import FSDPPlan, block_units
from static_dist.fsdp.memory import layout
from static_dist.graph import capture
from static_dist.graph.policies import FullCheckpoint, SelectiveOps
from static_dist.parallel import ParallelDims, ParallelPlan, predict_step_time, rank_profile, rank_work
from static_dist.parallel.search import memory_by_category, search_layouts
from static_dist.placement import block_spec, megatron_styles
from static_dist.topology import preset
from static_dist.zoo import PRESETS, Llama, get_model


def _blocks(L):
    "The zoo's `small` Llama with `L` blocks, captured (one AdamW step) on meta tensors."
    zm = get_model("small")
    (x,), y = zm.batch(2, 64, seed=0)
    with torch.device("meta"): m = Llama(dataclasses.replace(PRESETS["small"], n_layers=L))
    return capture(m, (x,), loss_fn=zm.loss, targets=y, optimizer="adamw")


@pytest.fixture(scope="module")
def g3():
    return _blocks(3)


def _block(m: str, stack: str):
    hit = re.match(rf"^{re.escape(stack)}\.(\d+)(\.|$)", m)
    return int(hit.group(1)) if hit else None


def reference_ops(P, n: int) -> dict:
    """The expanded per-op fields, one op at a time from the definition: the ops up to block 1's forward end, block 1's
    forward `extra` more times as blocks 2, 3, ... (bytes alive + (j + 1) x what one block leaves behind), the ops up to
    block 1's backward (+ extra x), the copies' backwards in reverse, the rest; captured blocks >= 2 renumbered
    after the copies; the optimizer's temporaries scaled by the parameter bytes when one foreach step updates them
    all."""
    extra, stack, N = n - len(P.blocks), P.stack, len(P.op_module)
    ob = [_block(m, stack) for m in P.op_module]
    ops_of = lambda b, ph: [i for i in range(N) if ob[i] == b and int(P.op_phase[i]) == ph]
    f1, b1 = ops_of(1, 0), ops_of(1, 1)
    delta = int(P.native[ops_of(2, 0)[0]]) - int(P.native[f1[0]])
    rename = lambda m, k: re.sub(rf"^({re.escape(stack)}\.)\d+", lambda h: f"{h.group(1)}{k}", m)
    runs = [(range(0, f1[-1] + 1), 0, None), *((f1, j + 1, j + 2) for j in range(extra)),
            (range(f1[-1] + 1, b1[0]), extra, None), *((b1, j + 1, j + 2) for j in reversed(range(extra))),
            (range(b1[0], N), 0, None)]
    rows = []
    for ix, copies, blk in runs:
        for i in ix:
            b, m = ob[i], P.op_module[i]
            name = rename(m, blk) if blk is not None else rename(m, b + extra) if b is not None and b >= 2 else m
            rows.append((name, i, int(P.native[i]) + copies * delta))
    ix = [i for _, i, _ in rows]
    native, temp = np.array([r[2] for r in rows], dtype=np.int64), P.temporary[ix].copy()
    pb = lambda ps: sum(p.numel * p.itemsize for p in ps)
    foreach = any("_foreach_" in P.op_names[i] for i in range(N) if int(P.op_phase[i]) == 2)   # else one per parameter
    grown = pb(P.params) + extra * pb(p for p in P.params if _block(p.module, stack) == 1)
    scale = grown / pb(P.params) if foreach else 1
    opt = P.op_phase[ix] == 2
    native[opt] += (temp[opt] * (scale - 1)).astype(np.int64)
    temp[opt] = (temp[opt] * scale).astype(np.int64)
    return dict(op_module=tuple(r[0] for r in rows), op_names=tuple(P.op_names[i] for i in ix),
                op_dtypes=tuple(P.op_dtypes[i] for i in ix), op_phase=P.op_phase[ix], op_flops=P.op_flops[ix],
                op_bytes=P.op_bytes[ix], native=native, temporary=temp)


def _check_expansion(P, n):
    E, R = expand_profile(P, n), reference_ops(P, n)
    for f, want in R.items():
        got = getattr(E, f)
        if isinstance(want, np.ndarray):
            assert got.dtype == want.dtype and np.array_equal(got, want), f
        else: assert got == want, f
    assert E.blocks == tuple(f"{P.stack}.{i}" for i in range(n))
    assert len(E.params) == len(P.params) + (n - len(P.blocks)) * sum(_block(p.module, P.stack) == 1 for p in P.params)


def test_expanded_profile_equals_the_op_by_op_reference(g3):
    "A capture's profile, 3 blocks to 9: every per-op field as the definition lays it out."
    _check_expansion(profile_graph(g3, "float32"), 9)


def test_expanded_rank_profile_equals_the_op_by_op_reference(g3):
    "What the search expands: one rank's profile under tensor parallelism and full checkpointing, 3 blocks to 7."
    styles = tuple(megatron_styles(block_spec(g3)).items())
    P = rank_profile(g3, ParallelPlan(ParallelDims(tp=2), styles, ac=(FullCheckpoint(),) * 3))
    _check_expansion(P, 7)


def test_layout_memo_is_shared_by_the_very_same_ops(g3):
    """Profiles that share their op and parameter fields (a `replace` of other bytes held) share one layout; a profile
    with equal but other parameters objects, or other parameters, gets its own."""
    P = profile_graph(g3)
    plan = FSDPPlan(8, (8,), block_units(P.blocks))
    held = dataclasses.replace(P, native=P.native + 1)
    assert layout(held, plan) is layout(P, plan)
    other = dataclasses.replace(P, params=tuple(dataclasses.replace(p) for p in P.params))
    assert layout(other, plan) is not layout(P, plan) and layout(other, plan) == layout(P, plan)
    fewer = dataclasses.replace(P, params=P.params[:-1])
    assert layout(fewer, plan) != layout(P, plan)


@pytest.fixture(scope="module")
def searched():
    """The `small` preset at 8 blocks from 3 captured, searched on 16 ranks with a budget that needs checkpointing:
    every layout, and the pipelined ones (pp 2, 1F1B and Interleaved1F1B)."""
    g = _blocks(3)
    topo = preset("cluster", n_nodes=2, gpus_per_node=8)
    roomy = search_layouts(g, 16, topo, 2**40, n_blocks=8, runners_up=0).best.memory_bytes
    run = lambda **kw: search_layouts(g, 16, topo, int(roomy * 0.75), n_blocks=8, runners_up=6, microbatches=(1, 2),
                                      **kw)
    return g, topo, [run(), run(pins={"pp": 2}), run(pins={"pp": 2}, schedule="Interleaved1F1B")]


def test_search_records_equal_direct_evaluations(searched):
    """Each layout the search kept, its step time and memory evaluated on their own: the rank's work made afresh for
    the layout's tp and cp (no memo of the search's), the step predicted, the memory composed by
    `memory_by_category`."""
    g, topo, rs = searched
    kept = [c for r in rs for c in (r.best, *r.runners_up)]
    assert None not in kept and len(kept) > 6 and sum(c.plan.dims.pp > 1 for c in kept) > 3, [r.table() for r in rs]
    assert any(c.plan.schedule == "Interleaved1F1B" for c in kept)
    for c in kept:
        d = c.plan.dims
        tpf = dict(tp_styles=c.plan.tp_styles, sequence_parallel=c.plan.sequence_parallel,
                   loss_parallel=c.plan.loss_parallel, tp_outer=c.plan.tp_outer) if d.tp > 1 else {}
        w = rank_work(g, ParallelPlan(ParallelDims(cp=d.cp, tp=d.tp), **tpf), topo,
                      policies=(FullCheckpoint(), SelectiveOps()))
        t = predict_step_time(w, c.plan, topo, n_blocks=8)
        assert t.to_dict() == c.time.to_dict(), c.label()
        assert memory_by_category(g, c.plan, 8)[0][2] == c.memory_bytes, c.label()


def test_tp_time_charges_by_what_a_rank_computes_not_where_the_capture_files_it(g3):
    """At tp 2 the capture files the backward of `wq` and `wk` under `wv` (of `w1` under `w3`), and with it the adds of
    the projections' input gradients: whole hidden-size tensors, a partial sum on every rank, so charged whole; every
    matmul filed under a sharded linear is charged half (each rank multiplies its slice of the weight)."""
    from static_dist.parallel.time import _op_factor
    from static_dist.cost.profile import main_stack
    styles = tuple(megatron_styles(block_spec(g3)).items())
    plan = ParallelPlan(ParallelDims(tp=2), styles)
    f, linears = _op_factor(g3, plan, main_stack(g3)[1]), {f"layers.1.{n}" for n, s in styles if s != "replicate"}
    hidden = 2 * 64 * PRESETS["small"].dim
    mine = [(i, o) for i, o in enumerate(g3.ops) if o.phase == "backward" and o.module in linears]
    made = {t: o for o in g3.ops for t in o.outputs}
    def of_matmuls(t) -> bool:                      # a matmul's output, a view of one, or a sum of such
        o = made[t]
        joins = o.op in ("aten.view.default", "aten.add.Tensor") and all(map(of_matmuls, o.inputs))
        return o.op == "aten.mm.default" or joins
    sums = [i for i, o in mine if o.op == "aten.add.Tensor" and all(map(of_matmuls, o.inputs))
            and math.prod(g3.tensors[o.outputs[0]].shape) == hidden]
    mms = [i for i, o in mine if o.op == "aten.mm.default"]
    assert len(sums) == 3 and len(mms) == 14, (sums, len(mms))     # k+v, q+(k+v), w1+w3; 7 linears x 2 matmuls
    assert all(f[i] == 1.0 for i in sums) and all(f[i] == 0.5 for i in mms)
