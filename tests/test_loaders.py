"""#22: every loader of a user's file reads through the one bounded reader. Each is fed a 20 GB sparse file, a FIFO
nobody writes, a symlink to /dev/zero, a character device made here (as root), a folder, binary junk and (for JSON)
100,000 nested brackets: each gives its own typed error (a StaticDistError) within seconds, and none reads past its
limit. In-process and fast."""
import os
import stat
import threading

import pytest

from static_dist.files import MAX_SMALL_BYTES
from static_dist.errors import StaticDistError


def _loaders():
    from static_dist.artifact import MAX_KEY_BYTES, load_private_key, load_trusted_keys, verify_artifact
    from static_dist.export import ExportReport
    from static_dist.fsdp import FSDPPlan
    from static_dist.graph import load_graph
    from static_dist.offload import load_plan
    from static_dist.topology import MAX_TOPOLOGY_BYTES, load_topology
    from static_dist.workload_hf import hf_config
    return {
        "private key": (load_private_key, MAX_KEY_BYTES),
        "trusted keys": (load_trusted_keys, MAX_KEY_BYTES),
        "artifact": (lambda p: verify_artifact(p, trusted_keys=[]), None),
        "FSDP plan": (FSDPPlan.from_json, None),
        "offload plan": (load_plan, None),
        "topology": (load_topology, MAX_TOPOLOGY_BYTES),
        "graph": (load_graph, None),
        "export report": (ExportReport.load, None),
        "hf config": (lambda p: hf_config(str(p)), MAX_SMALL_BYTES),
    }


LOADERS = list(_loaders())


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    d = tmp_path_factory.mktemp("loaders")
    with open(d / "sparse.json", "wb") as f: f.truncate(20 * 10**9)
    os.mkfifo(d / "fifo.json")
    (d / "zero.json").symlink_to("/dev/zero")
    (d / "folder.json").mkdir()
    (d / "binary.json").write_bytes(bytes(range(256)) * 16)
    (d / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    kinds = ["sparse.json", "fifo.json", "zero.json", "folder.json", "binary.json", "deep.json"]
    if os.geteuid() == 0:                   # a character device like /dev/null, made in the test's folder
        os.mknod(d / "null.json", 0o666 | stat.S_IFCHR, os.makedev(1, 3)); kinds.append("null.json")
    return d, kinds


def _within(seconds, f):
    "f()'s outcome {'value' or 'error'}, or {'hung': True} after `seconds` (a FIFO read would block forever)."
    out = {}
    def run():
        try: out["value"] = f()
        except BaseException as e: out["error"] = e
    t = threading.Thread(target=run, daemon=True); t.start(); t.join(seconds)
    return out if not t.is_alive() else {"hung": True}


@pytest.mark.parametrize("loader", LOADERS)
def test_every_loader_refuses_hostile_files_with_its_typed_error(loader, hostile):
    d, kinds = hostile
    fn, _ = _loaders()[loader]
    for kind in kinds:
        out = _within(20, lambda: fn(d / kind))
        assert "error" in out, (loader, kind, out)
        e = out["error"]
        assert isinstance(e, StaticDistError), (loader, kind, type(e).__name__, e)
        assert "\n" not in str(e).strip(), (loader, kind, e)
    assert stat.S_ISFIFO(os.stat(d / "fifo.json").st_mode)                # looked at, never replaced or consumed


@pytest.mark.parametrize("loader", [n for n in LOADERS if _loaders()[n][1] is not None])
def test_small_files_are_refused_one_byte_past_their_limit(loader, tmp_path):
    "Keys, topologies, hf configs: refused from fstat at limit + 1 bytes (a plan or graph has its own, larger limit)."
    fn, limit = _loaders()[loader]
    p = tmp_path / "config.json"
    with open(p, "wb") as f: f.truncate(limit + 1)
    with pytest.raises(StaticDistError, match=f"{limit + 1:,} bytes, more than the {limit:,} allowed"): fn(p)


def test_a_zip_member_is_read_no_further_than_its_limit():
    "sign reads one member of the program's zip, archive_format: refused by its declared size before it is inflated."
    import io, zipfile
    from static_dist.artifact import NotExportedProgramError, check_exported_program
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("a/archive_format", b"\0" * (32 << 20)); z.writestr("a/models/m.json", "{}")
    with pytest.raises(NotExportedProgramError, match="declares 33,554,432 bytes inflated"):
        check_exported_program(buf.getvalue(), "bomb.pt2")
