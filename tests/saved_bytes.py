"""What autograd saves, measured: a pack hook sees every tensor `save_for_backward` keeps (shared by the compile and
parallel-compile tests, which check the partitioner's saved set against it)."""
import tempfile
from pathlib import Path

import torch

CACHE = Path(tempfile.gettempdir()) / "static_dist_inductor_cache"   # Inductor's cache, shared by the compile tests


def measured_saved(fn, model, args, kwargs) -> int:
    """Bytes of the distinct storages autograd saves while `fn(*args, **kwargs)` runs forward and backward, the model's
    parameters and buffers and the inputs that need no grad (RoPE tables, masks: held once for the model) aside."""
    nograd = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if torch.is_tensor(a) and not a.requires_grad]
    skip, seen = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), *nograd]}, {}
    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip: seen[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t): out = fn(*args, **kwargs)
    out.float().sum().backward()
    return sum(seen.values())
