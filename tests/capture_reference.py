"""A frozen copy of the capture as it was before the recorder was folded into FakeTensorMode (static_dist commit
541184b, graph/recorder.py from `_Recorder` on and graph/step.py from `_copy_model` on, verbatim but for the imports):
a TorchDispatchMode recorder above a plain FakeTensorMode, under a second mode that checks dtypes. Kept only here, as
the reference that `tests/test_capture_record.py` compares the library's capture with, field by field. Do not edit."""
from __future__ import annotations

import copy
import time
import traceback
import warnings
import weakref
from contextlib import nullcontext
from typing import Callable, Literal

import torch
import torch.nn as nn
from fastcore.basics import patch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from static_dist.graph.records import OpRecord, StaticGraph, StorageRecord, TensorRecord
from static_dist.graph.recorder import (CaptureError, CaptureTypeError, ModuleScopes, UncountedFlopsWarning, computes,
                                        explain_failure, flop_formula, quiet_torch_logs)
from static_dist.graph.recorder import _module_in, _user_line
from static_dist.step import StepError, make_optimizer, step_loss
from static_dist.structure import find_structure

_aten = torch.ops.aten

# profiler markers, and metadata queries (`prim.device`) that fake tensors route through the mode: not ops.
_SKIP_NAMESPACES = ("profiler", "prim")

class _Recorder(TorchDispatchMode):
    def __init__(self, tracker: ModuleScopes, root: str, progress: Callable[[str, int], None] | None = None):
        super().__init__()
        self.tracker, self.root, self.progress = tracker, root, progress
        self.phase: str = "forward"
        self.ops: list[OpRecord] = []
        self.tensors: list[TensorRecord] = []
        self.storages: list[dict] = []
        self._tid = WeakIdKeyDictionary()   # tensor object -> id
        self._sid = WeakIdKeyDictionary()   # storage object -> id
        self._finalizers: list[weakref.finalize] = []
        self.saves: list[tuple[int, int]] = []     # (index of the next op, tensor id) per pack, in call order
        self.unpacks: list[tuple[int, int]] = []
        self._closed = False
        self.failed_in: str | None = None
        self._packed: set[int] = set()          # storage ids of tensors saved for backward
        self._writes: dict[
            int, tuple
        ] = {}  # storage id -> (op, module, source line) of the first in-place write after its save
        self.uncounted: dict[str, int] = {}     # op -> calls, for ops that compute but have no FLOP formula
        self.model_forward: list[int] | None = None       # [first, last] op of the model's own forward
        self.model_backward_start: int | None = None      # op before which a gradient first reached its outputs
        self._model_hooks: list = []
        self._op_info: dict = {}              # op -> (name, FLOP formula, computes uncounted), looked up once per op

@patch
def module(self: _Recorder) -> str:
    "FQN (relative to the captured model) of the innermost module running now."
    best, stale = (-1, 0, ""), getattr(self.tracker, "passthrough", ()) if self.phase == "backward" else ()
    for name in self.tracker.parents:
        if name == "Global" or name == self.root or name in stale: continue   # a pass-through runs no backward op
        rel = name[len(self.root) + 1:] if name.startswith(self.root + ".") else name
        best = max(best, (rel.count("."), len(rel), rel))
    return best[2]

@patch
def storage_id(self: _Recorder, t: torch.Tensor, role: str, name: str) -> int:
    st = t.untyped_storage()
    sid = self._sid.get(st)
    if sid is None:
        sid = len(self.storages)
        created = -1 if role in ("parameter", "buffer", "input", "other") else len(self.ops)
        self.storages.append(dict(id=sid, nbytes=st.nbytes(), device=str(t.device), role=role, name=name,
                                  created=created, freed=None, saved_in=None))
        self._sid[st] = sid
        self._finalizers.append(weakref.finalize(st, self._freed, sid))
    return sid

@patch
def _freed(self: _Recorder, sid: int):
    if not self._closed: self.storages[sid]["freed"] = len(self.ops) - 1

