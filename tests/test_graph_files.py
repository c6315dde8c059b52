"""Graph files in: every field checked, a typed error naming it, never a wrong graph. Graph files out: atomic writes."""
import copy
import functools
import json
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from static_dist.graph import GRAPH_SCHEMA, GraphFileError, StaticGraph, capture, graph_from_dict, load_graph
from static_dist.errors import InputError, StaticDistError


class _Net(nn.Module):
    "Two identical blocks at `net.1`, `net.2` (a structure to store), between an input and an output layer."
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(6, 8), nn.Linear(8, 2)
        self.net = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2))
    def forward(self, x):
        h = self.inp(x)
        for b in self.net: h = b(h)
        return self.out(h)


@functools.cache
def _graph() -> StaticGraph:
    "A small step with every table filled: a block stack, saves/unpacks, an optimizer."
    torch.manual_seed(0)
    return capture(_Net(), (torch.randn(3, 6),), loss_fn=F.mse_loss, targets=torch.randn(3, 2), optimizer="adam")


def _doc() -> dict:
    return json.loads(json.dumps(_graph().to_dict()))


def test_the_fixture_has_what_the_mutations_need():
    g = _graph()
    assert g.structure.main is not None and g.structure.main.path == "net"
    assert g.saves and g.unpacks and any(s.freed is None for s in g.storages) and any(s.saved_in for s in g.storages)
    assert graph_from_dict(_doc()) == g


# --- where each kind of value is allowed -------------------------------------------------------------------------
_STR = {"schema", "module", "name", "device", "dtype", "op_names", "path", "block_type", "blocks", "role"}
_ACCEPTS = {"saved_in": (type(None), str), "freed": (type(None), int), "bias": (bool,)}


def _accepts(path: tuple, value) -> tuple:
    "The JSON types a legitimate file may hold at `path` (the last dict key names the column or field)."
    if isinstance(value, dict): return (dict,)
    if isinstance(value, list): return (list,)
    key = next(k for k in reversed(path) if isinstance(k, str))
    return _ACCEPTS.get(key, (str,) if key in _STR else (int,))


def _paths(node, path=()):
    "Every path in the document, except inside meta's free-form entries (all of meta.structure is included)."
    yield path
    if path[:1] == ("meta",) and len(path) >= 2 and path[1] != "structure": return
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items: yield from _paths(v, path + (k,))


def _at(doc, path):
    for k in path: doc = doc[k]
    return doc


def _free_form(path) -> bool:
    "Edits here are a user's business: meta's own entries, and dropping meta.structure (a graph saved without one)."
    return path[:1] == ("meta",) and len(path) >= 2 and (path[1] != "structure" or len(path) == 2)


_OTHERS = [None, True, 1.5, "x", [], {}, 7]


@st.composite
def _mutation(draw):
    doc = _doc()
    paths = [p for p in _paths(doc) if p]
    path = draw(st.sampled_from(paths))
    parent, key, old = _at(doc, path[:-1]), path[-1], _at(doc, path)
    kind = draw(st.sampled_from(["delete", "retype", "negative", "schema"]))
    if kind == "schema":
        path, parent, key = ("schema",), doc, "schema"
        new = draw(st.sampled_from(["", "static_dist.graph/3", "static_dist.graph/0", "static_dist.fsdp_plan/1",
                                    "STATIC_DIST.GRAPH/2"]))
        parent[key] = new
    elif kind == "delete":
        if isinstance(parent, list):   # only a whole row of a column (the columns then disagree): dropping an item
            assume(len(path) == 3 and path[0] != "meta")   # of a variable-length list (an op's inputs) is a new graph
        del parent[key]
    elif kind == "retype":
        allowed = _accepts(path, old)
        parent[key] = draw(st.sampled_from([v for v in _OTHERS if type(v) not in allowed]))
    else:
        assume(type(old) is int)
        parent[key] = -2 - draw(st.integers(0, 10**6))
    return path, kind, doc


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_mutation())
def test_a_mutated_graph_is_refused_or_unchanged(m):
    path, kind, doc = m
    g = _graph()
    try:
        got = graph_from_dict(doc)
    except GraphFileError as e:
        msg = str(e)
        assert len(msg.splitlines()) == 1 and msg
        # the message starts with the path of a field in the file ('ops.inputs[3][0]: ...')
        assert msg.split(":")[0].split(".")[0].split("[")[0] in set(_doc()), (path, msg)
        if path[0] not in ("op_names", "tensors", "storages"):   # their rows are what other tables point at
            assert msg.startswith(path[0]) or msg.startswith("schema"), (path, msg)
        return
    # it loaded: then the edit was one a user may make (meta), or it dropped an optional field whose default is the
    # value
    # it had (a linear's `shardable`, which older files lack), and nothing the analyses read changed
    assert _free_form(path) or got.structure == g.structure, (path, kind, "a bad file loaded")
    assert (got.ops, got.tensors, got.storages, got.saves, got.unpacks) == (
        g.ops,
        g.tensors,
        g.storages,
        g.saves,
        g.unpacks,
    )


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_a_truncated_file_is_refused(tmp_path_factory, data):
    raw = json.dumps(_graph().to_dict(), separators=(",", ":")).encode()
    cut = data.draw(st.integers(0, len(raw)))
    p = tmp_path_factory.mktemp("cut") / "g.json"
    p.write_bytes(raw[:cut])
    if cut == len(raw):
        assert load_graph(p) == _graph()
    else:
        with pytest.raises(GraphFileError, match="g.json: "):
            load_graph(p)


