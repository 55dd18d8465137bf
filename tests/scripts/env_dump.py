"""Rank script: join the process group, all-reduce once, write this rank's environment as JSON
(the launcher's keys, any SLURM_* variables inherited, the TORCH_NCCL_*, TORCH_FR_* and
CUDA_VISIBLE_DEVICES variables, and where `agent` is imported from: the
rank inherits the launcher's environment, so that names the tree under test)."""
import importlib.util
import json
import os
import sys

import torch
import torch.distributed as dist

KEYS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
        "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID"]
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
record = {k: os.environ.get(k) for k in KEYS}
record["allreduce"] = t.item()
record["argv"] = sys.argv[1:]
record.update({k: v for k, v in os.environ.items() if k.startswith(("SLURM_", "SLURMD_"))})
record.update({k: v for k, v in os.environ.items() if k.startswith(("TORCH_NCCL_", "TORCH_FR_", "CUDA_VISIBLE"))})
record["agent_origin"] = importlib.util.find_spec("ft_launcher.agent").origin
out = os.path.join(sys.argv[1], f"rank_{os.environ['RANK']}.json")
with open(out, "w") as fh:
    json.dump(record, fh)
print(f"hello from rank {os.environ['RANK']}", flush=True)
dist.destroy_process_group()
