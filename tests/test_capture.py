"""Capture checked against independent references on zoo models: MemTracker, eager real runs, published sizes."""
import copy
import math

import pytest
import torch

from static_dist.graph import PHASES, capture, load_graph, memtracker_peak, storage_differences
from static_dist.zoo import get_model


def _step(name, batch, seq, device="meta"):
    zm = get_model(name)
    return zm, zm.build(device=device), *zm.batch(batch, seq)


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_fake_and_real_capture_agree(name):
    zm, model, inputs, targets = _step(name, 2, 32, device="cpu")
    fake = capture(model, inputs, loss_fn=zm.loss, targets=targets, optimizer="adamw")
    real = capture(model, inputs, loss_fn=zm.loss, targets=targets, optimizer="adamw", mode="real")
    assert fake.ops == real.ops
    assert fake.tensors == real.tensors
    assert fake.saves == real.saves and fake.unpacks == real.unpacks   # the offload executor's clock
    assert storage_differences(fake, real) == []
    assert fake.peak() == real.peak()


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_peak_matches_memtracker_on_tiny_llama(optimizer):
    zm, model, inputs, targets = _step("tiny", 2, 64, device="cpu")
    ref = memtracker_peak(model, inputs, loss_fn=zm.loss, targets=targets, optimizer=optimizer)
    ours = capture(model, inputs, loss_fn=zm.loss, targets=targets, optimizer=optimizer, mode="real").peak().bytes
    assert abs(ours - ref) <= 0.05 * ref, (ours, ref)


def test_real_capture_leaves_the_callers_model_untouched():
    zm, model, inputs, targets = _step("tiny", 2, 16, device="cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    capture(model, inputs, loss_fn=zm.loss, targets=targets, optimizer="adamw", mode="real")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_llama3_70b_captures_on_fake_tensors():
    "The 70B step (batch 1, seq 4096, AdamW) on this machine: sizes and FLOPs against hand formulas."
    zm, model, inputs, targets = _step("llama3-70b", 1, 4096)
    g = capture(model, inputs, loss_fn=zm.loss, targets=targets, optimizer="adamw")
    s = g.summary()
    c = model.cfg
    assert s["params"] == 70_553_706_496
    lin = c.n_layers * (2 * c.dim * c.dim + 2 * c.dim * c.n_kv_heads * c.head_dim + 3 * c.dim * c.ffn_dim) \
        + c.dim * c.vocab_size
    attn = c.n_layers * 4 * 1 * c.n_heads * 4096 * (4096 + 1) // 2 * c.head_dim   # causal: L(L+1)/2 of L² scores
    assert s["flops"]["forward"] == 2 * 4096 * lin + attn
    # fp32 AdamW: params, grads, two moments = 16 bytes per parameter are alive at the end
    end = {r: b for r, b in s["peak_by_role"].items()}
    assert end["parameter"] == end["gradient"] == 4 * s["params"]
    assert end["optimizer_state"] >= 8 * s["params"]
    assert {o.phase for o in g.ops} == set(PHASES)


def test_graph_json_round_trip(tmp_path):
    zm, model, inputs, targets = _step("tiny-moe", 2, 16)
    g = capture(model, inputs, loss_fn=zm.loss, targets=targets, optimizer="adam")
    g2 = load_graph(g.save(tmp_path / "g.json"))
    assert g2 == g
    assert g2.module_stats() == g.module_stats()


def test_module_attribution_is_deterministic_across_processes():
    "Backward ops of sibling modules fed by one tensor (wq/wk/wv) get the same module whatever the string hash seed."
    import os, subprocess, sys
    code = ("from static_dist.graph import capture; from static_dist.zoo import get_model; zm = get_model('tiny'); "
            "x, y = zm.batch(2, 16); g = capture(zm.build(), x, loss_fn=zm.loss, targets=y); "
            "print('|'.join(o.module for o in g.ops))")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in (1, 2, 3)}
    assert len(runs) == 1


# --- keyword inputs, structure, and errors (issues 12 and 14) -------------------------------------------------------
import json
import os
import subprocess
import sys

import torch.nn as nn
import torch.nn.functional as F

from static_dist.graph import CaptureError
from static_dist.structure import find_structure
from static_dist.errors import StaticDistError