@patch
def tensor_id(self: _Recorder, t: torch.Tensor, role: str = "other", name: str = "") -> int:
    tid = self._tid.get(t)
    if tid is None:
        tid = len(self.tensors)
        self.tensors.append(TensorRecord(tid, self.storage_id(t, role, name), tuple(t.shape),
                                         str(t.dtype).removeprefix("torch.")))
        self._tid[t] = tid
    return tid

@patch
def output_id(self: _Recorder, t: torch.Tensor, func) -> int:
    "Id of an op's output; a tensor whose shape an in-place op changed (`unsqueeze_`, `t_`) gets a new id."
    tid = self.tensor_id(t, "temporary", str(func.overloadpacket))
    if self.tensors[tid].shape != tuple(t.shape):
        del self._tid[t]
        tid = self.tensor_id(t)
    return tid

def _tensors(x):
    """The tensors in an op's arguments or outputs (nested tuples, lists, dicts), in tree_flatten's order, without its
    cost."""
    if isinstance(x, torch.Tensor): yield x
    elif isinstance(x, (tuple, list)):
        for v in x: yield from _tensors(v)
    elif isinstance(x, dict):
        for v in x.values(): yield from _tensors(v)

@patch
def _info(self: _Recorder, func) -> tuple:
    "(name, FLOP formula or None, computes without one) of `func`, looked up on its first call in this capture."
    if (info := self._op_info.get(func)) is None:
        f = flop_formula(func)
        info = self._op_info[func] = (str(func), f, f is None and computes(func))
    return info

@patch
def __torch_dispatch__(self: _Recorder, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    try: out = func(*args, **kwargs)
    except Exception:
        if self.failed_in is None: self.failed_in = self.module()
        raise
    if func.namespace in _SKIP_NAMESPACES: return out
    if self._packed and self.phase != "optimizer" and func._schema.is_mutable: self._note_write(func, args, kwargs)
    # `torch.tensor(...)` makes its constant outside dispatch and then calls lift_fresh: the constant is
    # the op's output, not a pre-existing input (fake mode returns a new fake for it, real mode the same tensor).
    ins = () if func is _aten.lift_fresh.default else tuple(self.tensor_id(a) for a in _tensors((args, kwargs)))
    outs = tuple(self.output_id(o, func) for o in _tensors(out))
    name, f, uncounted = self._info(func)
    if uncounted: self.uncounted[name] = self.uncounted.get(name, 0) + 1
    self.ops.append(OpRecord(len(self.ops), name, self.phase, self.module(), ins, outs,
                             0 if f is None else int(f(*args, **kwargs, out_val=out))))
    if self.progress is not None and len(self.ops) % 2000 == 0: self.progress(self.phase, len(self.ops))
    return out

@patch
def close(self: _Recorder) -> list[StorageRecord]:
    "Stop listening for frees; freeze the storage table; warn (once) of ops that compute and were not counted."
    self._closed = True
    for f in self._finalizers: f.detach()
    if self.uncounted:
        ops = ", ".join(f"{op} ×{n}" for op, n in sorted(self.uncounted.items()))
        warnings.warn(f"FLOPs not counted for {len(self.uncounted)} op(s) that compute, which have no FLOP formula: "
                      f"{ops}. The graph's FLOPs and the step times predicted from them leave these out; register "
                      "a formula with torch.utils.flop_counter.register_flop_formula (the capture reads that "
                      "registry) and capture again.", UncountedFlopsWarning, stacklevel=2)
    return [StorageRecord(**s) for s in self.storages]

@patch
def notes(self: _Recorder) -> dict:
    "What the graph's meta keeps of the recording: the ops left uncounted, the model's own forward and backward start."
    return dict(uncounted_ops=sorted(self.uncounted), model_forward=self.model_forward,
                model_backward_start=self.model_backward_start)

@patch
def pack(self: _Recorder, t: torch.Tensor):
    "saved_tensors_hooks pack: mark what autograd keeps for backward, and its version (see `unpack`)."
    tid = self.tensor_id(t, "temporary", "saved")
    sid = self.tensors[tid].storage
    s = self.storages[sid]
    if s["role"] == "temporary": s["role"] = "activation"
    if s["saved_in"] is None: s["saved_in"] = self.module()
    self.saves.append((len(self.ops), tid))
    self._packed.add(sid)
    return t, t._version, self.ops[-1].op if self.ops else "?", self.module()

@patch
def unpack(self: _Recorder, packed) -> torch.Tensor:
    "saved_tensors_hooks unpack: note when backward asks for a saved tensor; refuse one changed in place since."
    t, version, saver, module = packed
    self.unpacks.append((len(self.ops), self._tid.get(t, -1)))
    if t._version != version: raise self._modified(t, version, saver, module)
    return t

def _written(func, args, kwargs) -> list[torch.Tensor]:
    "The tensors an in-place/out= op writes (schema arguments marked as written)."
    named = {**dict(zip((a.name for a in func._schema.arguments), args)), **kwargs}
    return [named[a.name] for a in func._schema.arguments
            if a.alias_info is not None and a.alias_info.is_write and isinstance(named.get(a.name), torch.Tensor)]

@patch
def _note_write(self: _Recorder, func, args, kwargs) -> None:
    for t in _written(func, args, kwargs):
        sid = self._sid.get(t.untyped_storage())
        if sid in self._packed and sid not in self._writes:
            self._writes[sid] = (str(func), self.module(), _user_line(traceback.extract_stack()))

@patch
def _modified(self: _Recorder, t: torch.Tensor, version: int, saver: str, module: str) -> CaptureError:
    op, where, line = self._writes.get(self._sid.get(t.untyped_storage()), ("an in-place op", "", ""))
    by = f"{op}" + (f" in module '{where}'" if where else "") + (f" at {line}" if line else "")
    module = f"module '{module}'" if module else "the model's top-level forward"
    return CaptureError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"[{str(t.dtype).removeprefix('torch.')} {list(t.shape)}], saved by {saver} in {module}, is at version "
        f"{t._version}; expected version {version} instead. It was changed by {by}. Fix: use the out-of-place op "
        "(`x = x.relu()` instead of `x.relu_()`, `x = x + y` instead of `x += y`) or `.clone()` the tensor first.")

