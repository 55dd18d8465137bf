"""Rank script with no ft_launcher call: all-reduce in a loop; global rank RAISE_RANK raises
ValueError at step 5 in cycle 0 (uncaught) while its peers wait in the next all-reduce. Prints
where Python put it (sys.path[0], __name__) and one line per rank when done.

    raise_rank.py RAISE_RANK"""
import os
import sys

import torch
import torch.distributed as dist

raise_rank = int(sys.argv[1])
dist.init_process_group("gloo")
cycle, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
print(f"rank {rank} path0={sys.path[0]} name={__name__}", flush=True)
for step in range(20):
    t = torch.ones(1)
    dist.all_reduce(t)
    if step == 5 and rank == raise_rank and cycle == 0:
        raise ValueError(f"boom in rank {rank} at step {step}")
print(f"rank {rank} done in cycle {cycle}", flush=True)
dist.destroy_process_group()
os._exit(0)
