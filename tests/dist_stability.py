"""torchrun script (not collected by pytest): FSDP2 gradient norms vs a single process, a NaN on one rank skipped by all.
Launched by tests/test_stability_dist.py; writes rank 0's report as JSON to the path in argv[1]."""
import json
import os
import sys

import torch
import torch.distributed as dist

from static_dist.stability import fsdp_check

if __name__ == "__main__":
    torch.set_num_threads(1)
    rep = fsdp_check()
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f: json.dump(rep, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    # skip interpreter teardown: gloo's threads can abort the process there ('terminate called without
    # an active exception') after all work is done and written
    sys.stdout.flush(); sys.stderr.flush(); os._exit(0)
