"""find_structure on models nobody here wrote: blocks at any depth, MoE experts inside blocks, HF GPT-2 and Llama on
meta."""
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
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)) for _ in range(experts)
        )


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
    model.layers = nn.ModuleList([Block(16, 4), Block(16, 4), Block(32, 4)])   # the odd one out is no block of the run
    assert [s.blocks for s in find_structure(model).stacks] == [("layers.0", "layers.1")]
    model.layers = nn.ModuleList([Block(16, 4), Block(16, 4)])
    model.layers[1].qkv.weight.data = model.layers[1].qkv.weight.data.half()
    assert find_structure(model).stacks == ()                                   # same shapes, other dtype


def test_same_module_twice_is_not_a_stack():
    b = Block()
    model = nn.Module(); model.layers = nn.ModuleList([b, b])
    assert find_structure(model).stacks == ()



# --- blocks inside a Sequential beside other modules, and torchvision's ResNet nesting (written here: torchvision
# does not import against this torch) --------------------------------------------------------------------------------
def test_identical_blocks_between_a_stem_and_a_head():
    """Four identical sibling blocks in a Sequential that also holds a stem and a head, as the model and as a child:
    the four are the stack (before: 'no stack of repeated blocks', since the whole container had to be alike)."""
    seq = nn.Sequential(nn.Linear(8, 16), *[Block() for _ in range(4)], nn.Linear(16, 2))
    st = find_structure(seq)
    assert (st.main.path, st.main.blocks, st.main.block_type) == ("", ("1", "2", "3", "4"), "Block")
    assert (
        (st.main.n_heads, st.main.head_dim) == (4, 4)
        and st.main.index_of("0") is None
        and st.main.index_of("5") is None
    )
    model = nn.Module(); model.body = seq
    assert find_structure(model).main.blocks == ("body.1", "body.2", "body.3", "body.4")
    seq2 = nn.Sequential(*[Block() for _ in range(2)], nn.Linear(16, 16), *[Block() for _ in range(3)])
    assert [s.blocks for s in find_structure(seq2).stacks] == [("3", "4", "5"), ("0", "1")]   # two runs, larger first


class BasicBlock(nn.Module):
    "torchvision.models.resnet.BasicBlock: one ReLU called twice; a downsampling block starts each later stage."
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False); self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False); self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else None)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet(nn.Module):
    "torchvision's ResNet layout (stem, layer1..layer4 Sequentials, head) with ResNet-34's depths at small widths."
    def __init__(self, widths=(8, 16, 32, 64), depths=(3, 4, 6, 3)):
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 7, 2, 3, bias=False); self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu, self.maxpool = nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)
        cin = widths[0]
        for i, (w, d) in enumerate(zip(widths, depths)):
            setattr(self, f"layer{i + 1}", nn.Sequential(*[BasicBlock(cin if j == 0 else w, w, 1 if i == 0 or j else 2)
                                                            for j in range(d)]))
            cin = w
        self.avgpool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(widths[-1], 10)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.avgpool(x).flatten(1))


def test_resnet_stages_are_stacks_after_their_downsampling_block():
    """Each stage after the first opens with a downsampling block unlike the rest: the rest are the stage's stack.
    Stage 1 (no downsampling) is one stack of 3; the main stack is the one with most parameters (stage 4's two)."""
    st = find_structure(ResNet())
    got = {s.path: s.blocks for s in st.stacks}
    assert got == {"layer1": ("layer1.0", "layer1.1", "layer1.2"), "layer2": ("layer2.1", "layer2.2", "layer2.3"),
                   "layer3": tuple(f"layer3.{i}" for i in range(1, 6)), "layer4": ("layer4.1", "layer4.2")}
    assert st.main.path == "layer4" and st.main.block_type == "BasicBlock"
    assert st.main.params_per_block == sum(p.numel() for p in ResNet().layer4[1].parameters())
    with torch.device("meta"): assert find_structure(ResNet()) == st       # shapes only: the same on meta

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
    with pytest.raises(StructureError, match=r"structure\.stacks\[1\]\.blocks\[0\]: expected a string, found 3$"):
        ModelStructure.from_dict(d)
    d = st.to_dict(); d["stacks"][0]["linears"][0]["bias"] = 1
    with pytest.raises(StructureError, match=r"linears\[0\]\.bias: expected true or false, found 1$"):
        ModelStructure.from_dict(d)
    with pytest.raises(StructureError, match=r"structure: expected a JSON object, found \[\]"):
        ModelStructure.from_dict([])


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
        ("attn.c_attn", 32, 96, True),
        ("attn.c_proj", 32, 32, True),
        ("mlp.c_fc", 32, 128, True),
        ("mlp.c_proj", 128, 32, True),
    ]
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