def test_keyword_inputs_give_the_positional_step():
    zm, model, inputs, targets = _step("tiny", 2, 16, device="cpu")

    class ByName(nn.Module):
        def __init__(self, m): super().__init__(); self.m = m
        def forward(self, *, tokens): return self.m(tokens)

    ref = capture(model, inputs, loss_fn=zm.loss, targets=targets, optimizer="adamw")
    for mode in ("fake", "real"):
        g = capture(ByName(model), example_kwargs=dict(tokens=inputs[0]), loss_fn=zm.loss, targets=targets,
                    optimizer="adamw", mode=mode)
        assert [(o.op, o.phase, o.inputs, o.outputs, o.flops) for o in g.ops] == \
               [(o.op, o.phase, o.inputs, o.outputs, o.flops) for o in ref.ops]
        assert g.peak().bytes == ref.peak().bytes
        assert g.meta["kwargs"] == {"tokens": [2, 16]} and g.meta["inputs"] == []
        assert [s.name for s in g.storages if s.role == "input"][0] == "kwargs['tokens']"
    assert ref.structure == find_structure(model) and ref.structure.main.path == "layers"


def test_structure_survives_save_and_load(tmp_path):
    zm, model, inputs, targets = _step("tiny-moe", 2, 16)
    g = capture(model, inputs, loss_fn=zm.loss, targets=targets)
    g2 = load_graph(g.save(tmp_path / "g.json"))
    assert g2.structure == g.structure == find_structure(model)
    assert len(g2.structure.main.blocks) == 2


class _GroupedExperts(nn.Module):
    """Experts through torch._grouped_mm, whose meta and CUDA kernels take bfloat16 only (the CPU kernel takes float32
    too)."""
    def __init__(self): super().__init__(); self.w = nn.Parameter(torch.randn(2, 8, 8))
    def forward(self, x): return torch._grouped_mm(x.expand(2, -1, -1), self.w)


class _MixedMoE(nn.Module):
    def __init__(self): super().__init__(); self.lin = nn.Linear(8, 8); self.expert = _GroupedExperts()
    def forward(self, x): return self.expert(self.lin(x)).float().sum()


def test_dtype_mismatch_is_one_quiet_line(capfd):
    import logging
    with pytest.raises(CaptureError) as e:
        capture(_MixedMoE(), (torch.randn(4, 8),))
    msg = str(e.value)
    assert isinstance(e.value, StaticDistError)
    assert len(msg.splitlines()) == 1
    assert (
        "in module 'expert'" in msg
        and "test_capture.py" in msg
        and "torch._grouped_mm(x.expand(2, -1, -1), self.w)" in msg
    )
    assert "dtype='bfloat16'" in msg and "--dtype bfloat16" in msg
    out, err = capfd.readouterr()
    assert "failed while attempting to run meta" not in out + err and out + err == "", out + err
    assert logging.getLogger("torch._subclasses.fake_tensor").disabled is False   # restored after the error
    g = capture(
        _MixedMoE().to(torch.bfloat16), (torch.randn(4, 8, dtype=torch.bfloat16),), optimizer="adamw"
    )  # the fix
    assert any(o.op.startswith("aten._grouped_mm") for o in g.ops)


def test_value_dependent_code_suggests_real_mode():
    class Branchy(nn.Module):
        def __init__(self): super().__init__(); self.lin = nn.Linear(4, 4)
        def forward(self, x):
            h = self.lin(x)
            return (h * 2).sum() if h.sum() > 0 else h.sum()
    with pytest.raises(CaptureError, match="mode='real'") as e:
        capture(Branchy(), (torch.randn(2, 4),))
    assert "if h.sum() > 0" in str(e.value) and len(str(e.value).splitlines()) == 1


_DEVICE_SCRIPT = """
import sys, torch, torch.nn as nn
from static_dist.graph import capture, CaptureError
try:
    capture(nn.Linear(4, 4), (torch.randn(2, 4),), loss_fn=lambda o: o.sum(), device=sys.argv[1])
    print("CAPTURED")
except CaptureError as e:
    print("CaptureError:", e)
"""


