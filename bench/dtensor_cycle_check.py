"""Does this torch hand a restarted call's DTensors the previous call's DeviceMesh, and does the
restart point's rank_side.dtensor_cycle.forget_meshes() stop it? (issue 30; torch 2.13 CPU: yes, yes)

    python bench/dtensor_cycle_check.py

In one process, world size 1, three calls as an in-place restart makes them (init_process_group,
a (1, 1) mesh, a DTensor op and fully_shard over a Linear, destroy_process_group): between calls 1
and 2 nothing is cleared, between 2 and 3 forget_meshes() runs. Prints, per backend (gloo on the
CPU; NCCL on cuda:0 where a GPU is usable), torch's version, the caches cleared, and per call
whether an op's output and fully_shard's parameters are on another call's mesh. Exit 1 if they
still are after forget_meshes(). Leaves no process or file behind.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def calls(device: str, backend: str) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from ft_launcher.rank_monitor.rank_side import dtensor_cycle

    store = tempfile.mkdtemp(prefix="dtensor_cycle_")
    out = {"op": [], "fully_shard": [], "cleared": []}
    try:
        for call in range(3):
            dist.init_process_group(backend, store=dist.FileStore(os.path.join(store, str(call)), 1), rank=0,
                                    world_size=1)
            mesh = init_device_mesh(device, (1, 1), mesh_dim_names=("replicate", "shard"))
            t = DTensor.from_local(torch.arange(4.0, device=device), mesh, [Replicate(), Shard(0)])
            out["op"].append((t + 1).device_mesh is not mesh)
            layer = nn.Linear(4, 4, device=device)
            fully_shard(layer, mesh=mesh)
            out["fully_shard"].append(any(p.device_mesh is not mesh for p in layer.parameters()))
            dist.destroy_process_group()
            dist.distributed_c10d._world.group_count = 0
            if call == 1:
                out["cleared"] = dtensor_cycle.forget_meshes()
    finally:
        shutil.rmtree(store, ignore_errors=True)
    return out


def main() -> int:
    import torch

    runs = [("cpu", "gloo")]
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
        runs.append(("cuda", "nccl"))
    else:
        print("no usable CUDA GPU: the CPU (gloo) only")
    print(f"torch {torch.__version__}")
    bad = False
    for device, backend in runs:
        got = calls(device, backend)
        print(f"{backend} on {device}: caches cleared: {', '.join(got['cleared']) or 'none'}")
        for call in range(3):
            when = ("first call" if call == 0 else "after a restart, nothing cleared" if call == 1
                    else "after a restart, forget_meshes()")
            print(f"  call {call} ({when}): op output on another call's mesh: {got['op'][call]}; "
                  f"fully_shard's parameters: {got['fully_shard'][call]}")
        bad = bad or got["op"][2] or got["fully_shard"][2]
    print("RESULT:", "stale meshes remain after forget_meshes()" if bad else "every DTensor on its own call's mesh")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
