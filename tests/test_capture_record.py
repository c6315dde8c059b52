"""The capture records the same graph as the recorder it replaced: every field of every op, tensor and storage, the
saves and unpacks, and the notes, compared with a frozen copy of the old capture (`capture_reference.py`), on zoo
models, an `hf:` model and a real capture; and the same one-line errors for steps that cannot be captured."""
import dataclasses

import pytest
import torch
import torch.nn as nn

from capture_reference import old_capture
from static_dist.graph import capture
from static_dist.graph.recorder import CaptureError
from static_dist.workload import DTYPES, load_workload


def _same_graph(new, old, targets=None) -> None:
    "Every record equal, field by field (a field the new capture drops or changes fails here, named)."
    assert len(new.ops) == len(old.ops) and len(new.tensors) == len(old.tensors)
    for table in ("ops", "tensors", "storages"):
        for a, b in zip(getattr(new, table), getattr(old, table)):
            assert dataclasses.asdict(a) == dataclasses.asdict(b), (table, a, b)
        assert getattr(new, table) == getattr(old, table)
    assert new.saves == old.saves and new.unpacks == old.unpacks
    # the capture's own wall time; whether TF32 was on (recorded since the reference was frozen: off, torch's default);
    # the targets' shape (recorded since: None where the model's output is the loss), checked against the targets given;
    # the MoE layers and routing assumption (recorded since issue 32; checked by hand in test_moe.py)
    later = ("seconds", "tf32", "targets", "moe", "routing", "moe_params")
    drop = lambda m: {k: v for k, v in m.items() if k not in later}
    assert drop(new.meta) == drop(old.meta) and new.meta["tf32"] is torch.backends.cuda.matmul.allow_tf32 is False
    want = None if targets is None else list(targets.shape)
    assert new.meta["targets"] == want, (new.meta["targets"], want)


def _workload_step(source: str, **kw):
    "The model (on meta), inputs and step settings of a workload, as `Workload.graph` hands them to `capture`."
    w = load_workload(source, **kw)
    model = w.build(device="meta", dtype=DTYPES[w.dtype])
    args, kwargs, targets = w.inputs(device="meta", dtype=w.dtype)
    return model, args, dict(example_kwargs=kwargs or None, loss_fn=w.loss, targets=targets,
                             optimizer=None if w.optimizer == "none" else w.optimizer)


@pytest.mark.parametrize("name", ["tiny", "tiny-moe", "mlp"])
def test_zoo_capture_records_what_the_old_recorder_did(name):
    model, args, kw = _workload_step(name, batch=2, seq=32)
    new, old = capture(model, args, **kw), old_capture(model, args, **kw)
    assert len(new.ops) > 50 and {o.phase for o in new.ops} == {"forward", "backward", "optimizer"}
    _same_graph(new, old, kw["targets"])


def test_hf_capture_records_what_the_old_recorder_did(hf_tiny_llama):
    model, args, kw = _workload_step(hf_tiny_llama, batch=2, seq=32)
    new, old = capture(model, args, **kw), old_capture(model, args, **kw)
    assert any(o.module.startswith("model.layers.1.") for o in new.ops) and sum(o.flops for o in new.ops) > 0
    _same_graph(new, old, kw["targets"])     # None: the causal LM's output is its loss


def test_real_capture_records_what_the_old_recorder_did():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.0), nn.Linear(16, 4))
    x, y = torch.randn(3, 8), torch.randn(3, 4)
    kw = dict(loss_fn=nn.functional.mse_loss, targets=y, optimizer="adamw", mode="real")
    _same_graph(capture(model, (x,), **kw), old_capture(model, (x,), **kw), y)


def test_a_bf16_step_records_what_the_old_recorder_did():
    "A step in bfloat16 with an fp32 master-free AdamW: dtypes and bytes of every tensor as before."
    model, args, kw = _workload_step("tiny", batch=1, seq=16, dtype="bfloat16")
    _same_graph(capture(model, args, **kw), old_capture(model, args, **kw), kw["targets"])


class _MixedDtypes(nn.Module):
    def __init__(self):
        super().__init__(); self.lin = nn.Linear(4, 4)
    def forward(self, x): return self.lin(x.to(torch.bfloat16))


class _ModifiesSaved(nn.Module):
    def __init__(self):
        super().__init__(); self.lin = nn.Linear(4, 4)
    def forward(self, x):
        h = torch.sigmoid(self.lin(x))
        h.mul_(2)
        return h


def _message(f) -> str:
    with pytest.raises(CaptureError) as e: f()
    return str(e.value)


@pytest.mark.parametrize("model", [_MixedDtypes, _ModifiesSaved])
def test_the_same_errors_as_before(model):
    "A mixed-dtype matmul (refused as eager refuses it) and a saved tensor changed in place: the same message."
    m, x = model(), torch.randn(2, 4)
    kw = dict(loss_fn=lambda out: out.float().sum())
    new, old = _message(lambda: capture(m, (x,), **kw)), _message(lambda: old_capture(m, (x,), **kw))
    assert new == old and ("same dtype" in new or "modified by an inplace operation" in new), new
