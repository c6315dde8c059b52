"""torchtitan's own code as the reference: a job applied by its parallelize function under a fake process group on
CPU (static_dist.titan.measure_titan), next to static_dist's prediction for the same layout of the same module tree."""
import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                                reason='torchtitan is not installed: pip install "static_dist[titan]"')

LAYERS, SEQ = 2, 256


def _job(**kw):
    from static_dist.titan import titan_job
    return titan_job("llama3_8b", **{"layers": LAYERS, "seq_len": SEQ, "local_batch": 1, "ac": "none", "loss_chunks": 0,
                                     **kw})


def _fsdp(shard: int, job):
    "static_dist's FSDP plan for torchtitan's apply_fsdp_to_decoder (torchtitan/distributed/fsdp.py): tok_embeddings "
    "and every block reshard after forward; [norm, lm_head], one fully_shard call, does not, nor the root; no explicit "
    "forward prefetch (it sets prefetch lists only with expert parallelism). With the chunked loss, ChunkedLossWrapper "
    "(components/loss.py) sets the group's reshard-after-forward back to True after the chunks and gathers it again "
    "for them: norm reshards, lm_head stays gathered from its first chunk to its last."
    from static_dist.fsdp import FSDPPlan, FSDPUnit
    head = ((FSDPUnit("norm", True), FSDPUnit("lm_head", False)) if job.loss_chunks else
            (FSDPUnit("norm", False, group=("lm_head",)),))
    units = (FSDPUnit("tok_embeddings", True), *(FSDPUnit(f"layers.{i}", True) for i in range(job.n_layers)),
             *head, FSDPUnit("", False))
    return FSDPPlan(shard, (shard,), units, param_dtype=job.param_dtype, reduce_dtype=job.reduce_dtype,
                    forward_prefetch=0)


def _predict(job, plan):
    from static_dist.parallel import predict_axis_counts, predict_parallel_memory, rank_profile
    from static_dist.titan import titan_workload
    g = titan_workload(job).graph(dtype=job.param_dtype)
    return (predict_parallel_memory(g, plan, job.master_dtype).peak_bytes,
            predict_axis_counts(rank_profile(g, plan, master_dtype=job.master_dtype), plan))


@pytest.fixture(scope="module")
def fsdp8():
    "(job, measurement, predicted peak, predicted counts) of the 8B width at 2 layers, FSDP over 8 ranks."
    from static_dist.parallel import ParallelDims, ParallelPlan
    from static_dist.titan import measure_titan
    job = _job(dp_shard=8)
    plan = ParallelPlan(dims=ParallelDims(dp_shard=8), fsdp=_fsdp(8, job))
    return (job, measure_titan(job, 8), *_predict(job, plan))


def test_titan_job_reads_the_registry():
    from static_dist.titan import titan_job
    j = titan_job("llama3_70b", attention="job")   # FACTS.md: tp 8, local batch 8, seq 8192, full AC, chunked loss
    assert (j.tp, j.local_batch, j.seq_len, j.ac, j.loss_chunks, j.attention) == (8, 8, 8192, "full", 8, "flex")
    assert (j.param_dtype, j.reduce_dtype, j.master_dtype) == ("bfloat16", "float32", "float32")


def test_fsdp_only_memory(fsdp8):
    job, m, pred, _ = fsdp8
    ratio = pred / m.peak_bytes
    print(f"FSDP 8, 8B width x {LAYERS} layers, seq {SEQ}: predicted {pred} / measured {m.peak_bytes} = {ratio:.4f}")
    # the issue asks for 1%; measured: 1.0007 (before FSDP2's free of the backward all-gather output at its copy-out
    # was modelled, 1.0877, the peak at tok_embeddings' backward)
    assert abs(ratio - 1) <= 0.01


def test_fsdp_only_collectives(fsdp8):
    _, m, _, counts = fsdp8
    measured = {f"dp.{k}": v for k, v in m.collectives.items() if v}
    print("measured", measured, "predicted", counts)
    assert measured == {"dp.all_gather": 7, "dp.reduce_scatter": 4}  # by hand: forward tok, 2 blocks, [norm, lm_head];
    # backward the 2 blocks and tok ([norm, lm_head] is not resharded after forward); one reduce-scatter per group
    assert measured == counts   # [norm, lm_head] one unit (FSDPUnit.group), so the root holds no parameters


