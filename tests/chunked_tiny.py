"""The zoo's tiny Llama with its loss in chunks (`step.ChunkedLoss`, torchtitan's ChunkedLossWrapper flow) as a
Workload: `load_workload("tests/chunked_tiny.py:tiny_chunked")`, for the gloo run of tests/test_parallel_dist.py."""
import torch.nn.functional as F

from static_dist.step import ChunkedLoss
from static_dist.workload import Workload, load_workload

CHUNKS = 4


def _piece_loss(logits, y):
    "One piece's cross-entropy summed and divided by the micro-batch's tokens: the pieces add up to the mean."
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum") / (y.numel() * CHUNKS)


def tiny_chunked() -> Workload:
    w = load_workload("tiny", batch=4, seq=32)
    w.loss = ChunkedLoss(_piece_loss, "output", CHUNKS)
    return w
