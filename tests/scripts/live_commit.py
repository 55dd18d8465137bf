"""A restart signal that lands inside `LiveState.commit` (between the gradient all-reduce and the end
of the optimizer step): 3 ranks, DDP on gloo, ft.LiveState, STEPS steps.

With FAULT=1, in cycle 0 at step K: rank 1, inside its commit after opt.step, writes
`<out>/in_commit` and sleeps 2 s (a slow optimizer step); rank 2 finishes its step, waits for that
file and raises. The launcher restarts the job in place while rank 1 is inside its commit; rank 0
has finished step K and waits in step K+1's all-reduce.
Every rank writes `<out>/restored_<rank>_<cycle>.json` after `restore()` (the step and the
parameter and momentum checksums it holds) and `<out>/final_<rank>.json` at the end.

usage: live_commit.py OUT FAULT
"""
import json
import os
import random
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import ft_launcher as ft

OUT, FAULT = sys.argv[1], sys.argv[2] == "1"
STEPS, K = 12, 6


def sums(model, opt):
    with torch.no_grad():
        params = float(sum(p.double().sum() for p in model.parameters()))
        momentum = float(sum(s["momentum_buffer"].double().sum() for s in opt.state.values() if "momentum_buffer" in s))
    return params, momentum


def write(name, data):
    with open(os.path.join(OUT, name), "w") as fh:
        json.dump(data, fh)


def train():
    rank, cycle = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo")
    torch.manual_seed(3)
    random.seed(3)   # LiveState keeps the RNG state (rng=True): replicas draw alike
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    live = ft.LiveState(model=model, optimizer=opt)
    start = live.restore()
    params, momentum = sums(model, opt)
    write(f"restored_{rank}_{cycle}.json", {"step": start, "params": params, "momentum": momentum})
    ddp = nn.parallel.DistributedDataParallel(model)
    ddp(torch.zeros(1, 8)).sum().backward()   # settle DDP's buckets now (as ddp_train does): exact resumes
    ddp.zero_grad(set_to_none=True)
    for step in range((start or 0) + 1, STEPS + 1):
        g = torch.Generator().manual_seed(step * 100 + rank)
        x = torch.randn(16, 8, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True)).backward()
        with live.commit(step):
            opt.step()
            if FAULT and cycle == 0 and step == K and rank == 1:
                open(os.path.join(OUT, "in_commit"), "w").close()
                time.sleep(2.0)
        if FAULT and cycle == 0 and step == K and rank == 2:
            while not os.path.exists(os.path.join(OUT, "in_commit")):
                time.sleep(0.01)
            raise RuntimeError("simulated exception while a peer is inside its commit")
    params, momentum = sums(model, opt)
    write(f"final_{rank}.json", {"params": params, "momentum": momentum})
    del ddp
    dist.destroy_process_group()


if __name__ == "__main__":
    ft.restartable(train)()
