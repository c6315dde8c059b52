"""#22, the second round of hostile input, as a user types it: every case of the issue that the command line sees gets
exit status 2 and one line (or, for `train`, exit 3 with the numbers). In-process (`main(argv)`), so the whole file
takes seconds: most cases are refused before any capture, and the few that capture use a two-layer model."""
import contextlib
import io
import json
import os
import stat
import zipfile

import pytest

from static_dist.app.cli import main

M = "import os, sys, torch, torch.nn as nn\n"
TOKEN_MODEL = M + (
    "class M(nn.Module):\n    def __init__(self):\n        super().__init__(); self.e = nn.Embedding(16, 8); "
    "self.l = nn.Linear(8, 16)\n    def forward(self, x):\n        {body}\n"
)
MODELS = {
    "exit_import.py": M + "sys.exit(0)\nclass M(nn.Module): pass\n",
    "exit_ctor.py": M + "class M(nn.Module):\n    def __init__(self):\n        super().__init__(); sys.exit(0)\n",
    "exit_fwd.py": TOKEN_MODEL.format(body="sys.exit(0)"),
    "exit3_fwd.py": TOKEN_MODEL.format(body="sys.exit(3)"),
    "osexit_fwd.py": TOKEN_MODEL.format(body="os._exit(0)"),
    "kbint_fwd.py": TOKEN_MODEL.format(body="raise KeyboardInterrupt"),
    "odd_import.py": M + "class Odd(BaseException): pass\nraise Odd('boom')\n",
    "lin.py": M + "class M(nn.Module):\n    def __init__(self):\n        super().__init__(); self.l = nn.Linear(8, 4)\n"
                  "    def forward(self, x):\n        return self.l(x)\n",
}


