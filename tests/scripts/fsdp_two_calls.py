"""torch's fully_shard over 2 ranks as HSDP (2 replicas x 1 shard, gloo, CPU), AdamW, ft.LiveState:
which device mesh the DTensors of a call after an in-place restart are on. Rank FAIL_RANK SIGKILLs
itself at the start of step FAIL_AT in cycle 0; the other rank restarts in place and keeps its state.

At the end of each call every rank writes `<out>/dtensors_<rank>_<cycle>.json`: the step it resumed
at, how many of its DTensors (parameters, AdamW's state, a DTensor op's output) are on this call's
mesh (`mesh is`) and which are not, and the full parameters' checksum (full_tensor()).

usage: fsdp_two_calls.py OUT [--steps N] [--fail-at-step S --fail-rank R]
"""
import argparse
import json
import os
import signal

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import ft_launcher as ft


def train(args):
    rank, cycle = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    live = ft.LiveState(model=model, optimizer=opt)
    start = live.restore() or 0
    for step in range(start + 1, args.steps + 1):
        if step == args.fail_at_step and rank == args.fail_rank and cycle == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 1009 + rank))
        opt.zero_grad()
        nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        with live.commit(step):
            opt.step()
    with torch.no_grad():
        dtensors = {f"param {n}": p for n, p in model.named_parameters()}
        dtensors.update({f"state {i} {k}": v for i, s in opt.state.items() for k, v in s.items()
                         if isinstance(v, DTensor)})
        dtensors["op output"] = next(model.parameters()) * 1
        other = sorted(n for n, t in dtensors.items() if t.device_mesh is not mesh)
        checksum = float(sum(p.full_tensor().double().sum() for p in model.parameters()))
    with open(os.path.join(args.out, f"dtensors_{rank}_{cycle}.json"), "w") as fh:
        json.dump({"start": start, "dtensors": len(dtensors), "other_mesh": other, "checksum": checksum}, fh)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--fail-at-step", type=int, default=None)
    p.add_argument("--fail-rank", type=int, default=1)
    ft.restartable(train)(p.parse_args())


if __name__ == "__main__":
    main()