@patch
def __enter__(self: _Recorder):
    "Enter the mode; with a `ModuleScopes` tracker, also watch its model's forward and the gradients of its outputs."
    m = getattr(self.tracker, "model", None)
    if m is not None and not self._model_hooks:
        self._model_hooks = [m.register_forward_pre_hook(self._model_pre), m.register_forward_hook(self._model_post)]
    return TorchDispatchMode.__enter__(self)

@patch
def __exit__(self: _Recorder, *args):
    for h in self._model_hooks: h.remove()
    self._model_hooks = []
    return TorchDispatchMode.__exit__(self, *args)

@patch
def _model_pre(self: _Recorder, mod, args) -> None:
    if self.model_forward is None: self._forward_first = len(self.ops)

@patch
def _model_post(self: _Recorder, mod, args, out) -> None:
    if self.model_forward is not None: return                      # a second call (recomputation): the first counts
    self.model_forward = [self._forward_first, len(self.ops) - 1]
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor) and t.requires_grad: t.register_hook(self._model_grad)

@patch
def _model_grad(self: _Recorder, grad) -> None:
    if self.model_backward_start is None: self.model_backward_start = len(self.ops)


def _copy_model(model: nn.Module, mode: str, fake_mode, device) -> tuple[nn.Module, dict[int, torch.Tensor]]:
    "A copy of `model` to capture, and {id(original param or buffer): copy}."
    tensors = list(dict.fromkeys([*model.parameters(), *model.buffers()]))
    if mode == "real":
        if any(t.is_meta for t in tensors):
            raise CaptureError("the model has parameters on the meta device, which hold no data: a real capture "
                               "needs real weights. Use mode='fake' (the default) or build the model on a real device.")
        memo: dict = {}
        work = copy.deepcopy(model, memo)
        return work, {id(t): memo[id(t)] for t in tensors}
    memo = {}
    with fake_mode:
        for t in tensors:
            new = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
            memo[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
    mapping = dict(memo)
    return copy.deepcopy(model, memo), mapping

def _trainable(work: nn.Module) -> list[nn.Parameter]:
    return [p for p in work.parameters() if p.requires_grad]

def _rebuild_optimizer(optimizer: torch.optim.Optimizer, mapping: dict[int, torch.Tensor], foreach: bool | None):
    "An optimizer of the same class and param-group settings as `optimizer`, over the copies in `mapping`."
    groups = []
    for g in optimizer.param_groups:
        missing = [i for i, p in enumerate(g["params"]) if id(p) not in mapping]
        if missing:
            raise CaptureError(f"the optimizer holds {len(missing)} tensor(s) that are not parameters of the "
                               "model; build it over model.parameters() or pass a factory")
        groups.append(
            {**{k: v for k, v in g.items() if k != "params"}, "params": [mapping[id(p)] for p in g["params"]]}
        )
    defaults = dict(optimizer.defaults)
    if foreach is not None and defaults.get("foreach", False) is None: defaults["foreach"] = foreach
    return type(optimizer)(groups, **defaults)

def _build_optimizer(optimizer, model: nn.Module, mapping: dict[int, torch.Tensor], work: nn.Module,
                     foreach: bool | None = None):
    if optimizer is None: return None
    if isinstance(optimizer, str):                   # the package's one table of optimizers by name
        try: return make_optimizer(optimizer, work.parameters(), foreach=foreach)
        except StepError as e:
            raise CaptureError(
                f"{e}; or pass a factory `params -> torch.optim.Optimizer`, or an optimizer instance"
            ) from None
    if isinstance(optimizer, torch.optim.Optimizer): return _rebuild_optimizer(optimizer, mapping, foreach)
    if callable(optimizer):
        opt = optimizer(_trainable(work))
        if not isinstance(opt, torch.optim.Optimizer):
            raise CaptureTypeError(f"the optimizer factory returned {type(opt).__name__}, not a torch.optim.Optimizer")
        return opt
    raise CaptureTypeError(f"optimizer must be None, a name, an Optimizer or a factory, not {type(optimizer).__name__}")

def _check_leaves(tree, what: str) -> None:
    for i, leaf in enumerate(tree_flatten(tree)[0]):
        if not isinstance(leaf, (torch.Tensor, int, float, bool, type(None))):
            raise CaptureTypeError(f"{what} leaf {i} is a {type(leaf).__name__}; only tensors and "
                                   "int/float/bool/None can be captured (wrap other state in the model)")

def _check_inputs(example_inputs) -> tuple:
    "example_inputs as a tuple; a clear error for anything that is not tensors (or plain Python scalars)."
    if isinstance(example_inputs, torch.Tensor): example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)):
        raise CaptureTypeError(f"example_inputs must be a Tensor or a tuple of positional arguments, "
                               f"not {type(example_inputs).__name__}; e.g. capture(model, (tokens,))")
    _check_leaves(tuple(example_inputs), "example_inputs")
    return tuple(example_inputs)