# (case, job name, titan_job overrides): torchtitan's own checkpointing (FullAC, SelectiveAC) at a shape where the
# activations are most of the peak, the 70B width at its own full AC, and fp32 compute (no mixed precision)
CASES = {
    "full_ac": ("llama3_8b", dict(ac="full", seq_len=4096, local_batch=2)),
    "selective_ac": ("llama3_8b", dict(ac="selective", seq_len=4096, local_batch=2)),
    "70b_width": ("llama3_70b", dict(ac="full", seq_len=1024, local_batch=1, tp=1)),
    "fp32_params": ("llama3_8b", dict(ac="none", seq_len=1024, local_batch=2, param_dtype="float32")),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def titan_case(request):
    "(case, job, measurement, predicted peak, predicted counts) at FSDP 8, 2 layers, the blocks' AC from the job."
    from static_dist.parallel import ParallelDims, ParallelPlan
    from static_dist.titan import measure_titan, titan_ac_policy, titan_job
    name, kw = CASES[request.param]
    job = titan_job(name, layers=LAYERS, dp_shard=8, **{"loss_chunks": 0, **kw})
    plan = ParallelPlan(dims=ParallelDims(dp_shard=8), fsdp=_fsdp(8, job), ac=(titan_ac_policy(job),) * job.n_layers)
    return (request.param, job, measure_titan(job, 8), *_predict(job, plan))


def test_titan_layouts_memory_and_collectives(titan_case):
    case, job, m, pred, counts = titan_case
    ratio = pred / m.peak_bytes
    print(f"{case}: predicted {pred} / measured {m.peak_bytes} = {ratio:.5f}; counts {counts}")
    assert {f"dp.{k}": v for k, v in m.collectives.items() if v} == counts == {"dp.all_gather": 7,
                                                                              "dp.reduce_scatter": 4}
    # the issue asks for 1%; measured within 0.01% in every case. 0.1% tells torchtitan's selective policy from
    # static_dist's default one, which keeps the attention output that torchtitan's save list recomputes on CPU (1.008)
    assert abs(ratio - 1) <= 0.001, ratio


@pytest.fixture(scope="module")
def chunked8():
    "(job, measurement, predicted peak, predicted counts): the 8B width at 2 layers, seq 2048, the job's own chunked "
    "loss (8 chunks, ChunkedLossWrapper), FSDP over 8 ranks."
    from static_dist.parallel import ParallelDims, ParallelPlan
    from static_dist.titan import measure_titan
    job = _job(dp_shard=8, seq_len=2048, loss_chunks=8)
    plan = ParallelPlan(dims=ParallelDims(dp_shard=8), fsdp=_fsdp(8, job))
    return (job, measure_titan(job, 8), *_predict(job, plan))


def test_chunked_loss_fsdp(chunked8):
    "torchtitan's ChunkedLossWrapper under its FSDP: static_dist's capture of the same chunked step predicts it."
    job, m, pred, counts = chunked8
    ratio = pred / m.peak_bytes
    print(f"chunked loss, FSDP 8, seq 2048: predicted {pred} / measured {m.peak_bytes} = {ratio:.4f}; {counts}")
    # by hand: 4 forward gathers, 1 more for the chunks, 4 in backward (norm's, 2 blocks, tok); reduce-scatters: one
    # after the last chunk, norm's, 2 blocks', tok's
    assert {f"dp.{k}": v for k, v in m.collectives.items() if v} == counts == {"dp.all_gather": 9,
                                                                              "dp.reduce_scatter": 5}
    # measured 0.9920; 0.78 before the lm_head gradient's float32 accumulator across the chunks was modelled
    assert abs(ratio - 1) <= 0.01, ratio


def test_group_tracker_is_faithful(fsdp8):
    "measure_titan's tracker keeps torchtitan's [norm, lm_head] group whole: its peak equals MemTracker's (which "
    "does not touch FSDP's hooks) and its collectives those of an untracked step."
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from static_dist.cost.measure import comm_counter, comm_counts, to_empty_tied
    from static_dist.launch import process_group
    from static_dist.titan import apply_titan, titan_loss
    job, m, _, _ = fsdp8
    with process_group(fake_world=8):
        model = apply_titan(job, 8)
        with FakeTensorMode(allow_non_fake_inputs=True):
            to_empty_tied(model, "cpu")
            opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
            x, y = torch.randint(0, job.vocab, (1, SEQ)), torch.randint(0, job.vocab, (1, SEQ))
            def step(): titan_loss(model(x), y).backward(); opt.step(); opt.zero_grad()
            mt = MemTracker(); mt.track_external(model, opt, x, y)
            with mt: step()
            mt.reset_mod_stats()
            with mt, comm_counter() as cdm: step()
    assert sum(d["Total"] for d in mt.get_tracker_snapshot("peak").values()) == m.peak_bytes
    assert comm_counts(cdm) == m.collectives


# (case, job name, world, titan_job overrides): torchtitan's FSDP x TP with its sequence and loss parallelism (and
# once without sequence parallelism), its own checkpointing, and the 70B width at 8 layers on dp_shard 8 x tp 8
TP_CASES = {
    "8b_dp4_tp2": ("llama3_8b", 8, dict(dp_shard=4, tp=2, ac="none", seq_len=256)),
    "8b_dp4_tp2_no_sp": ("llama3_8b", 8, dict(dp_shard=4, tp=2, ac="none", seq_len=256, sequence_parallel=False)),
    "8b_dp4_tp2_full_ac": ("llama3_8b", 8, dict(dp_shard=4, tp=2, ac="full", seq_len=2048)),
    "8b_dp4_tp2_selective_ac": ("llama3_8b", 8, dict(dp_shard=4, tp=2, ac="selective", seq_len=2048)),
    "70b_8_layers_dp8_tp8": ("llama3_70b", 64, dict(dp_shard=8, tp=8, ac="full", seq_len=1024, layers=8)),
}


@pytest.fixture(scope="module", params=sorted(TP_CASES))
def titan_tp_case(request):
    """(case, job, measurement, plan, predicted peak, predicted counts): static_dist's own layout of the model's
    structure (`tp_layout`: styles, roles, sequence parallelism) for torchtitan's degrees, next to torchtitan's
    apply."""
    from static_dist.parallel import ParallelDims, ParallelPlan, tp_layout
    from static_dist.placement import block_spec, megatron_styles
    from static_dist.titan import measure_titan, titan_ac_policy, titan_job, titan_workload
    name, world, kw = TP_CASES[request.param]
    job = titan_job(name, **{"layers": LAYERS, "local_batch": 1, **kw})
    g = titan_workload(job).graph(dtype=job.param_dtype)
    styles, outer, sp = tp_layout(g, tuple(megatron_styles(block_spec(g)).items()), job.sequence_parallel)
    plan = ParallelPlan(
        dims=ParallelDims(dp_shard=job.dp_shard, tp=job.tp),
        tp_styles=styles,
        fsdp=_fsdp(job.dp_shard, job),
        ac=(titan_ac_policy(job),) * job.n_layers,
        sequence_parallel=sp,
        loss_parallel=True,
        tp_outer=outer,
        ac_early_stop=False,   # torchtitan's FullAC/SelectiveAC wrap with early_stop=False
    )
    return (request.param, job, measure_titan(job, world), plan, *_predict(job, plan))


def test_titan_tp_layouts(titan_tp_case):
    case, job, m, plan, pred, counts = titan_tp_case
    ratio = pred / m.peak_bytes
    print(f"{case}: predicted {pred} / measured {m.peak_bytes} = {ratio:.5f}; counts {counts}, measured {m.ops}")
    assert m.dims == (1, job.dp_shard, 1, job.tp, 1)
    assert plan.sequence_parallel == job.sequence_parallel
    # the roles static_dist reads from the structure are torchtitan's modules
    assert dict(plan.tp_styles)["attention.qkv_linear.wqkv"] == "colwise"
    assert {r: x for x, r in plan.tp_outer} == {"embedding": "tok_embeddings", "output": "lm_head",
                                                **({"norm": "norm"} if job.sequence_parallel else {})}
    from static_dist.parallel import counts_by_axis
    measured = counts_by_axis(m.ops)
    if not job.sequence_parallel and measured != counts:
        pytest.xfail(f"without sequence parallelism torchtitan 0.3.0 lays the activations out through spmd_types' "
                     f"invariant placement: measured {measured}, predicted {counts} (memory {ratio:.5f}); not traced")
    assert measured == counts
    # every case runs the jobs' own chunked loss (8 chunks, ChunkedLossWrapper): at seq 2048 the whole logits of
    # torchtitan's _LossParallelCrossEntropy (3 float32 copies) made 0.924/0.896 here, an xfail, before the step chunked
    # torchtitan's SelectiveAC keeps reduce_scatter_tensor outputs (its save list), which the single-device capture has
    # no op for: under sequence parallelism each row-parallel output's 1/tp is held from its forward to its block's
    # recompute (`sequence_parallel_buffers`); selective was 0.9893 without them (0.896 with whole logits), 0.9950 now
    assert abs(ratio - 1) <= 0.01, ratio


@pytest.mark.parametrize("titan_tp_case", ["70b_8_layers_dp8_tp8"], indirect=True)
def test_sequence_parallel_shards_a_70b_block_input(titan_tp_case):
    "With sequence parallelism a checkpointed block keeps 1/tp of its input per rank: (seq / tp) x dim x 2 bytes."
    from static_dist.parallel import predict_parallel_memory
    from static_dist.titan import titan_workload
    case, job, _, plan, _, _ = titan_tp_case
    import dataclasses
    g = titan_workload(job).graph(dtype=job.param_dtype)
    whole = dataclasses.replace(plan, sequence_parallel=False,
                                tp_outer=tuple(x for x in plan.tp_outer if x[1] != "norm"))
    act = lambda p: predict_parallel_memory(g, p, job.master_dtype).ranks[0].at_peak.get("activations", 0)
    # full checkpointing keeps each block's input: 8 blocks of 1024 x 8192 bf16 tokens, whole or 1/8 per rank
    per_block = 1024 * 8192 * 2
    assert act(whole) >= 8 * per_block
    assert act(plan) < act(whole) - 8 * per_block * (1 - 1 / 8) * 0.99


def test_missing_torchtitan_says_how_to_install(monkeypatch):
    import sys
    from static_dist.titan import TitanError, titan_job
    monkeypatch.setitem(sys.modules, "torchtitan.models.llama3", None)    # import of it fails as if not installed
    with pytest.raises(TitanError, match=r'pip install "static_dist\[titan\]"'): titan_job("llama3_8b")


def test_titan_float8_job_as_torchtitan_applies_it():
    """torchtitan's 405B job keeps its Float8 (rowwise recipe, lm_head filtered: its Float8LinearConverter) at 2 layers
    under FSDP 8: torchtitan's model and parallelize function measured by FSDPMemTracker, against static_dist's
    prediction from torchao's ops captured on fake tensors (`titan_plan` carries the captured recipe)."""
    from static_dist.parallel import float8_of, predict_axis_counts, predict_parallel_memory, rank_profile
    from static_dist.titan import measure_titan, titan_job, titan_plan, titan_workload
    job = titan_job("llama3_405b", layers=LAYERS, seq_len=SEQ, local_batch=1, ac="none", dp_shard=8, tp=1, pp=1,
                    cp=1, compile=False)
    g = titan_workload(job).graph(dtype=job.param_dtype)
    plan = titan_plan(job, g, 8, LAYERS)
    assert (job.float8_recipe, float8_of(g), plan.float8) == ("rowwise",) * 3
    pred = predict_parallel_memory(g, plan, job.master_dtype).peak_bytes
    counts = predict_axis_counts(rank_profile(g, plan, master_dtype=job.master_dtype), plan)
    m = measure_titan(job, 8)
    print(f"405B width Float8 rowwise, FSDP 8: predicted {pred} / measured {m.peak_bytes} = {pred / m.peak_bytes:.6f}")
    assert abs(pred / m.peak_bytes - 1) <= 0.001      # measured: 0.999999 (the issue asks for 1%)
    assert {f"dp.{k}": v for k, v in m.collectives.items() if v} == counts


@pytest.mark.parametrize("ac, seq", [("none", 2048), ("full", 8192)])
def test_whole_logits_loss_parallel_as_torchtitan_runs_it(ac, seq):
    """A job without the chunked loss at tp 2: torchtitan's `_LossParallelCrossEntropy` (components/loss.py) holds the
    shifted logits beside their exp in forward and the zeroed gradient, the exp and their sum at once in backward, local
    float32 copies one device's kernels do not make (`memory.loss_parallel_buffers`, the same as torch's
    loss_parallel()). The 8B width, 2 layers, dp_shard 4 x tp 2: 0.901 at 2,048 tokens and 0.813 at 8,192 with full
    checkpointing before; 0.9983 and 0.9969 now."""
    from static_dist.parallel import predict_parallel_memory
    from static_dist.titan import measure_titan, titan_job, titan_plan, titan_workload
    job = titan_job("llama3_8b", layers=2, seq_len=seq, local_batch=1, dp_shard=4, tp=2, loss_chunks=0, ac=ac)
    g = titan_workload(job).graph(dtype=job.param_dtype)
    plan = titan_plan(job, g, 8)
    assert plan.loss_parallel and not job.loss_chunks
    ratio = predict_parallel_memory(g, plan, job.master_dtype).peak_bytes / measure_titan(job, 8).peak_bytes
    assert abs(ratio - 1) <= 0.005, ratio


@pytest.mark.parametrize("tp", [1, 2])
def test_chunked_loss_holds_each_chunks_logits_as_torchtitan_does(tp):
    """ChunkedLossWrapper binds each chunk's logits to a local (`logits = lm_head(h_chunk)`), so they live through the
    chunk's backward and the next chunk's forward. At 8,192 tokens per rank one chunk's bf16 logits (1,024 x 128,256 x
    2 B = 250 MiB) were missing from the prediction: 0.983 of torchtitan's peak before the step bound them too. Under
    sequence parallelism the final norm gathers its output whole for the chunks (torchtitan's pre_lm_head_norm_config):
    at tp 2 that copy was counted at 1/tp (0.979 before, with the logits bound)."""
    from static_dist.parallel import predict_parallel_memory
    from static_dist.titan import measure_titan, titan_job, titan_plan, titan_workload
    job = titan_job("llama3_8b", layers=2, seq_len=2048, local_batch=4, dp_shard=2, tp=tp, loss_chunks=8)
    g = titan_workload(job).graph(dtype=job.param_dtype)
    ratio = predict_parallel_memory(g, titan_plan(job, g, 2 * tp), job.master_dtype).peak_bytes / measure_titan(
        job, 2 * tp).peak_bytes
    print(f"predicted / measured {ratio:.4f}")
    if tp > 1 and abs(ratio - 1) > 0.005:
        pytest.xfail(
            f"predicted/measured {ratio:.4f} (0.9732 before the selective policy's saved reduce-scatter outputs, "
            "0.9697 before the gathered norm output was counted whole): at tp 2 torchtitan's chunked loss holds about "
            "110 MiB more at 8,192 tokens per rank, not yet traced"
        )
    assert abs(ratio - 1) <= 0.005, ratio     # tp 1: 0.9972, 48.5 MiB (1.5 B x dim per token) not yet traced


def _module_backward_peaks(job, world):
    "{module: its backward peak} of rank 0 under torch's MemTracker (every module, not only FSDP's), steady step."
    import warnings
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from static_dist.cost.measure import to_empty_tied
    from static_dist.launch import process_group
    from static_dist.titan import apply_titan, titan_loss
    with process_group(fake_world=world):
        m = apply_titan(job, world)
        with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            to_empty_tied(m, "cpu")
            opt = torch.optim.AdamW(m.parameters())
            x, y = (torch.randint(0, job.vocab, (job.local_batch, job.seq_len)) for _ in range(2))
            step = lambda: (titan_loss(m(x), y).backward(), opt.step(), opt.zero_grad())
            step()
            mt = MemTracker(); mt.track_external(m, opt)
            with mt: step()
    out = {}
    for st in mt.memory_tracking.values():
        name = st.mod_fqn.split(".", 1)[-1].replace("_checkpoint_wrapped_module.", "")
        for state, snaps in st.snapshots.items():
            if "PEAK_BW" in str(state):
                out[name] = max([out.get(name, 0)] + [d["Total"] for s in snaps for d in s.values()])
    return out


@pytest.mark.parametrize("ac", ["none", "full"])
def test_sequence_parallel_buffers_module_by_module(ac):
    """tp 4 with sequence parallelism at the 70B width (2,048 tokens): each block module's backward peak is torch's
    MemTracker's within 1 MiB. A row-parallel linear's gathered output gradient (`sequence_parallel_buffers`) was
    missing: the attention output projection and the FFN down projection were exactly one whole [tokens, dim] (32 MiB)
    short, every other module already within 1 MiB."""
    from static_dist.parallel import predict_parallel_memory
    from static_dist.titan import titan_job, titan_plan, titan_workload
    job = titan_job("llama3_70b", layers=2, seq_len=2048, local_batch=1, dp_shard=2, tp=4, loss_chunks=0, ac=ac)
    g = titan_workload(job).graph(dtype=job.param_dtype)
    r = predict_parallel_memory(g, titan_plan(job, g, 8), job.master_dtype).ranks[0]
    total, pred = sum(r.curves.values()), {}
    for i, o in enumerate(g.ops):
        if o.phase == "backward" and o.module.startswith("layers.0."):
            pred[o.module] = max(pred.get(o.module, 0), total[i])
    meas = _module_backward_peaks(job, 8)
    mods = ["attention.wo", "feed_forward.w2", "feed_forward.w3", "ffn_norm", "attention.qkv_linear.wqkv",
            "attention_norm"]
    for k in (f"layers.0.{m}" for m in mods):
        assert abs(pred[k] - meas[k]) < 2**20, (k, pred[k] - meas[k])