def run_main(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try: code = main([str(a) for a in argv])
        except SystemExit as e: code = e.code
    return code, err.getvalue()


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    "Inputs of the cases: model files, a key pair and a program, sparse files, a FIFO, bad topologies."
    import torch
    d = tmp_path_factory.mktemp("hostile")
    for name, src in MODELS.items(): (d / name).write_text(src)
    (d / "afile").write_text(MODELS["lin.py"])
    assert run_main(["keygen", "--out", d / "k"])[0] == 0
    torch.export.save(torch.export.export(torch.nn.Linear(2, 2), (torch.randn(1, 2),)), d / "x.pt2")
    with zipfile.ZipFile(d / "x.pt2") as z, zipfile.ZipFile(d / "bomb.pt2", "w", zipfile.ZIP_DEFLATED) as o:
        for i in z.infolist():                      # the same archive with archive_format inflating to 16 MiB
            o.writestr(i.filename, b"\0" * (16 << 20) if i.filename.endswith("/archive_format") else z.read(i.filename))
    for name in ("big.key", "big.pub", "big.pt2", "big.json"):
        with open(d / name, "wb") as f: f.truncate(20 * 10**9)      # 20 GB that take no disk
    os.mkfifo(d / "fifo.json"); (d / "zero.json").symlink_to("/dev/zero")
    (d / "bin.json").write_bytes(bytes(range(256)) * 4)
    from static_dist.topology import preset
    good = preset("dgx-h100").to_dict()
    for name, change in {"levels_int": dict(levels=3), "hostlink_str": dict(host_link="pcie"),
                         "flops0": dict(device_flops=0)}.items():
        (d / f"topo_{name}.json").write_text(json.dumps({**good, **change}))
    (d / "topo_ndev.json").write_text(
        json.dumps(good).replace(f'"n_devices": {good["n_devices"]}', '"n_devices": 1e400')
    )
    return d


def cases(d):
    "(argv, words in the one line): each refused with exit status 2."
    key, pub, prog = d / "k.key", d / "k.pub", d / "x.pt2"
    sign = ["sign", prog, "--key", key, "--out", d / "o.sdxa"]
    return [
        # 3. bounded reads: sparse files, FIFOs, devices, a zip bomb, binary JSON
        (["sign", prog, "--key", d / "big.key", "--out", d / "o.sdxa"], "20,000,000,000 bytes, more than"),
        (["sign", d / "big.pt2", "--key", key, "--out", d / "o.sdxa"], "20,000,000,000 bytes, more than"),
        ([*sign, "--device-json", d / "big.json"], "20,000,000,000 bytes, more than"),
        ([*sign, "--device-json", d / "bin.json"], "not UTF-8 text"),
        (["verify", prog, "--trusted-key", d / "big.pub"], "20,000,000,000 bytes, more than"),
        (["sign", d / "bomb.pt2", "--key", key, "--out", d / "o.sdxa"], "archive_format declares 16,777,216 bytes"),
        (["plan-placement", "--topology", d / "zero.json"], "not a regular file (a device)"),
        (["plan-placement", "--topology", d / "fifo.json"], "not a regular file (a FIFO)"),
        (["plan-placement", "--topology", d / "big.json"], "20,000,000,000 bytes, more than"),
        # 7. tracebacks that were left
        (["capture", "--save", d / ("x" * 300)], "a file name has at most 255"),
        (["audit", "--out", d / ("x" * 300)], "a file name has at most 255"),
        (["capture", "--model", f"{d / 'afile'}:M"], "not a Python file"),
        (
            ["capture", "--model", f"{d / 'lin.py'}:M", "--input-shape", "99999999999999999999x8"],
            "at most 2,147,483,647",
        ),
        (["keygen", "--out", "/"], "is a folder"),
        (["keygen", "--out", f"{d}/"], "is a folder"),
        # 9. late validation, topology files
        (["audit", "--budget", "0", "--out", d / "a"], "--budget must be at least 1 byte"),
        (["train", "--budget", "0"], "--budget must be at least 1 byte"),
        (["plan-placement", "--topology", d / "topo_levels_int.json"], "topology.levels: expected a list, found 3"),
        (["plan-placement", "--topology", d / "topo_hostlink_str.json"], "topology.host_link: expected an object"),
        (["plan-placement", "--topology", d / "topo_ndev.json"], "topology.n_devices: expected an integer"),
        (
            ["plan-placement", "--topology", d / "topo_flops0.json"],
            "topology.device_flops: expected a finite number > 0",
        ),
        # 10. contradictory flags
        (["plan-fsdp", "--plan", __file__, "--world", "3", "--mesh", "3x1"], "--plan with --world"),
        (["plan-fsdp", "--plan", __file__, "--mesh", "3x1"], "--plan with --mesh"),
        (["plan-fsdp", "--plan", __file__, "--unit", "nosuch"], "--plan with --unit"),
        (["plan-fsdp", "--ignore", "layers.0", "--unit", "layers.0"], "--ignore layers.0 and --unit layers.0"),
        (["plan-fsdp", "--mesh", "3x3", "--world", "8"], "make them agree"),
        (["check-export", "--rules", "--targets", "foo"], "--rules prints the rule table"),
        (["plan-fsdp", "--plan", __file__, "--precision", "fp32"], "--plan with --precision"),
        (["plan-fsdp", "--plan", __file__, "--accumulation", "4"], "--plan with --accumulation"),
        (["check-export", "--rules", "--out", d / "r"], "checks nothing; drop --out"),
        (
            ["check-export", "--model", "mlp", "--targets", "", "--out", d / "r"],
            "--targets '': use a comma-separated list",
        ),
        (["stability", "--fault", "nan_grad@5x99999999999999999999"], "longer than any run"),
        (["stability", "--fault", "nan_grad@5x50", "--steps", "10"], "lasts past the end of the run"),
        ([*sign, "--meta", "a=1", "--meta", "a=2"], "--meta a given twice"),
        (["train", "--no-compile", "--backend", "inductor"], "give one of them"),
        # 6. model code that exits or interrupts: one line naming the file and line
        (["capture", "--model", f"{d / 'exit_import.py'}:M"], "called sys.exit(0) at"),
        (["capture", "--model", f"{d / 'exit_ctor.py'}:M"], "exit_ctor.py:4 (in __init__)"),
        (["capture", "--model", f"{d / 'odd_import.py'}:M"], "raised Odd: boom at"),
        (["capture", "--model", f"{d / 'exit_fwd.py'}:M"], "exit_fwd.py:6 (in forward)"),
        (["capture", "--model", f"{d / 'exit3_fwd.py'}:M"], "called sys.exit(3)"),
        (["capture", "--model", f"{d / 'osexit_fwd.py'}:M"], "called os._exit(0)"),
        (["capture", "--model", f"{d / 'kbint_fwd.py'}:M"], "raised KeyboardInterrupt at"),
        # 6. resource guards before allocation
        (["capture", "--model", "llama3-405b", "--mode", "real"], "limited to 200M"),
        (["bench", "offload", "--model", "llama3-405b", "--out", d / "b"], "limited to 200M"),
        (["train", "--model", "llama3-405b"], "limited to 200M"),
        (["capture", "--model", "mlp", "--batch", "2147483647", "--mode", "real"], "more than half of the"),
        (["stability", "--batch", "65536", "--steps", "2"], "more than half of the"),
    ]


def test_every_case_is_one_line_exit_2(fx):
    bad = []
    for argv, words in cases(fx):
        code, err = run_main(argv)
        if code != 2 or words not in err or "Traceback" in err or len(err.strip().splitlines()) != 1:
            bad.append((argv[:3], code, err.strip()[-300:]))
    assert not bad, "\n".join(map(str, bad))
    assert not any((fx / n).exists() for n in ("o.sdxa", "a", "b", "r"))                              # nothing written


def test_what_the_fake_capture_allows(fx):
    """A fake capture builds no real input: 2**31-1 samples, or samples of 10**10 floats, capture without allocating
    them; a peak no known device holds is then said in one line, exit 3 (a predicted out of memory, as train's)."""
    for argv in (
        ["capture", "--model", "mlp", "--batch", "2147483647", "--json"],
        [
            "capture",
            "--model",
            f"{fx / 'lin.py'}:M",
            "--input-shape",
            "100000x100000x8",
            "--optimizer",
            "none",
            "--json",
        ],
    ):
        code, err = run_main(argv)
        assert code == 3 and "fits no known device" in err and len(err.strip().splitlines()) == 1, err


def test_train_refuses_a_predicted_oom_with_the_numbers(tmp_path):
    code, err = run_main(["train", "--model", "tiny", "--seq", "16", "--steps", "1", "--budget", "1", "--no-compile",
                          "--log", tmp_path / "log.json"])
    assert code == 3 and "predicted out of memory" in err and "the budget is 1 B" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "log.json").exists()


