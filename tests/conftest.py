import os

import pytest
import torch

# Triton kernels run on CPU only under the interpreter, which must be chosen before triton is first imported
# (torch.compile imports it); decide once for the whole session.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    "Tests marked gpu are skipped where no CUDA device exists (they are never the only test of a feature)."
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
