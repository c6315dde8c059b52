"""Mixture-of-experts capture (issue 32, item 1): the MoE layers read from the module tree of the zoo's, transformers'
and torchtitan's models, and the routing assumption a captured step records, each checked against a hand count from
the model's config (not against the code's own output)."""
import contextlib
import io
import json

import pytest
import torch

from hf_configs import hf_source
from static_dist.app.cli import main
from static_dist.graph import capture
from static_dist.moe import Routing, RoutingError, active_params, find_moe, routing_from
from static_dist.workload import load_workload

B, S = 2, 16                     # every capture here: batch 2 x seq 16 = 32 tokens
T = B * S


def _expected(per_expert, n_experts, top_k, router, shared=0, itemsize=2):
    "The hand counts a layer should show: (experts, top-k, expert bytes, router params, shared params, active)."
    return n_experts, top_k, n_experts * per_expert * itemsize, router, shared, router + shared + top_k * per_expert


def _seen(layer):
    return (layer.n_experts, layer.top_k, layer.expert_bytes, layer.router_params, layer.shared_params,
            layer.active_params)


def _routed_rows(g, layer_meta):
    "Rows of the first operand of each forward grouped or batched expert matmul run in the layer's experts module."
    by_id = {t.id: t for t in g.tensors}
    return [by_id[o.inputs[0]].shape for o in g.ops if o.phase == "forward" and o.flops
            and ("grouped_mm" in o.op or "bmm" in o.op) and _under(o.module, layer_meta["experts"])]


def _under(fqn, top): return fqn == top or fqn.startswith(top + ".")


def test_routing_assumption_by_hand():
    "The busiest expert's rows: 32 tokens top-2 of 8 experts is a mean of 8; 1.5 x that is 12; at most every token."
    assert routing_from(None) == Routing() and routing_from("balanced").busiest(T, 8, 2) == 8
    assert routing_from("imbalance=1.5").busiest(T, 8, 2) == 12
    assert routing_from("capacity=1.25").busiest(T, 8, 2) == 10
    assert routing_from("imbalance=8").busiest(T, 4, 2) == T
    assert Routing().busiest(10, 8, 2) == 3                       # 2.5 rows on average: one expert has 3
    for bad in ("imbalance=0.99", "capacity=0", "capacity=-1", "imbalance=nan", "uniform", "imbalance"):
        with pytest.raises(RoutingError, match="give 'balanced'"): routing_from(bad)


def test_zoo_moe():
    """tiny-moe (dim 64, SwiGLU experts of hidden 192, 4 experts, top-2, capacity factor 1.25): an expert holds
    3·64·192 parameters, the router 4·64. The zoo's experts run on (E, C, dim) slots with C = ⌈1.25·T·2/4⌉ = 20: the
    capture, stating the layers' own capacity=1.25 when given no assumption, records the same 20 as the busiest
    expert's rows."""
    w = load_workload("tiny-moe", batch=B, seq=S)
    layers = find_moe(w.build_model("meta"))
    assert [l.path for l in layers] == ["layers.0.moe", "layers.1.moe"]
    assert _seen(layers[0]) == _expected(3 * 64 * 192, 4, 2, 4 * 64, itemsize=4)
    assert layers[0].capacity_factor == 1.25
    g = w.graph()                                                     # no assumption given: the layers' own capacity
    assert g.meta["routing"] == dict(kind="capacity", factor=1.25, assumption="capacity=1.25")
    for m in g.meta["moe"]:
        assert (m["tokens"], m["routed"], m["busiest"]) == (T, 2 * T, 20)
        per_expert = {s[:2] for s in _routed_rows(g, m) if len(s) == 3 and s[0] == 4}   # bmm of (E, C, width)
        assert per_expert == {(4, 20)}, per_expert                       # the model's own slots
    balanced = w.graph(routing="balanced")                            # another assumption, another capture
    assert balanced.meta["routing"]["assumption"] == "balanced"
    assert [m["busiest"] for m in balanced.meta["moe"]] == [16, 16]


