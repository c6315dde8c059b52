"The full compatibility matrix of every kernel op, inductor compile included (the notebook skips compile for speed)."
import os

os.environ.setdefault("TRITON_INTERPRET", "1")                       # before anything imports triton
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/static_dist_inductor")

import pytest
import torch

from static_dist.ops import KERNEL_OPS, PATHS, compat_matrix

EXPECTED_NOT_PASS = {"load_without_import": "expected_fail", "overhead": "info"}
if not torch.cuda.is_available(): EXPECTED_NOT_PASS["eager_gpu"] = "skip"


@pytest.mark.parametrize("op", KERNEL_OPS, ids=lambda b: b.short_name)
def test_full_matrix(op):
    rep = compat_matrix(op)
    assert tuple(c.path for c in rep.cells) == PATHS                  # every path ran
    st = rep.statuses()
    assert {p: s for p, s in st.items() if s != "pass"} == EXPECTED_NOT_PASS, rep.to_markdown()
    # the expected failure is the real one: a fresh process cannot resolve the op by name
    assert f"static_dist.{op.short_name}" in rep.cell("load_without_import").error
    assert "import static_dist.ops" in rep.cell("load_without_import").fix
    assert "inductor" in rep.cell("compile").detail


def test_backward_ops_matrix():
    "The bridged backward ops have no autograd of their own: gradcheck is skipped with the reason, the rest passes."
    for name in ("softmax_backward", "rms_norm_backward"):
        rep = compat_matrix(name, skip=("compile", "load_without_import", "overhead", "onnx"))
        st = rep.statuses()
        assert st["gradcheck"] == "skip" and "non-differentiable" in rep.cell("gradcheck").detail
        assert all(s == "pass" for p, s in st.items() if p not in ("gradcheck", "eager_gpu")), rep.to_markdown()


def test_matrix_bad_input():
    with pytest.raises(ValueError, match="bridged ops"): compat_matrix("nope")
    with pytest.raises(ValueError, match="choose from"): compat_matrix("softmax", skip=("jit",))