@pytest.mark.parametrize("device", ["cuda", "cuda:7", "nosuch", "xpu:3"])
def test_unusable_device_is_a_capture_error_not_an_abort(device):
    n = torch.cuda.device_count()
    if device == "cuda" and torch.cuda.is_available(): device = f"cuda:{n}"   # on a GPU machine: one index too far
    if device == "cuda:7" and n > 7: pytest.skip("this machine has 8 or more GPUs")
    r = subprocess.run([sys.executable, "-c", _DEVICE_SCRIPT, device], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.startswith("CaptureError: device="), r.stdout + r.stderr[-2000:]
    assert len(r.stdout.strip().splitlines()) == 1


class _SigmoidInPlace(nn.Module):
    def __init__(self): super().__init__(); self.lin = nn.Linear(8, 8)
    def forward(self, x):
        h = torch.sigmoid(self.lin(x))    # sigmoid saves its output for backward
        h.mul_(2)                         # and this changes it
        return h.sum()


class _ReluInPlaceOk(nn.Module):
    "relu_ on a tensor nothing saved: eager runs it, so capture must too."
    def __init__(self): super().__init__(); self.lin = nn.Linear(8, 8); self.out = nn.Linear(8, 1)
    def forward(self, x):
        h = self.lin(x) + 1
        h.relu_()
        return self.out(h).sum()


@pytest.mark.parametrize("mode", ["fake", "real"])
def test_inplace_on_saved_tensor_is_refused_like_eager(mode):
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as eager:
        _SigmoidInPlace()(x).backward()
    with pytest.raises(CaptureError, match="modified by an inplace operation") as e:
        capture(_SigmoidInPlace(), (x,), mode=mode)
    msg = str(e.value)
    assert "is at version 1; expected version 0 instead" in msg and "is at version 1; expected version 0" in str(
        eager.value
    )
    assert "aten.sigmoid.default" in msg and "aten.mul_.Tensor" in msg and "h.mul_(2)" in msg
    # an in-place op on a tensor autograd did not save is fine, in eager and in capture
    _ReluInPlaceOk()(x).backward()
    g = capture(_ReluInPlaceOk(), (x,), mode=mode, optimizer="sgd")
    assert any(o.op == "aten.relu_.default" for o in g.ops)


@pytest.mark.parametrize("mode", ["fake", "real"])
def test_token_ids_out_of_range(mode):
    zm = get_model("tiny")
    model = zm.build(device="meta" if mode == "fake" else "cpu")
    (tokens,), targets = zm.batch(2, 16)
    V = model.cfg.vocab_size
    for bad, lo_hi in ((tokens.clone().fill_(3).index_fill_(1, torch.tensor([5]), V), f"[3, {V}]"),
                       (tokens.clone().fill_(3).index_fill_(1, torch.tensor([0]), -1), "[-1, 3]")):
        with pytest.raises(CaptureError, match=rf"inputs\[0\] holds token ids in \{lo_hi}.*'tok_embeddings' has "
                                               rf"num_embeddings={V}"):
            capture(model, (bad,), loss_fn=zm.loss, targets=targets, mode=mode)
    ok = tokens.clone().fill_(V - 1)   # the largest valid id passes
    capture(model, (ok,), loss_fn=zm.loss, targets=targets, mode=mode)
    if mode == "real":   # the reference: eager refuses the same ids
        with pytest.raises(IndexError):
            model(tokens.clone().fill_(V))


def _transformers():
    "The optional 'hf' extra (a dev dependency: imported, so a missing one fails rather than skips)."
    import transformers
    return transformers


def _gpt2(device):
    cfg = _transformers().GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    with torch.device(device): return _transformers().AutoModelForCausalLM.from_config(cfg).eval()


def test_hf_gpt2_with_labels_in_kwargs():
    """A Hugging Face model's own loss, labels by keyword (with -100 ignored positions), fake on meta and real on cpu
    agree."""
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = ids.clone(); labels[:, :3] = -100             # -100 is 'ignore', and never reaches an embedding
    kw = dict(input_ids=ids, labels=labels)
    fake = capture(_gpt2("meta"), example_kwargs=kw, loss_fn=lambda out: out.loss, optimizer="adamw")
    real = capture(_gpt2("cpu"), example_kwargs=kw, loss_fn=lambda out: out.loss, optimizer="adamw", mode="real")
    assert fake.meta["kwargs"] == {"input_ids": [2, 16], "labels": [2, 16]}
    assert fake.structure.main.path == "transformer.h" and fake.structure == real.structure
    assert [o.op for o in fake.ops] == [o.op for o in real.ops]
    assert fake.peak().bytes == real.peak().bytes
    bad = dict(input_ids=ids.clone().fill_(100), labels=labels)
    with pytest.raises(CaptureError, match=r"kwargs\['input_ids'\] holds token ids in \[100, 100\].*transformer.wte"):
        capture(_gpt2("meta"), example_kwargs=bad, loss_fn=lambda out: out.loss)


def test_hf_gpt2_real_capture_matches_memtracker():
    "The keyword-input path against torch's own tracker on the same Hugging Face step."
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    kw = dict(input_ids=ids, labels=ids)
    model = _gpt2("cpu")
    ref = memtracker_peak(model, example_kwargs=kw, loss_fn=lambda out: out.loss, optimizer="adamw")
    ours = capture(model, example_kwargs=kw, loss_fn=lambda out: out.loss, optimizer="adamw", mode="real").peak().bytes
    assert abs(ours - ref) <= 0.05 * ref, (ours, ref)


def test_memtracker_peak_failure_is_a_capture_error():
    class BF16Bmm(nn.Module):      # eager bmm refuses float32 @ bfloat16
        def __init__(self): super().__init__(); self.w = nn.Parameter(torch.randn(2, 8, 8, dtype=torch.bfloat16))
        def forward(self, x): return torch.bmm(x.expand(2, -1, -1), self.w)
    model = nn.Sequential(nn.Linear(8, 8), BF16Bmm())
    with pytest.raises(CaptureError, match="a kernel in the step under MemTracker got tensors of another dtype than it "
                                           "needs in module '1'.*dtype='bfloat16'"):
        memtracker_peak(model, (torch.randn(4, 8),), loss_fn=lambda o: o.float().sum())


# --- on a CUDA device (skipped without one; tests/gpu_all.sh runs them on the GPU machine) ---------------------------
_cuda = pytest.mark.gpu   # skipped where no CUDA device exists (conftest)


@_cuda
def test_fake_capture_on_cuda_matches_a_real_cuda_step():
    "A CPU model and CPU inputs captured as fakes on device='cuda' give the step a real CUDA run records."
    zm, model, inputs, targets = _step("tiny", 2, 64, device="cpu")
    fake = capture(model, inputs, loss_fn=zm.loss, targets=targets, optimizer="adamw", device="cuda")
    cm, ci, ct = copy.deepcopy(model).cuda(), tuple(x.cuda() for x in inputs), targets.cuda()
    real = capture(cm, ci, loss_fn=zm.loss, targets=ct, optimizer="adamw", mode="real")
    assert [(o.op, o.inputs, o.outputs) for o in fake.ops] == [(o.op, o.inputs, o.outputs) for o in real.ops]
    assert storage_differences(fake, real) == []
    ref = memtracker_peak(cm, ci, loss_fn=zm.loss, targets=ct, optimizer="adamw")
    print(f"cuda peak: fake {fake.peak().bytes} real {real.peak().bytes} MemTracker {ref}")
    assert abs(real.peak().bytes - ref) <= 0.05 * ref, (real.peak().bytes, ref)


@_cuda
def test_cuda_errors():
    n = torch.cuda.device_count()
    with pytest.raises(CaptureError, match=f"only {n} cuda device"):
        capture(nn.Linear(4, 4), (torch.randn(2, 4),), loss_fn=lambda o: o.sum(), device=f"cuda:{n}")
    x = torch.randn(4, 8, device="cuda")
    with pytest.raises(CaptureError, match="modified by an inplace operation"):
        capture(_SigmoidInPlace().cuda(), (x,), mode="real")
    with pytest.raises(CaptureError, match="modified by an inplace operation"):
        capture(_SigmoidInPlace(), (x.cpu(),), device="cuda")
    zm = get_model("tiny")
    model = zm.build(device="cuda")
    (tokens,), targets = zm.batch(2, 16)
    with pytest.raises(CaptureError, match="num_embeddings=256"):
        capture(model, (tokens.cuda() + 256,), loss_fn=zm.loss, targets=targets.cuda(), mode="real")
    with pytest.raises(CaptureError, match="dtype='bfloat16'"):
        capture(_MixedMoE().cuda(), (x,))                 # fake tensors on CUDA: the same meta kernel refuses float32


def test_backward_ops_are_not_charged_to_a_pass_through_module():
    """nn.Dropout(0.0) returns its input: ModuleTracker's backward scope for it can stay open; its name must not take
    ops."""
    import torch.nn as nn
    from static_dist.graph import capture

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.lin, self.drop = nn.LayerNorm(8), nn.Linear(8, 8), nn.Dropout(0.0)
        def forward(self, x): return x + self.drop(self.lin(self.norm(x)))

    g = capture(nn.Sequential(Block(), Block()), torch.randn(2, 8), loss_fn=lambda y: y.sum())
    bwd = [o.module for o in g.ops if o.phase == "backward"]
    assert bwd and not any(m.endswith("drop") for m in bwd), bwd
    last1 = max(i for i, m in enumerate(bwd) if m.startswith("1."))
    first0 = min(i for i, m in enumerate(bwd) if m.startswith("0."))
    assert last1 < first0, bwd                   # block 1's backward ends before block 0's begins
    assert "0.norm" in bwd and "1.norm" in bwd, bwd