HF = {   # transformers config, its fields, and the hand count of one MoE layer (bf16: 2 bytes a parameter)
    "mixtral": ("MixtralConfig", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_local_experts=4,
                                      num_experts_per_tok=2),
                # experts: gate_up (2·96)×64 + down 64×96; router 4×64; no shared expert
                _expected(2 * 96 * 64 + 64 * 96, 4, 2, 4 * 64), 2),
    "qwen3-moe": ("Qwen3MoeConfig", dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                         num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, head_dim=16),
                  _expected(3 * 64 * 32, 8, 2, 8 * 64), 2),
    # DeepSeek-V3: layer 0 dense (first_k_dense_replace=1); shared experts of n_shared·moe_intermediate = 32 hidden
    "deepseek-v3": ("DeepseekV3Config", dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                             num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8,
                                             n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                                             q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                             v_head_dim=16, num_key_value_heads=4),
                    _expected(3 * 64 * 32, 8, 2, 8 * 64, shared=3 * 64 * 32), 2),
}


@pytest.mark.parametrize("name", list(HF))
def test_hf_moe(tmp_path_factory, name):
    """Each layer's experts, top-k, bytes, router, shared and active parameters by hand; the capture (grouped_mm
    experts, bf16) states the balanced assumption and an imbalance, and every routed row (T·k) goes through each
    grouped matmul of the layer's experts once."""
    config, fields, expected, n_moe = HF[name]
    src = hf_source(tmp_path_factory, config, num_attention_heads=4, vocab_size=256, max_position_embeddings=128,
                    **{"num_key_value_heads": 2, **fields})
    w = load_workload(src, batch=B, seq=S, dtype="bfloat16")
    layers = find_moe(w.build_model("meta"))
    assert len(layers) == n_moe and all(_seen(l) == expected for l in layers), [_seen(l) for l in layers]
    assert all(l.shared == ((f"{l.path}.shared_experts",) if name == "deepseek-v3" else ()) for l in layers)
    g = w.graph(routing="imbalance=1.5")
    k, e = expected[1], expected[0]
    assert g.meta["routing"]["assumption"] == "imbalance=1.5"
    busiest = -(-3 * T * k // (2 * e))                                 # ⌈1.5·T·k/E⌉
    assert [(m["tokens"], m["routed"], m["busiest"]) for m in g.meta["moe"]] == [(T, T * k, busiest)] * n_moe
    for m in g.meta["moe"]:
        rows = _routed_rows(g, m)
        assert rows and {r[0] for r in rows} == {T * k}, rows
    total = sum(p.numel() for p in w.build_model("meta").parameters())
    per_expert = (expected[5] - expected[3] - expected[4]) // k        # active = router + shared + k · one expert
    assert g.meta["moe_params"] == dict(total=total, active=total - n_moe * (e - k) * per_expert)


def test_eager_experts_are_reported_not_guessed(tmp_path_factory):
    "transformers' eager experts loop over `nonzero` of the expert mask: the capture names the layer, module and op."
    config, fields = HF["mixtral"][:2]
    w = load_workload(hf_source(tmp_path_factory, config, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                max_position_embeddings=128, **fields), batch=1, seq=8, dtype="bfloat16")
    model = w.build_model("meta")
    model.config._experts_implementation = "eager"
    args, kwargs, targets = w.inputs("meta")
    with pytest.raises(RoutingError) as e:
        capture(model, args, example_kwargs=kwargs, targets=targets, loss_fn=w.loss, routing="imbalance=2")
    said = str(e.value)
    assert "MoE layer 'model.layers.0.mlp'" in said and "aten.nonzero.default in module 'model.layers.0.mlp.experts'" \
        in said and "imbalance=2 not applied" in said and len(said.splitlines()) == 1


def _titan_model(registry: str, job: str, device="meta", force_balance=False):
    """torchtitan's job model cut to 2 layers, attention as SDPA (no block mask without its data loader), in bf16;
    `force_balance`: its routers' `_debug_force_load_balance` (round-robin, exactly balanced)."""
    import importlib
    pytest.importorskip("torchtitan")
    from torchtitan.models.common.attention import ScaledDotProductAttention
    mc = getattr(importlib.import_module(f"torchtitan.models.{registry}.config_registry"), job)().model_spec.model
    mc.layers = mc.layers[:2]
    for blk in mc.layers:
        blk.attention.inner_attention = ScaledDotProductAttention.Config()
        if getattr(blk, "moe", None) is not None: blk.moe.router._debug_force_load_balance = force_balance
    with torch.device(device): return mc.build().to(torch.bfloat16)


# torchtitan 0.3.0's registries: qwen3 debugmodel_moe (qwen3/__init__.py: dim 256, moe_hidden_dim 768, 64 experts,
# top_k 8, no shared experts); deepseek_v3 debugmodel (dim 256, moe_hidden_dim 256, 8 experts, router_top_k 3,
# 2 shared experts: hidden 512, layer 0 dense)
TITAN = {"qwen3_moe_debug": ("qwen3", _expected(3 * 256 * 768, 64, 8, 64 * 256), ["layers.0.moe", "layers.1.moe"]),
         "deepseek_v3_debugmodel": ("deepseek_v3", _expected(3 * 256 * 256, 8, 3, 8 * 256, shared=3 * 256 * 512),
                                    ["layers.1.moe"])}


@pytest.mark.parametrize("job", list(TITAN))
def test_titan_moe(job):
    registry, expected, paths = TITAN[job]
    m = _titan_model(registry, job)
    layers = find_moe(m)
    assert [l.path for l in layers] == paths and all(_seen(l) == expected for l in layers), [_seen(l) for l in layers]
    first = paths[0]
    assert (layers[0].experts, layers[0].router) == (f"{first}.routed_experts.inner_experts", f"{first}.router.gate")
    from static_dist.titan import titan_loss
    x = torch.randint(0, 100, (B, S), device="meta")
    g = capture(m, (x,), targets=x, loss_fn=titan_loss)
    k = expected[1]
    assert g.meta["routing"]["assumption"] == "balanced"
    seen = [(mm["tokens"], mm["routed"], mm["busiest"]) for mm in g.meta["moe"]]
    assert seen == [(T, T * k, T * k // expected[0])] * len(paths), seen
    assert {r[0] for r in _routed_rows(g, g.meta["moe"][0])} == {T * k}


def _cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try: code = main(list(argv))
        except SystemExit as e: code = e.code
    return code, out.getvalue(), err.getvalue()


def test_cli_capture_prints_the_moe_summary():
    """tiny-moe at 2 x 16: 32 tokens, 64 routed rows, 24 for the busiest expert at imbalance 1.5, 20 slots at its own
    capacity factor 1.25 (no --routing); experts 4·3·64·192 float32 parameters, 589,824 B."""
    code, out, err = _cli("capture", "--model", "tiny-moe", "--batch", "2", "--seq", "16", "--routing", "imbalance=1.5")
    assert code == 0, err
    words = " ".join(out.split())                    # rich wraps the list to the terminal's width
    assert "routing assumption: imbalance=1.5" in words and "4 experts, top-2" in words, out
    assert "(576.00 KiB)" in words and "64 routed rows, busiest expert 24" in words, out
    code, out, err = _cli("capture", "--model", "tiny-moe", "--batch", "2", "--seq", "16", "--json")
    s = json.loads(out)
    assert s["routing"]["assumption"] == "capacity=1.25" and [m["busiest"] for m in s["moe"]] == [20, 20]
    assert [m["expert_bytes"] for m in s["moe"]] == [4 * 3 * 64 * 192 * 4] * 2
    code, out, err = _cli("capture", "--model", "tiny", "--batch", "2", "--seq", "16", "--routing", "capacity=1")
    assert code != 0 and "has no mixture-of-experts layer" in err and len(err.strip().splitlines()) == 1, err


USER_MOE = '''
import torch, torch.nn as nn, torch.nn.functional as F

class Expert(nn.Module):
    def __init__(self): super().__init__(); self.up, self.down = nn.Linear(32, 48), nn.Linear(48, 32)
    def forward(self, x): return self.down(F.gelu(self.up(x)))

class SparseMoE(nn.Module):
    "Experts in a ModuleList; {DISPATCH}"
    def __init__(self, n=4, k=2):
        super().__init__(); self.n_experts, self.top_k = n, k
        self.gate = nn.Linear(32, n, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(n))
    def forward(self, x):
        w, idx = self.gate(x).softmax(-1).topk(self.top_k, dim=-1)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            {BODY}
        return y

class Net(nn.Module):
    def __init__(self):
        super().__init__(); self.emb, self.moe, self.head = nn.Embedding(64, 32), SparseMoE(), nn.Linear(32, 64)
    def forward(self, tokens): return self.head(self.moe(self.emb(tokens)))
'''
DENSE = ("every expert on every token, weighted by its gate where chosen (static shapes)",
         "y = y + expert(x) * (w * (idx == e)).sum(-1, keepdim=True)")
INDEXED = ("each expert on the tokens that chose it (torch.where: data-dependent shapes)",
           "t, j = torch.where(idx == e); y = y.index_add(0, t, expert(x[t]) * w[t, j, None])")


def _user_file(tmp_path, dispatch, body):
    f = tmp_path / f"user_moe_{len(body)}.py"                          # one file (and module) per dispatch
    f.write_text(USER_MOE.replace("{DISPATCH}", dispatch).replace("{BODY}", body))
    return f"{f}:Net"


def test_user_file_moe(tmp_path):
    """A user's own file with its experts in a ModuleList. By hand: an expert is 32·48 + 48 + 48·32 + 32 = 3,152
    parameters, 4 of them 12,608 (50,432 bytes), the router 4·32; top-2 runs 128 + 2·3,152 = 6,432. A dense dispatch
    captures with the layer found; a torch.where dispatch is named, not guessed."""
    w = load_workload(_user_file(tmp_path, *DENSE), batch=B, seq=S)
    g = w.graph(routing="imbalance=1.25")
    m, = g.meta["moe"]
    assert (m["path"], m["router"], m["experts"]) == ("moe", "moe.gate", "moe.experts")
    assert (m["n_experts"], m["top_k"]) == (4, 2)
    assert (m["expert_params"], m["expert_bytes"], m["router_params"]) == (4 * 3152, 4 * 3152 * 4, 128)
    assert m["active_params"] == 128 + 2 * 3152
    assert (m["tokens"], m["routed"], m["busiest"]) == (T, 2 * T, 20)          # ⌈1.25 · 32 · 2 / 4⌉
    w = load_workload(_user_file(tmp_path, *INDEXED), batch=B, seq=S)
    with pytest.raises(RoutingError, match=r"MoE layer 'moe' .* in module 'moe'"): w.graph()


@pytest.mark.parametrize("config, total, active", [
    # Mistral AI, "Mixtral of experts" (2023-12-11): 46.7B total, 12.9B used per token (one decimal: ±0.05B)
    ("MixtralConfig", (46.65, 46.75), (12.85, 12.95)),
    # DeepSeek-V3 Technical Report (arXiv 2412.19437): 671B total, 37B activated (whole billions; 37.x reads as 37)
    ("DeepseekV3Config", (670.5, 671.5), (37, 38)),
])
def test_published_active_parameters(tmp_path_factory, config, total, active):
    "transformers' default configs are these models' shapes; built on meta, their total and active counts as published."
    m = load_workload(hf_source(tmp_path_factory, config), batch=1, seq=8, dtype="bfloat16").build_model("meta")
    a, t = (n / 1e9 for n in active_params(m))
    assert total[0] <= t < total[1] and active[0] <= a < active[1], (t, a)


def test_as_many_layers_as_experts(tmp_path_factory):
    "A Mixtral of 4 layers with 4 experts each: 4 MoE layers (its stack of 4 alike blocks is not a list of experts)."
    config, fields = HF["mixtral"][:2]
    src = hf_source(tmp_path_factory, config, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                    **{**fields, "num_hidden_layers": 4})
    layers = find_moe(load_workload(src, batch=1, seq=8, dtype="bfloat16").build_model("meta"))
    assert [l.path for l in layers] == [f"model.layers.{i}.mlp" for i in range(4)]



@pytest.mark.parametrize("force_balance", [True, False])
def test_titan_routing_counts(force_balance):
    """torchtitan's own per-expert token counter (`tokens_per_expert_E`, what its load balancing reads) after one real
    forward of deepseek_v3_debugmodel at 2 x 16 tokens, top-3 of 8 experts: with its forced balance every expert gets
    the 12 rows the balanced assumption's busiest expert has; with its router on random weights, the imbalance its
    counts show (max / mean) gives back their max as the busiest expert's rows."""
    m = _titan_model("deepseek_v3", "deepseek_v3_debugmodel", device="cpu", force_balance=force_balance)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters(): p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        m(torch.randint(0, 100, (B, S), generator=gen))
    counts = dict(m.named_buffers())["layers.1.moe.tokens_per_expert_E"]
    assert counts.sum() == T * 3
    if force_balance: assert counts.tolist() == [Routing().busiest(T, 8, 3)] * 8 == [12] * 8
    else:
        imbalance = (counts.max() / counts.mean()).item()
        assert Routing("imbalance", imbalance).busiest(T, 8, 3) == counts.max()
