"""The table of parallel axes is the single source: ParallelDims, the plan file and the command line read it, and the
one mesh builder gives a plan the mesh torch's own `init_device_mesh` gives by hand, with FSDP sharding over
`dp_shard_cp`. Each test runs in a subprocess (a fake process group is one per process)."""
import dataclasses
import json
import subprocess
import sys

from static_dist.axes import AXES, MESH_DIMS, fsdp_dim, layout_mesh
from static_dist.parallel import ParallelDims, ParallelPlan


def test_parallel_dims_are_the_table():
    "A field per row, in the table's order; the plan file's `dims` keys are the same names."
    assert [f.name for f in dataclasses.fields(ParallelDims)] == [a.name for a in AXES]
    assert set(MESH_DIMS) == {a.name for a in AXES if not a.borrows}   # ep draws its ranks from dp_shard x cp
    d = ParallelDims(**{a.name: 2 for a in AXES})
    assert d.world == 2 ** len(MESH_DIMS)
    d = dataclasses.replace(d, cp=1, ep=1)  # the plan refuses cp x pp (context_parallel wraps no schedule) and ep x pp
    plan = ParallelPlan(d, stages=(1, 1), microbatches=2)
    assert sorted(json.loads(plan.to_json())["dims"]) == sorted(a.name for a in AXES)
    assert ParallelPlan.from_json(plan.to_json()).dims == d


def test_the_cli_pins_every_axis():
    from static_dist.app.cli import build_parser
    from static_dist.app.layout import PIN_DIMS
    assert PIN_DIMS == tuple(a.name for a in AXES)
    args = build_parser().parse_args(["plan", *[x for a in AXES for x in (f"--{a.name.replace('_', '-')}", "1")]])
    assert all(getattr(args, a.name) == 1 for a in AXES)


def test_cost_mesh_by_hand():
    "dp_replicate 2 x dp_shard 2 x cp 2 x tp 4 x pp 2: FSDP's two axes are one dim of 4, in torchtitan's order."
    m = layout_mesh(ParallelDims(dp_replicate=2, dp_shard=2, cp=2, tp=4, pp=2))
    assert (m.shape, m.names) == ((2, 2, 4, 4), ("pp", "dp_replicate", "dp_shard_cp", "tp"))
    assert fsdp_dim(ParallelDims(cp=2)) == "dp_shard_cp" and fsdp_dim(ParallelDims(tp=2)) is None


_MESH_2x2x2 = r"""
import torch
from torch.distributed.device_mesh import init_device_mesh
from static_dist.axes import device_mesh, fsdp_mesh
from static_dist.launch import process_group
from static_dist.parallel import ParallelDims, ParallelPlan, apply_parallel_plan
from static_dist.structure import find_structure
from static_dist.zoo import get_model
with process_group(fake_world=8):
    d = ParallelDims(dp_shard=2, cp=2, tp=2)
    mesh = device_mesh(d, "cpu")
    ref = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_shard", "cp", "tp"))     # torchtitan's, by hand
    ref_fsdp = ref["dp_shard", "cp"]._flatten("hand_dp_shard_cp")
    assert mesh.mesh_dim_names == ref.mesh_dim_names and mesh.mesh.tolist() == ref.mesh.tolist()
    for name in ("dp_shard", "cp", "tp"): assert mesh[name].mesh.tolist() == ref[name].mesh.tolist(), name
    assert mesh["dp_shard_cp"].mesh.tolist() == ref_fsdp.mesh.tolist()
    m = get_model("tiny").build("meta")
    styles = tuple((l.name, "rowwise" if l.name.endswith(("wo", "w2")) else "colwise")
                   for l in find_structure(m).main.linears)
    apply_parallel_plan(m, ParallelPlan(d, styles), mesh, seq=32)
    w = m.layers[0].attention.wq.weight                      # colwise over tp, then FSDP over dp_shard_cp
    print(w.device_mesh.mesh_dim_names, w.device_mesh.mesh.tolist(), tuple(w.to_local().shape), tuple(w.shape))
    assert w.device_mesh.mesh_dim_names == ("dp_shard_cp", "tp")
    assert w.device_mesh["dp_shard_cp"].mesh.tolist() == ref_fsdp.mesh.tolist()
    assert w.to_local().shape[0] == w.shape[0] // 8
"""


def _run(code: str) -> str:
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def test_2x2x2_mesh_matches_torch_by_hand():
    out = _run(_MESH_2x2x2)
    assert "('dp_shard_cp', 'tp')" in out


_FSDP_HSDP = r"""
from torch.distributed.device_mesh import init_device_mesh
from static_dist.fsdp import FSDPPlan, FSDPUnit, apply_plan
from static_dist.launch import process_group
from static_dist.zoo import get_model
with process_group(fake_world=4):
    m = get_model("tiny").build("meta")
    apply_plan(m, FSDPPlan(4, (2, 2), (FSDPUnit(""),)))           # the mesh: FSDP's default, the one builder
    w = m.layers[0].attention.wq.weight
    ref = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    assert w.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard_cp"), w.device_mesh.mesh_dim_names
    assert w.device_mesh.mesh.tolist() == ref.mesh.tolist()
    assert w.to_local().shape[0] == w.shape[0] // 2
"""


def test_fsdp_plan_uses_the_same_names():
    "An FSDP plan's (replicate, shard) mesh_shape is dp_replicate x dp_shard, sharded over dp_shard_cp."
    _run(_FSDP_HSDP)


_ONE_MORE_ROW = r"""
import json
import static_dist.axes as ax
row = ax.Axis("xp", "xp", 6, "split", "", ("all_to_all",), "A test row: an axis added to the table only.")
ax.AXES, ax.AXIS["xp"], ax.MESH_DIMS = ax.AXES + (row,), row, ax.MESH_DIMS + ("xp",)
from static_dist.app.cli import build_parser
from static_dist.launch import process_group
from static_dist.parallel import ParallelDims, ParallelPlan
d = ParallelDims(dp_shard=2, xp=2)                                   # a field, a degree of the world
assert d.world == 4 and d.mesh == ((2, 2), ("dp_shard", "xp")), d.mesh
assert ParallelPlan.from_json(ParallelPlan(d).to_json()).dims == d  # the plan file reads and writes it
assert build_parser().parse_args(["plan", "--xp", "2"]).xp == 2      # the command line pins it
with process_group(fake_world=4):
    mesh = ax.device_mesh(d, "cpu")
    assert mesh.mesh_dim_names == ("dp_shard", "xp") and mesh["xp"].size() == 2
print("ok")
"""


def test_a_new_row_is_a_new_axis_everywhere():
    "One more row in the table (an `xp` here) is a ParallelDims field, a plan-file key, a CLI pin and a mesh dim."
    assert _run(_ONE_MORE_ROW).strip().endswith("ok")
