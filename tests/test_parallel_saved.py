"""A selective policy's saved bytes, predicted from the capture and measured by MemTracker on the real model, on
Hugging Face architectures (the notebook 45f checks the zoo's Llama)."""
import pytest

from static_dist.graph.policies import SelectiveOps
from static_dist.parallel import verify_selective
from static_dist.workload import load_workload


def _tiny_qwen2(tmp_path_factory, name: str, **config) -> str:
    "An hf: source of a 2-layer, width-64 Qwen2 (4 heads, 2 kv heads unless `config` says otherwise)."
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp(name)
    transformers.Qwen2Config(
        **{
            **dict(
                num_hidden_layers=2,
                hidden_size=64,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=128,
                vocab_size=256,
                max_position_embeddings=256,
            ),
            **config,
        }
    ).save_pretrained(d)
    return f"hf:{d / 'config.json'}"


@pytest.fixture(scope="module")
def hf_tiny_qwen2(tmp_path_factory): return _tiny_qwen2(tmp_path_factory, "hf_qwen2")


@pytest.fixture(scope="module")
def hf_tiny_qwen2_mha(tmp_path_factory): return _tiny_qwen2(tmp_path_factory, "hf_qwen2_mha", num_key_value_heads=4)


@pytest.fixture(scope="module")
def hf_tiny_qwen2_tied(tmp_path_factory):
    return _tiny_qwen2(tmp_path_factory, "hf_qwen2_tied", tie_word_embeddings=True)


@pytest.mark.parametrize("source", ["hf_tiny_llama", "hf_tiny_qwen2"])
@pytest.mark.parametrize("policy", [SelectiveOps(), SelectiveOps(mm_recompute_every=0)],
                         ids=["every-other-mm", "every-mm"])
def test_selective_saved_bytes_within_2_percent(source, policy, request):
    w = load_workload(request.getfixturevalue(source), batch=2, seq=64)
    v = verify_selective(w, policy)
    pred, meas = v["policy"]
    assert meas > 0 and abs(pred / meas - 1) < 0.02, v


# Tensor parallelism on HF attention: SDPA's float mask (made inside self_attn from replicated tensors, whole on every
# rank) and grouped-query attention's repeat_kv (a copy in the capture, a view of the one kv head a rank holds) were
# counted 1/tp and twice: the old model was 5.3% (GQA) and 6.9% (MHA) off here, and failed the HF Llama too.
@pytest.mark.parametrize("source", ["hf_tiny_qwen2", "hf_tiny_qwen2_mha", "hf_tiny_llama"])
def test_tp_peak_on_hf_attention_within_1_percent(source, request):
    from static_dist.fsdp import FSDPPlan, block_units
    from static_dist.parallel import ParallelDims, ParallelPlan, verify_parallel
    from static_dist.placement import block_spec, megatron_styles
    w = load_workload(request.getfixturevalue(source), batch=1, seq=256)
    g = w.graph()
    styles = tuple((n, s) for n, s in megatron_styles(block_spec(g)).items() if s != "replicate")
    plan = ParallelPlan(
        ParallelDims(dp_shard=2, tp=2), styles, fsdp=FSDPPlan(2, (2,), block_units(g.structure.main.blocks))
    )
    v = verify_parallel(w, plan, g)
    assert abs(v.predicted_bytes / v.measured_bytes - 1) < 0.01, v
    assert v.predicted_counts == v.measured_counts, v


# One rank, tied head and embedding: the measurement materialised the model with `to_empty`, which unties them, and
# measured one weight, gradient and optimizer state more than the model trains with (0.962 here before).
def test_one_rank_tied_model_measured_tied(hf_tiny_qwen2_tied):
    from static_dist.parallel import ParallelPlan, verify_parallel
    w = load_workload(hf_tiny_qwen2_tied, batch=1, seq=256)
    v = verify_parallel(w, ParallelPlan(), w.graph())
    assert abs(v.predicted_bytes / v.measured_bytes - 1) < 0.01, v


def test_verify_refuses_masters_the_plan_does_not_compute_from(hf_tiny_llama):
    "A graph captured in bf16 with fp32 masters needs the plan to compute in bf16: else the two sides differ."
    from static_dist.parallel import ParallelDims, ParallelPlan, ParallelPlanError, verify_parallel
    w = load_workload(hf_tiny_llama, batch=1, seq=64)
    with pytest.raises(ParallelPlanError, match="param_dtype='bfloat16'"):
        verify_parallel(w, ParallelPlan(ParallelDims(dp_shard=2)), w.graph(dtype="bfloat16"))


def test_mixed_precision_needs_fsdp(hf_tiny_llama):
    "One data-parallel rank applies no FSDP, so a plan's param_dtype would compute in the masters' dtype: refused."
    from static_dist.fsdp import FSDPPlan, FSDPUnit
    from static_dist.parallel import ParallelDims, ParallelPlan, ParallelPlanError, verify_parallel
    w = load_workload(hf_tiny_llama, batch=1, seq=64)
    plan = ParallelPlan(ParallelDims(tp=1), fsdp=FSDPPlan(1, (1,), (FSDPUnit(""),), param_dtype="bfloat16"))
    with pytest.raises(ParallelPlanError, match="one data-parallel rank"):
        verify_parallel(w, plan, w.graph(dtype="bfloat16"))