def test_hf_configs_refused_in_one_line(tmp_path):
    """An encoder head, an encoder-decoder, a vocabulary or positions limit of 0: one line each, transformers' warnings
    silenced."""
    transformers = pytest.importorskip("transformers")
    base = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, vocab_size=64)
    transformers.BertConfig(**base, architectures=["BertForMaskedLM"]).save_pretrained(tmp_path / "bert")
    transformers.T5Config(num_layers=1, d_model=32, d_ff=64, num_heads=2, d_kv=16, vocab_size=64).save_pretrained(
        tmp_path / "t5"
    )
    transformers.LlamaConfig(**base, max_position_embeddings=0).save_pretrained(tmp_path / "pos0")
    transformers.LlamaConfig(**base).save_pretrained(tmp_path / "vocab0")
    cfg = json.loads((tmp_path / "vocab0" / "config.json").read_text())
    (tmp_path / "vocab0" / "config.json").write_text(json.dumps({**cfg, "vocab_size": 0}))
    for name, words in (("bert", "BertForMaskedLM, an encoder head"), ("t5", "encoder-decoder model"),
                        ("pos0", "max_position_embeddings is 0, so no sequence fits"), ("vocab0", "vocab_size is 0")):
        code, err = run_main(["capture", "--model", f"hf:{tmp_path / name}"])
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, (name, err)
        assert "mode='real'" not in err and "seq 0 or less" not in err


def test_passes_rewrite_keeps_torchs_graph_dump_out(capfd):
    "torch logs the failing graph (48 lines) before export raises: the user sees one line."
    code = main(["passes", "rewrite", "--model", "control-flow"])
    err = capfd.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "does not export" in err, err


def test_an_interrupt_while_a_module_imports_is_an_interrupt(tmp_path, monkeypatch):
    "A SIGINT that lands in a class body's __set_name__ reaches us as a RuntimeError: still 'interrupted', exit 130."
    (tmp_path / "sigint_at_import.py").write_text(
        "import os, signal, torch.nn as nn\nclass D:\n    def __set_name__(self, owner, name): os.kill(os.getpid(), "
        "signal.SIGINT)\n"
        "class M(nn.Module):\n    x = D()\n"
    )
    monkeypatch.chdir(tmp_path)
    code, err = run_main(["capture", "--model", "sigint_at_import:M"])
    assert code == 130 and err.strip() == "interrupted", (code, err)


def test_a_model_file_that_is_a_fifo_is_named_so(fx):
    os.mkfifo(fx / "fifo_model.py")
    code, err = run_main(["capture", "--model", f"{fx / 'fifo_model.py'}:M"])
    assert code == 2 and "is a FIFO, not a Python file" in err, err
