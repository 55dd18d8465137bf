"""Rank script: all-reduce in a loop; global rank FAIL_RANK exits 1 at step 5 in cycles below
FAIL_CYCLES (-1: every cycle). Prints one line per rank when done."""
import os
import sys

import torch
import torch.distributed as dist

fail_rank, fail_cycles = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo")
cycle, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
for step in range(20):
    t = torch.ones(1)
    dist.all_reduce(t)
    if step == 5 and rank == fail_rank and (fail_cycles < 0 or cycle < fail_cycles):
        print(f"rank {rank} failing in cycle {cycle}", flush=True)
        os._exit(1)  # not sys.exit: torch's gloo teardown with a peer mid-collective may abort
print(f"rank {rank} done in cycle {cycle}", flush=True)
dist.destroy_process_group()
