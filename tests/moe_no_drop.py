"""The zoo's tiny-moe with a capacity factor of E / top_k, so that no token is ever dropped, as a Workload:
`load_workload("tests/moe_no_drop.py:tiny_moe_no_drop")`. A mixture's capacity is computed from the tokens it is given,
so a rank with a quarter of the batch has a quarter of the slots of one process holding the whole batch: with a
smaller factor the tokens each drops differ and an expert-parallel run cannot equal one process. At E / top_k every
expert has a slot for every token (capacity = tokens) on every rank and in the single process alike."""
from static_dist.workload import Workload, load_workload
from static_dist.zoo import MoE


def tiny_moe_no_drop(batch: int = 4, seq: int = 32) -> Workload:
    w = load_workload("tiny-moe", batch=batch, seq=seq)
    build = w.build

    def no_drop(*args, **kwargs):
        m = build(*args, **kwargs)
        for moe in (x for x in m.modules() if isinstance(x, MoE)): moe.capacity_factor = moe.n_experts / moe.top_k
        return m

    w.build = no_drop
    return w