# --- the cases the issue names ---------------------------------------------------------------------------------------
def _edit(path, value):
    doc = _doc()
    _at(doc, path[:-1])[path[-1]] = value
    return doc


@pytest.mark.parametrize("path,value,message", [
    (("storages", "nbytes", 3), -5, "storages.nbytes[3]: expected an integer from 0 to 2**62, found -5"),
    (("ops", "op", 0), 10**6, "ops.op[0]: expected an integer from 0 to "),
    (("ops", "outputs", 1, 0), -1, "ops.outputs[1][0]: expected an integer from 0 to "),
    (("storages", "role", 2), "weights", 'storages.role[2]: expected one of "parameter", "buffer"'),
    (("tensors", "dtype", 0), "float99", 'tensors.dtype[0]: expected a torch dtype name such as "float32", found '
                                         '"float99"'),
    (("tensors", "storage", 0), 10**6, "(a storage id), found 1000000"),
    (("ops", "flops", 0), 1.5, "ops.flops[0]: expected an integer from 0 to 2**63-1, found 1.5"),
    (("storages", "created", 0), True, "storages.created[0]: expected an integer from -1 to "),
    (("saves", "tensor", 0), -1, "saves.tensor[0]: expected an integer from 0 to "),
    (("meta", "structure", "stacks", 0, "params_per_block"), -3, "meta.structure.stacks[0].params_per_block: expected "
                                                                 "an integer from 0 to 2**63-1, found -3"),
    (("meta",), [], "meta: expected an object, found []"),
])
def test_named_bad_fields(path, value, message):
    with pytest.raises(GraphFileError) as e:
        graph_from_dict(_edit(path, value))
    assert message in str(e.value), str(e.value)
    assert f"found {json.dumps(value)}" in str(e.value), str(e.value)     # the value found, as the file writes it
    assert isinstance(e.value, StaticDistError) and isinstance(e.value, ValueError)


# --- rows that are each in range but not a step together (issue #22) -----------------------------------------------
def _storage_made_and_freed() -> int:
    return next(s.id for s in _graph().storages if s.created >= 0 and s.freed is not None)


def _reversed_phases() -> list:
    return _doc()["ops"]["phase"][::-1]


def _twice() -> dict:
    return {k: v + v for k, v in _doc()["ops"].items()}


