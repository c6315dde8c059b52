"""Ranks' code: compiled vs eager FSDP2 on gloo, the tiny Llama and examples/gpt.py's GPT.

Launched by tests/test_compile.py with `static_dist.launch.launch("tests/dist_compile.py:main", N, SPECS)`.
SPECS: comma list of MODEL:BACKEND+BACKEND, MODEL one of tiny, breaky (tiny with a graph break in block 1), gpt;
BACKEND one of aot_eager, inductor. Example: tiny:aot_eager+inductor,gpt:aot_eager
Per model and backend: the losses of STEPS SGD steps with ACCUM micro-batches (gradient sync on the last only), the
parameters after them, collectives per step (profiler: works under compile) against the eager run and `predict_comms`,
graphs compiled in step 1 and after it (run under the 'fail_on_recompile' stance), and the compile record.
"""
import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from static_dist.compile import CompileOptions, apply_compiled, compile_record, count_collectives, graphs_compiled
from static_dist.cost import comm_counts, profile_graph
from static_dist.fsdp import FSDPPlan, FSDPUnit, predict_comms
from static_dist.step import make_optimizer, train_step
from static_dist.graph import capture
from static_dist.zoo import TransformerBlock, get_model


STEPS, ACCUM, B, S, LR = 3, 2, 2, 16, 0.5


class LoggingBlock(TransformerBlock):
    """A block with a graph break in the middle (as a call Dynamo cannot trace makes): the per-block fallback must
    handle it."""
    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        torch._dynamo.graph_break()
        return h + self.feed_forward(self.ffn_norm(h))


def setup(name):
    "(build() -> model, batch(seed) -> (x, y), loss, unit names)"
    if name in ("tiny", "breaky"):
        zm = get_model("tiny")
        def build():
            m = zm.build(device="cpu", seed=0)
            if name == "breaky": m.layers[1].__class__ = LoggingBlock
            return m
        batch = lambda seed: (lambda xy: (xy[0][0], xy[1]))(zm.batch(B, S, seed=seed))
        return build, batch, zm.loss, [f"layers.{i}" for i in range(2)]
    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=128, n_layer=2, n_embd=64, n_head=4, max_seq_len=64)
    def build():
        torch.manual_seed(0)
        return GPT(cfg)
    def batch(seed):
        t = torch.randint(cfg.vocab_size, (B, S + 1), generator=torch.Generator().manual_seed(seed))
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()
    loss = lambda out, y: torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())
    return build, batch, loss, [f"transformer.h.{i}" for i in range(cfg.n_layer)]


def run(name, opts, plan, rank, world, eager_check=False):
    build, batch, loss_fn, _ = setup(name)
    m = build()
    x0, _ = batch(12345)
    apply_compiled(m, plan, init_device_mesh("cpu", plan.mesh_shape), opts, example_inputs=(x0,))
    opt = make_optimizer("sgd", m.parameters(), lr=LR)
    losses, counts, cdm, graphs = [], [], [], []
    for step in range(STEPS):
        mbs = [batch(1000 * step + 10 * (world * i + rank) + 1) for i in range(ACCUM)]
        stance = (
            torch.compiler.set_stance("fail_on_recompile")
            if (opts.enabled and step > 0)
            else torch.compiler.set_stance("default")
        )
        # eager step 0 is counted by CommDebugMode (per micro-batch); every other step by the profiler, which also
        # works under compile (the two are not nested: the profiler would see each op twice through the mode)
        debug = eager_check and step == 0
        modes = []
        def around():                                        # a fresh CommDebugMode per micro-batch (eager step 0)
            modes.append(CommDebugMode() if debug else contextlib.nullcontext())
            return modes[-1]
        with stance, (contextlib.nullcontext({}) if debug else count_collectives()) as c:
            total = train_step(
                m, opt, mbs, loss_fn, plan=plan, around=around
            )  # the one step: sync on the last micro-batch
        if debug: cdm += [comm_counts(md) for md in modes]
        losses.append(float(total)); graphs.append(graphs_compiled(m))
        counts.append({k: sum(d[k] for d in cdm) for k in cdm[0]} if debug else dict(c))
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in m.named_parameters()}
    return dict(losses=losses, counts=counts, graphs=graphs, commdebug=cdm,
                record=compile_record(m).to_dict() if opts.enabled else None), full


def main(specs: str = "tiny:aot_eager") -> dict:
    "Every spec on this rank of the running group; the results (rank 0's are returned by the launcher)."
    specs = specs.split(",")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for spec in specs:
        name, _, bes = spec.partition(":")
        backends = bes.split("+") if bes else ["aot_eager"]
        build, batch, loss_fn, blocks = setup(name)
        x, y = batch(1)
        meta = setup("tiny" if name == "breaky" else name)[0]().to("meta")  # the breaky block captures as the plain one
        g = capture(meta, (x,), loss_fn=loss_fn, targets=y, optimizer="sgd")
        plan = FSDPPlan(world, (world,), (FSDPUnit(""), *(FSDPUnit(b) for b in blocks)), forward_prefetch=1,
                        accumulation_steps=ACCUM)
        predicted = predict_comms(profile_graph(g), plan)
        if rank == 0: print("MODEL", name, "eager", flush=True)
        ref, ref_p = run(name, CompileOptions(enabled=False), plan, rank, world, eager_check=True)
        res = {"eager": ref, "predicted_counts": predicted}
        for be in backends:
            if rank == 0: print("MODEL", name, be, flush=True)
            torch._dynamo.reset()
            import torch._inductor.config as ic
            before = {k: repr(v) for k, v in ic.get_config_copy().items()}
            r, p = run(name, CompileOptions(backend=be), plan, rank, world)
            after = {k: repr(v) for k, v in ic.get_config_copy().items()}
            r["inductor_config_changed"] = sorted(k for k in before if before[k] != after.get(k))
            r["max_param_diff"] = max(float((p[n] - ref_p[n]).abs().max()) for n in ref_p)
            r["max_param_abs"] = max(float(ref_p[n].abs().max()) for n in ref_p)
            r["max_loss_diff"] = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
            res[be] = r
        results[name] = res
    return dict(world=world, steps=STEPS, accum=ACCUM, torch=torch.__version__, results=results)
