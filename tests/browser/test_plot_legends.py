"""No legend covers data, and the labels above a plot do not overlap (issue 31, item 7).

Every plot the library exports that draws a legend, an annotation or a text is drawn here from the small inputs its
own notebook uses, and `plot_geometry` measures, in display pixels, whether a legend meets a line's points or segments,
a bar, a filled area, a scatter marker or a text on the data, and whether titles and labels overlap one another.
The checks are shown to fail: on hand-made figures with a legend on the data, and on today's plots with their legends
put back where they were before b432a41 (FSDP memory: loc="upper left", ncol=2; placement: matplotlib's "best";
stability: "upper right", the fault labels inside the axes).
"""
import functools, json, math, sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from plot_geometry import legends_on_data, overlapping_texts  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _fig(w=5, h=3):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(w, h), dpi=80)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


# ---- the check itself, on figures whose answer is known by construction


def test_legend_on_a_line_fails_beside_passes():
    fig, ax = _fig()
    ax.plot(range(11), [5] * 11, label="flat at the middle")
    ax.set_ylim(0, 10)
    ax.legend(loc="center")
    bad = legends_on_data(fig)
    assert len(bad) == 1 and "'flat at the middle'" in bad[0] and "points" in bad[0], bad
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))             # outside the axes: passes
    assert legends_on_data(fig) == []
    ax.legend(loc="upper right")                                         # inside, above the line: passes
    assert legends_on_data(fig) == []


def test_segment_between_points_counts():
    "A line with no point under the legend still covers data where a segment crosses it (not only its vertices)."
    fig, ax = _fig()
    ax.plot([0, 10], [0, 10], label="diagonal")
    ax.legend(loc="center")
    assert [b for b in legends_on_data(fig) if "a segment" in b], legends_on_data(fig)


def test_bars_areas_scatter_and_texts():
    import numpy as np
    for draw in (lambda ax: ax.bar(range(5), [8] * 5, label="bars"),
                 lambda ax: ax.stackplot(range(5), [8] * 5, labels=["area"]),
                 lambda ax: ax.broken_barh([(0, 4)], (2, 6), label="spans"),
                 lambda ax: ax.scatter(np.linspace(1.5, 2.5, 5), [5] * 5, label="points"),
                 lambda ax: ax.annotate("a note on the data", (2, 5), ha="center")):
        fig, ax = _fig()
        draw(ax); ax.plot([], [], label="proxy")
        ax.set(xlim=(0, 4), ylim=(0, 10))
        ax.legend(loc="center")
        assert legends_on_data(fig), draw
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
        assert legends_on_data(fig) == [], draw