def _check_kwargs(example_kwargs) -> dict:
    "example_kwargs as a dict of keyword arguments for the model; a clear error otherwise."
    if example_kwargs is None: return {}
    if not isinstance(example_kwargs, dict) or not all(isinstance(k, str) for k in example_kwargs):
        raise CaptureTypeError(
            f"example_kwargs must be a dict of keyword arguments (str -> tensor), not "
            f"{type(example_kwargs).__name__}; e.g. capture(model, example_kwargs=dict(input_ids=x))"
        )
    _check_leaves(dict(example_kwargs), "example_kwargs")
    return dict(example_kwargs)

def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)

def _to_capture(x, mode: str, fake_mode, device):
    "Move the tensors of an input (a tensor or a nested structure) into the capture: fakes on `device` for mode='fake'."
    def one(t):
        if not isinstance(t, torch.Tensor) or mode == "real": return t
        if not t.is_meta and _same_device(t.device, device): return fake_mode.from_tensor(t)
        with fake_mode:   # meta inputs, and inputs on another device than the capture's: an empty fake there
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device).requires_grad_(
                t.requires_grad
            )
    return tree_map(one, x)

def _check_device(device) -> torch.device:
    "`device` as a torch.device that this process can use; CaptureError otherwise (before anything runs)."
    try: d = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise CaptureError(f"device={device!r} is not a device torch knows ({str(e).splitlines()[0]}); "
                           "give e.g. 'cpu', 'cuda', 'cuda:0' or 'meta'") from None
    if d.type in ("cpu", "meta"): return d
    backend = getattr(torch, d.type, None)
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        raise CaptureError(f"device={str(d)!r}: this torch ({torch.__version__}) cannot use {d.type!r} here (not built "
                           f"in, or no device visible); capture with device='cpu' (fake tensors need no accelerator)")
    count = getattr(backend, "device_count", lambda: 1)()
    if d.index is not None and d.index >= count:
        raise CaptureError(f"device={str(d)!r}: only {count} {d.type} device(s) visible (indices 0..{count - 1}); "
                           f"use one of those or device='cpu'")
    return d

