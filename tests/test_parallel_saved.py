"""A selective policy's saved bytes, predicted from the capture and measured by MemTracker on the real model, on
Hugging Face architectures (the notebook 45f checks the zoo's Llama)."""
import pytest

from static_dist.parallel import SelectivePolicy, verify_selective
from static_dist.workload import load_workload


@pytest.fixture(scope="module")
def hf_tiny_qwen2(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("hf_qwen2")
    transformers.Qwen2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=128, vocab_size=256, max_position_embeddings=256).save_pretrained(d)
    return f"hf:{d / 'config.json'}"


@pytest.mark.parametrize("source", ["hf_tiny_llama", "hf_tiny_qwen2"])
@pytest.mark.parametrize("policy", [SelectivePolicy(), SelectivePolicy(mm_recompute_every=0)], ids=["every-other-mm", "every-mm"])
def test_selective_saved_bytes_within_2_percent(source, policy, request):
    w = load_workload(request.getfixturevalue(source), batch=2, seq=64)
    v = verify_selective(w, policy)
    pred, meas = v["policy"]
    assert meas > 0 and abs(pred / meas - 1) < 0.02, v
