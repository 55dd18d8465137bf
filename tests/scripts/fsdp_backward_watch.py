"""The step guard's backward watch (rank_side.live.backward_watch) under torch's fully_shard over 2
ranks (gloo, CPU), on two meshes: pure FSDP (1-D, 2 shards) and HSDP (2 replicas x 1 shard).

Per mesh, the watch a LiveState turns on (LiveState.backward_watch, before the first forward: FSDP2
has no unsharded parameter yet) sees three backwards:
- step 1: rank 1's own backward makes a NaN (an autograd function in the model, on rank 1 only);
- step 2: the simulated fault's `backward` place (sdc_sim, `nan:2:once:1:backward`) hits rank 1;
- step 3: clean;
- step 4: rank 1's own NaN again, under a new watch (turned off and on after step 3: FSDP2's
  unsharded parameters exist by then, and are hooked at once).
Each rank writes `<out>/watch_<rank>.json`: per mesh and step, the watch's local() (its own
gradients, before FSDP's reduce-scatter), whether the reduced (sharded) gradients are all finite,
and what the watch says it injected. No optimizer step: the parameters stay clean.

usage: fsdp_backward_watch.py OUT
"""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ft_launcher as ft
from ft_launcher.rank_monitor import buddy_store
from ft_launcher.rank_monitor.rank_side.live import sdc_sim


class NanOnRank1(torch.autograd.Function):
    """Identity forward; its backward makes a NaN on rank 1 while `on` (a bad device's backward)."""
    on = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if NanOnRank1.on and dist.get_rank() == 1:
            g = g.clone()
            g.view(-1)[0] = float("nan")
        return g


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x):
        return self.b(NanOnRank1.apply(torch.tanh(self.a(x))))


def run(name, mesh, rank):
    torch.manual_seed(0)
    model = Net()
    fully_shard(model.a, mesh=mesh)
    fully_shard(model.b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = [p for p in model.parameters()]
    live = ft.LiveState(name=name, model=model)
    watch = live.backward_watch(0)   # (step 1's backward on)
    out = {}
    for step in (1, 2, 3, 4):
        if step == 4:
            live.backward_watch(3, on=False)
            watch = live.backward_watch(3)
        watch.next(step)
        NanOnRank1.on = step in (1, 4)
        os.environ[sdc_sim.ENV_SDC] = "nan:2:once:1:backward" if step == 2 else ""
        os.environ.pop(buddy_store.ENV_PREFIX, None)   # armed afresh for each mesh: once per process, not per job
        for p in params:
            p.grad = None
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 1009 + rank))
        model(x).pow(2).mean().backward()
        local = float(watch.local(torch.device("cpu")))
        reduced = all(bool(torch.isfinite(p.grad.to_local()).all()) for p in params)
        out[step] = {"local": local, "reduced_finite": reduced, "injected": watch.injected}
        watch.injected = None
    watch.remove()
    return out


def main():
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    meshes = {"fsdp": init_device_mesh("cpu", (world,), mesh_dim_names=("shard",)),
              "hsdp": init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))}
    result = {name: run(name, mesh, rank) for name, mesh in meshes.items()}
    with open(os.path.join(out_dir, f"watch_{rank}.json"), "w") as fh:
        json.dump(result, fh)
    dist.destroy_process_group()
    # leave without the interpreter's teardown: torch 2.13's gloo aborts at exit about 1 run in 4-6
    # after destroy_process_group ("terminate called without an active exception"; see
    # tests/scripts/nvrx_train_common.py's finish): this test is about the watch, not that
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