def _model_device(model: nn.Module) -> torch.device:
    "The device of the model's first parameter or buffer; cpu for meta (or no tensors)."
    t = next(iter([*model.parameters(), *model.buffers()]), None)
    return torch.device("cpu") if t is None or t.is_meta else t.device

def _foreach_default(mode: str, device: torch.device) -> bool | None:
    "The implementation torch's optimizers pick on real tensors of `device` (foreach on CUDA), for a fake capture."
    return (device.type in ("cuda", "xpu")) if mode == "fake" else None

def _id_ranges(pairs) -> dict[int, tuple]:
    "{id(storage of the capture's tensor): (storage, numel, min, max, name)} for the real integer inputs."
    out = {}
    for name, real, cap in pairs:
        if (isinstance(real, torch.Tensor) and isinstance(cap, torch.Tensor) and real.numel() and not real.is_meta
                and not real.is_floating_point() and not real.is_complex() and real.dtype != torch.bool):
            st = cap.untyped_storage()
            out[id(st)] = (st, cap.numel(), int(real.min()), int(real.max()), name)
    return out

def _check_token_ids(work: nn.Module, ranges: dict[int, tuple]) -> None:
    "Forward pre-hooks on the embeddings of `work` that refuse ids outside [0, num_embeddings)."
    def check(fqn, m, args):
        t = args[0] if args else None
        if not isinstance(t, torch.Tensor): return
        st, numel, lo, hi, name = ranges.get(id(t.untyped_storage()), (None, -1, 0, 0, ""))
        if numel == t.numel() and (lo < 0 or hi >= m.num_embeddings):
            raise CaptureError(
                f"{name} holds token ids in [{lo}, {hi}] but embedding '{fqn}' has num_embeddings="
                f"{m.num_embeddings} (ids 0..{m.num_embeddings - 1}); eager would fail with 'index out "
                "of range'. Fix: give ids below the vocabulary size, or a model with a larger vocabulary."
            )
    for fqn, m in work.named_modules():
        if isinstance(m, nn.Embedding): m.register_forward_pre_hook(lambda m, args, fqn=fqn: check(fqn, m, args))

def _start_recorder(work: nn.Module, named: list[tuple[str, object]], targets, progress) -> tuple[_Recorder, dict]:
    "A recorder with the step's existing tensors numbered, and {id(parameter): FQN}."
    rec = _Recorder(ModuleScopes(work), type(work).__name__, progress)
    names = {id(p): n for n, p in work.named_parameters(remove_duplicate=False)}
    bnames = {id(b): n for n, b in work.named_buffers(remove_duplicate=False)}
    for p in work.parameters(): rec.tensor_id(p, "parameter", names[id(p)])
    for b in work.buffers(): rec.tensor_id(b, "buffer", bnames[id(b)])
    for name, x in named:
        if isinstance(x, torch.Tensor): rec.tensor_id(x, "input", name)
    if targets is not None: rec.tensor_id(targets, "input", "targets")
    return rec, names

