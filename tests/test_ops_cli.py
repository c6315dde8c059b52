"`static-dist ops ...` and `static-dist bench kernels` through the real entry point."
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import json

import pytest
import torch

from static_dist.app.cli import main


def test_ops_list(capsys):
    assert main(["ops", "list"]) == 0
    out = capsys.readouterr().out
    for name in ("softmax", "add_relu", "rms_norm", "softmax_backward", "rms_norm_backward"):
        assert f"static_dist::{name}" in out
    assert "triton, cuda, reference" in out                        # softmax has both GPU kernels


def test_ops_matrix_json(capsys):
    skip = "compile,load_without_import,onnx,overhead,opcheck,gradcheck,export,export_roundtrip"
    assert main(["ops", "matrix", "rms_norm", "--skip", skip, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["op"] == "static_dist::rms_norm"
    assert {c["path"]: c["status"] for c in rep["cells"]}["triton_interpreter"] == "pass"


def test_ops_bad_input(capsys):
    assert main(["ops", "matrix", "gelu"]) == 2
    assert "bridged ops" in capsys.readouterr().err
    assert main(["ops", "matrix", "softmax", "--skip", "jit"]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU message")
def test_bench_kernels_needs_gpu(capsys):
    assert main(["bench", "kernels"]) == 2
    assert "CUDA GPU" in capsys.readouterr().err
