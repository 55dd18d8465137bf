"""Rank script for the fake NVML (tests/fake_nvml): record this rank's pid as a process on the GPU,
then all-reduce a few times; rank 1 exits 1 in cycle 0 (a crash to restart from)."""
import os

import torch
import torch.distributed as dist

open(os.path.join(os.environ["FAKE_NVML_DIR"], str(os.getpid())), "w").close()
dist.init_process_group("gloo")
cycle, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
for step in range(10):
    t = torch.ones(1)
    dist.all_reduce(t)
    if step == 3 and rank == 1 and cycle == 0:
        os._exit(1)
print(f"rank {rank} done in cycle {cycle}", flush=True)
dist.destroy_process_group()