def _check_loss(loss, loss_fn):
    what = "the model's output" if loss_fn is None else "loss_fn's result"
    if not isinstance(loss, torch.Tensor):
        raise CaptureError(f"{what} is a {type(loss).__name__}, not a Tensor; pass loss_fn= that returns a scalar "
                           "tensor (e.g. lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()))")
    if loss.numel() != 1:
        hint = "pass loss_fn=" if loss_fn is None else "reduce it, e.g. with .mean(),"
        raise CaptureError(f"{what} has shape {tuple(loss.shape)}; backward needs a scalar loss: {hint} "
                           "so that it returns one number")
    if not loss.requires_grad:
        raise CaptureError(f"{what} does not require grad: no parameter reaches it (are all parameters frozen, "
                           "or is the forward under torch.no_grad()?)")

def _run_step(rec: _Recorder, work: nn.Module, inputs, kwargs, loss_fn, targets, opt, progress) -> None:
    "Forward, loss, backward and optimizer step of `work` under `rec`; a failure is explained (CaptureError)."
    def step(stage: str, f):
        try: return f()
        except CaptureError: raise
        except Exception as e:
            raise explain_failure(e, stage, rec.failed_in or _module_in(e.__traceback__, work)) from None
    if progress: progress("forward", 0)
    out = step("the model's forward", lambda: work(*inputs, **kwargs))
    loss = step("the loss function", lambda: step_loss(loss_fn, out, targets))
    del out
    _check_loss(loss, loss_fn)
    rec.phase = "backward"
    if progress: progress("backward", len(rec.ops))
    step("backward", loss.backward)
    del loss
    if opt is not None:
        rec.phase = "optimizer"
        if progress: progress("optimizer", len(rec.ops))
        step("the optimizer step", opt.step)

def _settle_roles(rec: _Recorder, work: nn.Module, names: dict[int, str], opt) -> None:
    "After the step: `.grad`s are gradients, `optimizer.state` tensors are optimizer state."
    for p in work.parameters():
        if p.grad is not None:
            s = rec.storages[rec.storage_id(p.grad, "gradient", names[id(p)] + ".grad")]
            s.update(role="gradient", name=names[id(p)] + ".grad")
    if opt is None: return
    for p, state in opt.state.items():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                s = rec.storages[rec.storage_id(v, "optimizer_state", f"{names[id(p)]}.{k}")]
                s.update(role="optimizer_state", name=f"{names[id(p)]}.{k}")

def _meta(model: nn.Module, mode: str, device: torch.device, opt, inputs: tuple, kwargs: dict, t0: float) -> dict:
    "The graph's metadata: model, mode, device, torch, optimizer, input shapes, block structure, capture seconds."
    shape = lambda x: list(x.shape) if isinstance(x, torch.Tensor) else repr(x)
    return dict(model=type(model).__name__, mode=mode, device=str(device), torch=torch.__version__,
                optimizer=type(opt).__name__ if opt is not None else None,
                inputs=[shape(x) for x in inputs], kwargs={k: shape(v) for k, v in kwargs.items()},
                structure=find_structure(model).to_dict(), seconds=round(time.perf_counter() - t0, 4))

