"""find_structure on models nobody here wrote: blocks at any depth, MoE experts inside blocks, HF GPT-2 and Llama on meta."""
import pytest
import torch
import torch.nn as nn

from static_dist.structure import BlockStack, LinearInfo, ModelStructure, StructureError, find_structure
from static_dist.zoo import count_params, get_model


class Block(nn.Module):
    def __init__(self, dim=16, heads=4, experts=0):
        super().__init__()
        self.num_heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)) for _ in range(experts))


class Wrapped(nn.Module):
    "Blocks at `model.layers` and, separately, at `transformer.h` (a second, smaller stack)."
    def __init__(self):
        super().__init__()
        self.model = nn.Module(); self.model.layers = nn.ModuleList(Block(32, 8) for _ in range(3))
        self.transformer = nn.Module(); self.transformer.h = nn.ModuleList(Block(16, 4) for _ in range(2))


def test_blocks_at_depth():
    st = find_structure(Wrapped())
    assert [s.path for s in st.stacks] == ["model.layers", "transformer.h"]      # most parameters first
    m = st.main
    assert m.blocks == ("model.layers.0", "model.layers.1", "model.layers.2") and m.block_type == "Block"
    assert m.linears == (LinearInfo("qkv", 32, 96, True), LinearInfo("out", 32, 32, False))
    assert (m.n_heads, m.n_kv_heads, m.head_dim) == (8, 8, 4)
    assert m.params_per_block == 32 * 96 + 96 + 32 * 32
    assert st.stacks[1].blocks == ("transformer.h.0", "transformer.h.1")
    assert m.index_of("model.layers.2.qkv.bias") == 2 and m.index_of("transformer.h.0") is None


def test_moe_experts_inside_blocks_are_stacks_but_not_main():
    model = nn.Module(); model.layers = nn.ModuleList(Block(16, 4, experts=4) for _ in range(3))
    st = find_structure(model)
    assert st.main.path == "layers" and len(st.main.blocks) == 3
    assert st.main.params_per_block == sum(p.numel() for p in model.layers[0].parameters())
    experts = [s.path for s in st.stacks[1:]]
    assert experts == ["layers.0.experts", "layers.1.experts", "layers.2.experts"]
    assert st.stacks[1].linears == (LinearInfo("0", 16, 32, True), LinearInfo("1", 32, 16, True))
    assert st.stacks[1].n_heads == 0     # experts show no attention


def test_root_sequential_and_no_repeats():
    seq = nn.Sequential(*[Block() for _ in range(4)])
    assert find_structure(seq).main.path == "" and find_structure(seq).main.blocks == ("0", "1", "2", "3")
    assert find_structure(nn.Linear(3, 3)).main is None
    assert find_structure(nn.Linear(3, 3)) == ModelStructure()


def test_different_widths_are_not_a_stack():
    model = nn.Module(); model.layers = nn.ModuleList([Block(16, 4), Block(32, 4)])
    assert find_structure(model).stacks == ()
    model.layers = nn.ModuleList([Block(16, 4), Block(16, 4), Block(32, 4)])   # one odd one out spoils the container
    assert find_structure(model).stacks == ()
    model.layers = nn.ModuleList([Block(16, 4), Block(16, 4)]); model.layers[1].qkv.weight.data = model.layers[1].qkv.weight.data.half()
    assert find_structure(model).stacks == ()                                   # same shapes, other dtype


def test_same_module_twice_is_not_a_stack():
    b = Block()
    model = nn.Module(); model.layers = nn.ModuleList([b, b])
    assert find_structure(model).stacks == ()


@pytest.mark.parametrize("name", ["tiny", "tiny-moe", "llama3-70b"])
def test_zoo_llama_on_meta(name):
    model = get_model(name).build(device="meta")
    c, st = model.cfg, find_structure(model)
    assert st.main.path == "layers" and len(st.main.blocks) == c.n_layers
    assert (st.main.n_heads, st.main.n_kv_heads, st.main.head_dim) == (c.n_heads, c.n_kv_heads, c.head_dim)
    outer = count_params(model) - st.main.params_per_block * c.n_layers
    assert outer == sum(p.numel() for n, p in model.named_parameters() if not n.startswith("layers."))


def test_structure_round_trip_and_errors():
    st = find_structure(Wrapped())
    assert ModelStructure.from_dict(st.to_dict()) == st
    d = st.to_dict(); d["stacks"][1]["blocks"][0] = 3
    with pytest.raises(StructureError, match=r"structure\.stacks\[1\]\.blocks\[0\]: expected a string, found 3$"): ModelStructure.from_dict(d)
    d = st.to_dict(); d["stacks"][0]["linears"][0]["bias"] = 1
    with pytest.raises(StructureError, match=r"linears\[0\]\.bias: expected true or false, found 1$"): ModelStructure.from_dict(d)
    with pytest.raises(StructureError, match=r"structure: expected a JSON object, found \[\]"): ModelStructure.from_dict([])


# --- Hugging Face transformers (an optional extra): built from tiny configs on the meta device --------------------
def _transformers():
    "The optional 'hf' extra (a dev dependency: imported, so a missing one fails rather than skips)."
    import transformers
    return transformers


def _hf(cfg):
    with torch.device("meta"): return _transformers().AutoModelForCausalLM.from_config(cfg)


def test_hf_gpt2():
    cfg = _transformers().GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=100, n_positions=64)
    model = _hf(cfg)
    st = find_structure(model)
    m = st.main
    assert m.path == "transformer.h" and m.blocks == tuple(f"transformer.h.{i}" for i in range(3))
    assert m.block_type == "GPT2Block"
    # Conv1D stores (in, out): c_attn is 32 -> 3*32, the MLP is 32 -> 4*32 -> 32
    assert [(l.name, l.in_features, l.out_features, l.bias) for l in m.linears] == [
        ("attn.c_attn", 32, 96, True), ("attn.c_proj", 32, 32, True), ("mlp.c_fc", 32, 128, True), ("mlp.c_proj", 128, 32, True)]
    assert (m.n_heads, m.n_kv_heads, m.head_dim) == (4, 4, 8)
    assert m.params_per_block == sum(p.numel() for p in model.transformer.h[0].parameters())
    assert all(p.is_meta for p in model.parameters())


def test_hf_llama_gqa():
    cfg = _transformers().LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                                   intermediate_size=96, vocab_size=100)
    st = find_structure(_hf(cfg))
    m = st.main
    assert m.path == "model.layers" and m.blocks == ("model.layers.0", "model.layers.1")
    assert [(l.name, l.in_features, l.out_features) for l in m.linears] == [
        ("self_attn.q_proj", 64, 64), ("self_attn.k_proj", 64, 16), ("self_attn.v_proj", 64, 16),
        ("self_attn.o_proj", 64, 64), ("mlp.gate_proj", 64, 96), ("mlp.up_proj", 64, 96), ("mlp.down_proj", 96, 64)]
    assert (m.n_heads, m.n_kv_heads, m.head_dim) == (8, 2, 8)
