"""Compile priced by the parallel models: a compiled block's saved bytes read through `parallel.memory.rank_profile`
against what autograd keeps for the block compiled by Inductor on CPU, the step time of a compiled plan, and the report
of `static-dist plan --compile`."""
import contextlib
import io
import re

import pytest
import torch

from static_dist.compile.apply import block_inputs
from static_dist.compile.saved import with_compile_effects
from static_dist.graph import capture
from static_dist.parallel import ParallelPlan, predict_parallel_memory, predict_step_time, rank_profile, rank_work
from static_dist.topology import preset
from static_dist.zoo import get_model
from saved_bytes import CACHE, measured_saved



def _saved_in(profile, block: str) -> int:
    "Bytes of the rank profile's saved activations first saved inside `block`."
    return sum(b for b, where, *_ in profile.saved if where == block or where.startswith(block + "."))


@pytest.fixture(scope="module")
def tiny():
    "The tiny Llama (2 blocks) at batch 2 × 64 on meta, captured, with the compiled saved set attached."
    z = get_model("tiny")
    meta = z.build("meta")
    (tokens,), targets = z.batch(2, 64)
    g = with_compile_effects(capture(meta, (tokens,), loss_fn=z.loss, targets=targets), meta, (tokens.to("meta"),))
    return z, tokens, g


def test_parallel_memory_predicts_what_inductor_saves(monkeypatch, tiny):
    z, tokens, g = tiny
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(CACHE))
    real = z.build("cpu")
    ra, rk = block_inputs(real, ["layers.0"], (tokens,))["layers.0"]
    ra = (ra[0].requires_grad_(True), *ra[1:])                   # the residual stream needs grad, as in training
    eager = measured_saved(real.layers[0], real, ra, rk)
    torch._dynamo.reset()
    compiled = measured_saved(torch.compile(real.layers[0], backend="inductor"), real, ra, rk)
    torch._dynamo.reset()
    predicted = _saved_in(rank_profile(g, ParallelPlan(compile=(True, True))), "layers.0")
    assert predicted == compiled, (predicted, compiled, eager)
    assert _saved_in(rank_profile(g, ParallelPlan()), "layers.0") == eager != compiled


def test_compile_lowers_the_peak_where_nothing_is_checkpointed(tiny):
    _, _, g = tiny
    peak = lambda **kw: predict_parallel_memory(g, ParallelPlan(**kw)).peak_bytes
    assert peak(compile=(True, True)) < peak()
    for ac in (("full",) * 2, ("selective",) * 2):               # the policy decides what a checkpointed block keeps
        assert peak(ac=ac, compile=(True, True)) == peak(ac=ac)
    assert peak() > peak(compile=(True, False)) > peak(compile=(True, True))


def test_compile_lowers_the_step_time(tiny):
    _, _, g = tiny
    topo = preset("cluster", n_nodes=1, gpus_per_node=1)
    eager, comp = (rank_work(g, ParallelPlan(compile=c), topo) for c in ((), (True, True)))
    assert (comp.fwd_blocks < eager.fwd_blocks).all() and (comp.bwd_blocks < eager.bwd_blocks).all()
    assert (comp.fwd_pre, comp.fwd_post, comp.bwd_post, comp.optimizer) == (
        eager.fwd_pre, eager.fwd_post, eager.bwd_post, eager.optimizer)     # outside the blocks: nothing compiled
    t = lambda w, c: predict_step_time(w, ParallelPlan(compile=c), topo).step_seconds
    assert t(comp, (True, True)) < t(eager, ())


def _plan(*argv) -> tuple[int, str]:
    from static_dist.app.cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out): code = main(["plan", "--model", "tiny", "--world", "2", *argv])
    return code, " ".join(out.getvalue().split())         # rich wraps lines at the terminal's width


def test_plan_compile_prints_lower_memory_and_time():
    (c0, eager), (c1, comp) = _plan(), _plan("--compile")
    assert c0 == c1 == 0, (eager, comp)
    num = lambda pat, s: float(re.search(pat, s).group(1))
    mib = lambda s: num(r"\*?\*?peak\*?\*? \*?\*?([\d.]+) MiB", s)
    ms = lambda s: num(r"step time\*?\*?: ([\d.]+) ms", s)
    assert mib(comp) < mib(eager) and ms(comp) < ms(eager), (mib(comp), mib(eager), ms(comp), ms(eager))
    assert "compiled: 2 blocks, priced" in comp and "compiled:" not in eager


def test_compiled_reserved_from_a_few_blocks_as_from_the_whole_capture(tmp_path):
    """The caching allocator's replay of a compiled plan on 3 captured blocks extended to 8 (the search's) against the
    replay on all 8 captured: the compiled blocks' saved sets count in both, so the requested peaks agree and sit below
    the eager plan's (the extension once replayed the blocks eagerly: on torchtitan's compiled DeepSeek-V3 16B job its
    reserved fell below its own allocated peak)."""
    import dataclasses
    import transformers
    from static_dist.fsdp import FSDPPlan, block_units
    from static_dist.parallel import ParallelDims, predict_layout
    from static_dist.parallel.search import layout_reserved_peak, search_graph
    from static_dist.workload import load_workload
    transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                             num_key_value_heads=4, vocab_size=256,
                             max_position_embeddings=128).save_pretrained(tmp_path)
    w = load_workload(f"hf:{tmp_path}", batch=2, seq=32)
    (few, n, how), (whole, _, _) = search_graph(w, compile=True), search_graph(w, capture_blocks=8, compile=True)
    assert how == "3 of 8 blocks captured, the others identical" and len(whole.structure.main.blocks) == n == 8
    topo = preset("cluster", n_nodes=1, gpus_per_node=2)
    for ac in ("none", "selective"):
        plan = ParallelPlan(ParallelDims(dp_shard=2), ac=(ac,) * n, compile=(True,) * n,
                            fsdp=FSDPPlan(2, (2,), block_units(whole.structure.main.blocks)))
        ra, rb = layout_reserved_peak(whole, plan), layout_reserved_peak(few, plan, n)
        assert abs(rb.peak_requested / ra.peak_requested - 1) < 1e-3, (ac, ra, rb)
        assert rb.peak_reserved == ra.peak_reserved, (ac, ra, rb)
        assert abs(rb.peak_requested / predict_layout(whole, plan, topo).memory_bytes - 1) < 1e-3
        eager = layout_reserved_peak(few, dataclasses.replace(plan, compile=()), n)
        assert (rb.peak_requested < eager.peak_requested) == (ac == "none"), (ac, rb, eager)   # nothing checkpointed