def _check_args(model, mode, example_inputs, example_kwargs, targets, loss_fn) -> tuple[tuple, dict]:
    "The inputs as (tuple, dict); CaptureTypeError/CaptureError for an argument of the wrong kind."
    if not isinstance(model, nn.Module):
        raise CaptureTypeError(f"model must be a torch.nn.Module, not {type(model).__name__}; wrap a function "
                               "in an nn.Module whose forward calls it")
    if mode not in ("fake", "real"): raise CaptureError(f"mode must be 'fake' or 'real', not {mode!r}")
    inputs, kwargs = _check_inputs(example_inputs), _check_kwargs(example_kwargs)
    if targets is not None and not isinstance(targets, torch.Tensor):
        raise CaptureTypeError(f"targets must be a Tensor or None, not {type(targets).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise CaptureTypeError(f"loss_fn must be callable, not {type(loss_fn).__name__}")
    return inputs, kwargs

def old_capture(
    model: nn.Module,
    example_inputs=(),                   # a Tensor or tuple of positional args for `model`
    *,
    example_kwargs: dict | None = None,  # keyword args for `model` (e.g. input_ids=, labels=), moved in like the inputs
    loss_fn: Callable | None = None,     # loss_fn(output, targets) -> scalar; loss_fn(output) if targets is None
    targets=None,                        # a Tensor passed to loss_fn (moved into the capture like the inputs)
    optimizer=None,                      # None, 'sgd'|'adam'|'adamw', an Optimizer over model's params, or a factory
    mode: Literal["fake", "real"] = "fake",  # fake: nothing allocated; real: runs the step on real tensors
    device: str | torch.device | None = None,  # fake tensors' device (mode='fake'); default: the model's, cpu for meta
    progress: Callable[[str, int], None] | None = None,  # called with (phase, ops so far) as the capture goes
) -> StaticGraph:
    "Run one training step of `model` under a recorder and return its `StaticGraph`."
    real_inputs, real_kwargs = _check_args(model, mode, example_inputs, example_kwargs, targets, loss_fn)
    t0 = time.perf_counter()
    device = _check_device(device) if device is not None else _model_device(model)
    with quiet_torch_logs():
        return _capture(model, real_inputs, real_kwargs, loss_fn, targets, optimizer, mode, device, progress, t0)

_aten = torch.ops.aten
_SAME_DTYPE_OPS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default, _aten.mv.default,
                   _aten.addmv.default, _aten.dot.default, _aten.convolution.default}

class _SameDtype(torch.utils._python_dispatch.TorchDispatchMode):
    "In fake mode, refuse what eager refuses: a matrix product or convolution of floating tensors of different dtypes."
    def __init__(self, mode: str): super().__init__(); self.on = mode == "fake"
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on and func in _SAME_DTYPE_OPS:
            dts = sorted({str(a.dtype) for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()})
            if len(dts) > 1: raise RuntimeError(f"expected the inputs of {func.__name__} to have the same dtype, but "
                                                "got "
                                                f"{' and '.join(dts)} (eager refuses it too: cast the inputs or the "
                                                "model)")
        return func(*args, **(kwargs or {}))

def _capture(model, real_inputs, real_kwargs, loss_fn, targets, optimizer, mode, device, progress, t0) -> StaticGraph:
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if mode == "fake" else nullcontext()
    work, mapping = _copy_model(model, mode, fake_mode, device)
    opt = _build_optimizer(optimizer, model, mapping, work, _foreach_default(mode, device))
    inputs = tuple(_to_capture(x, mode, fake_mode, device) for x in real_inputs)
    kwargs = {k: _to_capture(v, mode, fake_mode, device) for k, v in real_kwargs.items()}
    targets = _to_capture(targets, mode, fake_mode, device)
    named = [(f"inputs[{i}]", x) for i, x in enumerate(inputs)] + [(f"kwargs[{k!r}]", v) for k, v in kwargs.items()]
    _check_token_ids(work, _id_ranges(zip([n for n, _ in named], [*real_inputs, *real_kwargs.values()],
                                          [x for _, x in named])))
    rec, names = _start_recorder(work, named, targets, progress)
    with fake_mode, rec.tracker, rec, torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack), _SameDtype(mode):
        _run_step(rec, work, inputs, kwargs, loss_fn, targets, opt, progress)
        _settle_roles(rec, work, names, opt)
    storages = rec.close()
    meta = {**_meta(model, mode, device, opt, inputs, kwargs, t0), **rec.notes()}
    return StaticGraph(tuple(rec.ops), tuple(rec.tensors), tuple(storages), meta, tuple(rec.saves), tuple(rec.unpacks))