def test_legend_beside_one_axes_on_its_neighbour_fails():
    "Beside its own axes is not enough: a legend must not land on the data of the next axes either."
    fig, ax = _fig(6, 3)
    right = fig.add_subplot(1, 2, 2); ax.set_subplotspec(fig.add_gridspec(1, 2)[0])
    ax.plot([0, 1], [0, 1], label="left's line")
    right.plot(range(10), [9] * 10, label="right's line"); right.set_ylim(0, 10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    bad = legends_on_data(fig)
    assert len(bad) == 1 and bad[0].startswith("axes 0 legend covers axes 1: Line2D \"right's line\""), bad


def test_empty_space_and_shading_pass():
    "A legend over empty space, or over a shaded span (background: axvspan), covers nothing."
    fig, ax = _fig()
    ax.bar([0, 1], [1, 2], label="low bars"); ax.axvspan(2.5, 3.5, color="red", alpha=0.2)
    ax.set(xlim=(-0.5, 3.5), ylim=(0, 10))
    ax.legend(loc="upper right")
    assert legends_on_data(fig) == []


def test_overlapping_labels_found():
    fig, ax = _fig()
    ax.plot(range(60))
    for step, kind in ((30, "lr_spike"), (32, "bad_batches")):          # two fault names two steps apart
        ax.annotate(kind, (step, 1.01), xycoords=("data", "axes fraction"), va="bottom", fontsize=8)
    assert overlapping_texts(fig) == ["axes 0 text 'lr_spike' / axes 0 text 'bad_batches'"]
    ax.texts[1].set_position((50, 1.01))
    assert overlapping_texts(fig) == []
    ax.set_title("a title over the middle")                             # on the label at step 30
    assert overlapping_texts(fig) == ["axes 0 title 'a title over the middle' / axes 0 text 'lr_spike'"]
    ax.set_title("a title over the middle", pad=14)                      # above the labels
    assert overlapping_texts(fig) == []


# ---- every plot of the library, from its notebook's inputs


@functools.cache
def _fsdp():
    "40_fsdp's plan of the small model at world 8, on a budget 0.8 of the cheapest baseline (it fits)."
    from static_dist.cost import profile_graph
    from static_dist.fsdp import plan_fsdp
    from static_dist.graph import capture
    from static_dist.zoo import get_model
    zm = get_model("small")
    (x,), y = zm.batch(2, 128, seed=0)
    prof = profile_graph(capture(zm.build(), (x,), loss_fn=zm.loss, targets=y, optimizer="adamw"))
    roomy = plan_fsdp(prof, world_size=8, budget=2**30, param_dtype=None, reduce_dtype=None)
    budget = int(0.8 * min(b.peak_bytes for b in roomy.baselines))
    return plan_fsdp(prof, world_size=8, budget=budget, param_dtype=None, reduce_dtype=None), budget


@functools.cache
def _parallel():
    "45i's small model, its dp_shard 2 x pp 2 and dp_shard 4 x tp 2 plans, their memory and step time."
    from static_dist.fsdp import FSDPPlan, FSDPUnit
    from static_dist.parallel import (ParallelDims, ParallelPlan, predict_parallel_memory, predict_step_time,
                                      rank_work)
    from static_dist.placement import block_spec, megatron_styles
    from static_dist.topology import preset
    from static_dist.workload import load_workload
    g = load_workload("small", batch=2, seq=128).graph()
    blocks = g.structure.main.blocks
    units = lambda n: FSDPPlan(n, (n,), (FSDPUnit(""), *(FSDPUnit(b) for b in blocks)))
    pp2 = ParallelPlan(ParallelDims(dp_shard=2, pp=2), stages=(2, 2), microbatches=4, fsdp=units(2), name="pp2")
    tp2 = ParallelPlan(ParallelDims(dp_shard=4, tp=2), tuple(megatron_styles(block_spec(g)).items()), fsdp=units(4),
                       name="tp2")
    def step(plan, n):
        topo = preset("cluster", n_nodes=1, gpus_per_node=n)
        return predict_step_time(rank_work(g, plan, topo), plan, topo)
    return dict(pp2=(predict_parallel_memory(g, pp2), step(pp2, 4)),
                tp2=(predict_parallel_memory(g, tp2), step(tp2, 8)))


@functools.cache
def _stability_runs():
    "60e's 60-step runs (clean, NaN gradient at 30), and 60's two faults on the same scale (lr spike, bad batches)."
    from static_dist.stability import Fault, RunConfig, run_stability
    cfg, two = RunConfig(steps=60), (Fault("lr_spike", 20), Fault("bad_batches", 40, duration=10))
    return ([run_stability(cfg, "skip"), run_stability(cfg, "skip", [Fault("nan_grad", 30)])],
            [run_stability(cfg, s, two) for s in ("unmonitored", "zclip", "rewind")])


def _memory_graph():
    "00e's MLP step."
    import torch
    import torch.nn.functional as F
    from static_dist.graph import capture, plot_memory
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    return plot_memory(capture(mlp, (x,), loss_fn=F.mse_loss, targets=y, optimizer="sgd"))


def _calibration(saved: bool):
    "02b's synthetic calibration (broadcast 3x faster than the shared fit), or 02's saved 4-rank gloo one."
    from static_dist.topology import (COLLECTIVES, Calibration, CalibrationPoint, alpha_beta, fit_calibration,
                                      plot_calibration)
    if saved:
        return plot_calibration(Calibration.from_dict(
            json.loads((ROOT / "nbs" / "02_topology_gloo4.json").read_text())["calibration"]))
    syn = [CalibrationPoint(k, n, 4, alpha_beta(k, n, 4, 30e-6, 2e9) / (3 if k == "broadcast" else 1))
           for k in COLLECTIVES for n in (2**12, 2**16, 2**20)]
    return plot_calibration(fit_calibration(syn, "synthetic", 4))


def _placement(harness: bool = False):
    "30's tiny model on a 2x2 mesh of cpu-2socket, Megatron's linears' state as the budget; or the harness's default."
    from static_dist.placement import _placement_view
    if harness: return _placement_view("tiny", "dgx-h100", "2x4").fig
    from static_dist.graph import capture
    from static_dist.placement import block_spec, evaluate_plan, megatron_styles, plan_report, plot_plans
    from static_dist.topology import MeshSpec, preset
    from static_dist.zoo import get_model
    zm = get_model("tiny"); m = zm.build(device="meta"); x, y = zm.batch(2, 64)
    topo, mesh = preset("cpu-2socket", ranks_per_socket=2), MeshSpec((2, 2), ("dp", "tp"))
    spec = block_spec(capture(m, x, loss_fn=zm.loss, targets=y, optimizer="adamw"), topo)
    meg = evaluate_plan(spec, megatron_styles(spec), topo, mesh, method="megatron")
    return plot_plans(plan_report(spec, topo, mesh, memory_budget=meg.memory * 1.01, allow_dp_shard=False))


def _offload(which: str):
    "50b's tiny step (batch 4, seq 256) planned onto cpu then nvme with a 1 MB host limit; 50's harness setting."
    from static_dist.graph import capture
    from static_dist.offload import Tier, plan_offload, plot_lifetimes, plot_offload_memory
    from static_dist.offload import _offload_view
    from static_dist.zoo import get_model
    if which == "harness": return _offload_view("tiny", 4, 256, 1.0, 0.5, 4.0).fig
    tiny = get_model("tiny")
    (x,), y = tiny.batch(4, 256)
    g = capture(tiny.build("meta"), (x,), loss_fn=tiny.loss, targets=y, optimizer="sgd")
    plan = plan_offload(g, (Tier("cpu", 1e9, 1e-5, math.inf), Tier("nvme", 5e8, 1e-4, math.inf, "disk")),
                        host_limit=1_000_000)
    return (plot_lifetimes if which == "lifetimes" else plot_offload_memory)(g, plan)


def _parallel_plot(which: str):
    from static_dist.parallel import ParallelDims, ParallelPlan, layout_figure, plot_rank_memory, plot_schedule
    from static_dist.parallel import plot_step_terms
    if which == "schedule 1F1B":
        return plot_schedule(ParallelPlan(ParallelDims(pp=4), stages=(1,) * 4, schedule="1F1B", microbatches=8))
    if which == "schedule interleaved":
        return plot_schedule(ParallelPlan(ParallelDims(pp=2), stages=(1,) * 4, schedule="Interleaved1F1B",
                                          microbatches=4))
    (mem, step_pp), (mem_tp, step_tp) = _parallel()["pp2"], _parallel()["tp2"]
    if which == "rank memory": return plot_rank_memory(mem)
    if which == "rank memory measured":   # a tracker's bytes by its categories, as verify_parallel gives them
        at = mem_tp.ranks[0].at_peak
        return plot_rank_memory(mem_tp, {"Sharded Param": at["sharded_params"], "OptState": at["optimizer_state"],
                                         "Activation": 2 * at["activations"], "Total": 0})
    if which == "step terms": return plot_step_terms(step_tp, measured_seconds=0.005)
    return layout_figure(mem, step_pp, 2**25) if which == "layout pp" else layout_figure(mem_tp, step_tp, 2**25)


def _fsdp_plot(which: str):
    from static_dist.fsdp import plot_fsdp_memory, plot_fsdp_timeline
    from static_dist.fsdp import _plan_figure
    rep, budget = _fsdp()
    if which == "memory": return plot_fsdp_memory(rep.memory, budget=budget)
    if which == "timeline": return plot_fsdp_timeline(rep.step)
    return _plan_figure(rep, budget if which == "harness" else 10 * rep.memory.peak_bytes)   # far: the note


def _stability_plot(which: str):
    from static_dist.stability import plot_run
    from static_dist.stability import _stability_view
    one, two = _stability_runs()
    if which == "run": return plot_run(one)
    if which == "two faults": return plot_run(two)
    # the harness at its shortest run and earliest fault (the sliders' ends): a spike rule's z-scores, a window's noise
    strategy, _, fault = which.partition(" ")
    return _stability_view(strategy, fault=fault or "lr_spike", fault_step=25, steps=40).fig


PLOTS = {
    "graph.plot_memory": _memory_graph,
    "topology.plot_calibration synthetic": lambda: _calibration(False),
    "topology.plot_calibration gloo4": lambda: _calibration(True),
    "placement.plot_plans": _placement,
    "placement harness (tiny, dgx-h100, 2x4)": lambda: _placement(harness=True),
    "fsdp.plot_fsdp_memory": lambda: _fsdp_plot("memory"),
    "fsdp.plot_fsdp_timeline": lambda: _fsdp_plot("timeline"),
    "fsdp harness": lambda: _fsdp_plot("harness"),
    "fsdp harness, budget off scale": lambda: _fsdp_plot("far"),
    "offload.plot_lifetimes": lambda: _offload("lifetimes"),
    "offload.plot_offload_memory": lambda: _offload("memory"),
    "offload harness": lambda: _offload("harness"),
    **{f"parallel {w}": functools.partial(_parallel_plot, w) for w in (
        "rank memory", "rank memory measured", "step terms", "schedule 1F1B", "schedule interleaved", "layout pp",
        "layout tp")},
    "stability.plot_run": lambda: _stability_plot("run"),
    "stability.plot_run, two faults": lambda: _stability_plot("two faults"),
    "stability harness rewind": lambda: _stability_plot("rewind"),
    "stability harness seed_window": lambda: _stability_plot("seed_window"),
    # a NaN gradient leaves the z-scores low: the threshold line runs along the top, where a legend inside would sit
    "stability harness rewind nan_grad": lambda: _stability_plot("rewind nan_grad"),
}


@pytest.mark.parametrize("name", list(PLOTS))
def test_no_legend_on_data(name):
    fig = PLOTS[name]()
    assert legends_on_data(fig) == []
    # labels written on the bars of a schedule are the data; every other pair of texts must stand apart
    assert overlapping_texts(fig, within="schedule" not in name) == []


# ---- the legends as they were before b432a41, on today's data: the check fails


def _stability_before(fig):
    "plot_run's fault labels inside the axes, as annotate(kind, (step, 1), ..., va='top') put them before b432a41."
    for t in fig.axes[0].texts: t.xy = t.xyann = (t.xy[0], 1.0); t.set_va("top")
    return fig


BEFORE = {   # plot, the legend as b432a41's parent placed it, what it covers on today's data
    "fsdp memory": (lambda: _fsdp_plot("memory"), dict(fontsize=6, loc="upper left", ncol=2), "'activations'"),
    "placement": (_placement, dict(fontsize=7), "Rectangle x4"),           # the wq bars and their neighbours
    "stability": (lambda: _stability_before(_stability_plot("two faults")), dict(fontsize=7, loc="upper right"),
                  "Text 'bad_batches'"),                                  # the fault label under the legend
}


@pytest.mark.parametrize("name", list(BEFORE))
def test_legend_before_b432a41_fails(name):
    draw, placement, covered = BEFORE[name]
    fig = draw()
    fig.axes[0].legend(**placement)
    bad = legends_on_data(fig)
    assert bad and covered in bad[0], bad


# ---- every function of the library that draws a legend, an annotation or a text is drawn above

DRAWN_BY = {   # function -> a case of PLOTS that draws it
    "_shade_phases": "graph.plot_memory", "plot_memory": "graph.plot_memory",
    "plot_calibration": "topology.plot_calibration synthetic", "plot_plans": "placement.plot_plans",
    "plot_fsdp_memory": "fsdp.plot_fsdp_memory", "plot_fsdp_timeline": "fsdp.plot_fsdp_timeline",
    "_scale_to_peak": "fsdp harness, budget off scale", "_phase_lines": "offload.plot_lifetimes",
    "_lifetime_legend": "offload.plot_lifetimes", "plot_offload_memory": "offload.plot_offload_memory",
    "plot_rank_memory": "parallel rank memory", "plot_step_terms": "parallel step terms",
    "plot_schedule": "parallel schedule 1F1B", "layout_figure": "parallel layout pp",
    "plot_run": "stability.plot_run", "_plot_rule": "stability harness rewind",
}


def test_every_labelling_function_is_drawn():
    "A new plot that draws a legend or a label fails here until a case of PLOTS draws it from its notebook's inputs."
    import ast
    found = set()
    for py in (ROOT / "static_dist").rglob("*.py"):
        for f in ast.walk(ast.parse(py.read_text())):
            if isinstance(f, ast.FunctionDef) and any(
                    isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
                    and c.func.attr in ("legend", "annotate", "text") for c in ast.walk(f)):
                found.add(f.name)
    assert found == set(DRAWN_BY), (found - set(DRAWN_BY), set(DRAWN_BY) - found)
    assert set(DRAWN_BY.values()) <= set(PLOTS)