@pytest.mark.parametrize("path,value,message", [
    (("storages", "nbytes", 3), 2**70, "storages.nbytes[3]: expected an integer from 0 to 2**62, found "
                                       "1180591620717411303424"),
    (("tensors", "shape", 0), [10**12, 10**12], "tensors.shape[0]: expected a shape of at most 2**62 bytes, "
                                                "found [1000000000000, 1000000000000] (float32: 4e+24 bytes)"),
    (("storages", "nbytes"), lambda: [2**60] * len(_graph().storages), "storages.nbytes: expected at most 2**62 bytes "
                                                                       "in all"),
    (("storages", "freed", "made"), lambda: _graph().storages[_storage_made_and_freed()].created - 1,
     "expected null or an op index >= created"),
    (("storages", "freed"), lambda: [-1] * len(_graph().storages), "expected null or an op index >= created"),
    (("ops", "phase"), _reversed_phases, "ops.phase["),
    (("ops",), _twice, "or more (op "),
    (("tensors", "id", 2), 1, "tensors.id[2]: expected 2 (rows are numbered in order, so no id repeats), found 1"),
])
def test_rows_that_break_the_step_are_refused(path, value, message):
    if path[-1] == "made": path = path[:-1] + (_storage_made_and_freed(),)
    doc = _edit(path, value() if callable(value) else value)
    with pytest.raises(GraphFileError) as e:
        graph_from_dict(doc)
    assert message in str(e.value) and len(str(e.value).splitlines()) == 1, str(e.value)


def test_sizes_read_from_the_file_stay_within_int64():
    "What is accepted, the analyses can add up: peak and summary of the loaded graph equal the captured one's."
    g = graph_from_dict(_doc())
    assert sum(s.nbytes for s in g.storages) <= 2**62 and g.peak() == _graph().peak()


def test_a_huge_file_is_refused_before_reading(tmp_path):
    p = tmp_path / "big.json"
    p.write_text("{}")
    os.truncate(p, 20 * 2**30)  # 20 GB, sparse: nothing to read, fstat says its size
    with pytest.raises(GraphFileError, match=r"big.json: 21,474,836,480 bytes, more than the [\d,]+ allowed"):
        load_graph(p)


def test_a_file_nested_too_deep_is_refused_before_parsing(tmp_path):
    p = tmp_path / "deep.json"
    p.write_text('{"schema": "static_dist.graph/2", "meta": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(GraphFileError, match="deep.json: nested deeper than 64 levels"): load_graph(p)


def test_missing_keys_and_other_files(tmp_path):
    doc = _doc(); del doc["ops"]
    with pytest.raises(GraphFileError, match="^ops: missing; give an object$"): graph_from_dict(doc)
    doc = _doc(); del doc["storages"]["nbytes"]
    with pytest.raises(GraphFileError, match=r"^storages\.nbytes: missing; give a list$"): graph_from_dict(doc)
    plan = {"schema": "static_dist.fsdp_plan/1", "units": []}           # a plan file given as a graph
    with pytest.raises(GraphFileError, match="schema: expected 'static_dist.graph/2', found 'static_dist.fsdp_plan/1'"):
        graph_from_dict(plan)
    with pytest.raises(GraphFileError, match="expected a JSON object"): graph_from_dict([1, 2])
    fifo = tmp_path / "fifo"; os.mkfifo(fifo)
    with pytest.raises(GraphFileError, match="not a regular file"): load_graph(fifo)   # would block if read
    with pytest.raises(GraphFileError, match="not a regular file"): load_graph("/dev/zero")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(GraphFileError, match="list.json: expected a JSON object"): load_graph(tmp_path / "list.json")


def test_a_version_1_file_still_loads():
    doc = _doc()
    doc["schema"] = "static_dist.graph/1"
    del doc["saves"], doc["unpacks"]
    del doc["storages"]["saved_in"]
    g = graph_from_dict(doc)
    assert g.saves == () and g.unpacks == () and all(s.saved_in is None for s in g.storages)
    assert g.ops == _graph().ops


def test_save_is_atomic_and_refuses_to_replace_unasked(tmp_path):
    g = _graph()
    p = g.save(tmp_path / "g.json")
    before = p.read_bytes()
    with pytest.raises(InputError, match="exists"):
        g.save(p, force=False)
    assert p.read_bytes() == before
    g.save(p)                                                  # force (the default) replaces it
    assert load_graph(p) == g
    with pytest.raises(InputError, match="does not exist"):
        g.save(tmp_path / "nowhere" / "g.json")
    assert sorted(os.listdir(tmp_path)) == ["g.json"]          # no temporary files left behind
