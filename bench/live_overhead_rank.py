"""The job of bench/live_overhead.py: one MLP with AdamW over 2 gloo ranks, as DDP
(`ft.LiveState(model=, optimizer=)`) or as FSDP2 through PyTorch's DCP recipe
(`ft.LiveState(app=AppState(model, optimizer))`, examples/hsdp_train.py's AppState over
`fully_shard` on a 1-D mesh), with or without the LiveState, under ft.restartable either way.

Each rank writes <out>/rank_<r>.json at its end: its peak RSS (VmHWM of /proc/self/status) and its
RSS before the model was built, the bytes of its own parameters and optimizer state, what the
LiveState counted (`commit_bytes` of the last commit, their total, `in_place_bytes`, commits) and the
median step time.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import ft_launcher as ft  # noqa: E402


def status_kb(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def local_bytes(tensors) -> int:
    out = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        out += t.numel() * t.element_size()
    return out


def train(args):
    rank = int(os.environ.get("RANK", 0))
    dist.init_process_group("gloo")
    before = status_kb("VmRSS")
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(args.width, 1))
    opt = None
    if args.form == "app":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from hsdp_train import AppState

        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("shard",))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        objects = {"app": AppState(model, opt)}
        net = model
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        objects = {"model": model, "optimizer": opt}
        net = None
    live = ft.LiveState(**objects, buddy_every=args.buddy_every, buddy_keep=args.buddy_keep) if args.live else None
    start = (live.restore() if live is not None else None) or 0
    if net is None:
        net = nn.parallel.DistributedDataParallel(model)
    times = []
    for step in range(start + 1, args.steps + 1):
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(step * 1009 + rank)
        x = torch.randn(args.batch, args.width, generator=g)
        with ft.section("step"):
            opt.zero_grad()
            nn.functional.mse_loss(net(x), x.sum(1, keepdim=True)).backward()
            with (live.commit(step) if live is not None else contextlib.nullcontext()):
                opt.step()
        times.append(time.perf_counter() - t0)
    state = local_bytes(list(model.parameters())) + local_bytes(
        [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)])
    out = {"rank": rank, "form": args.form, "live": bool(args.live), "buddy_every": args.buddy_every,
           "buddy_keep": args.buddy_keep,
           "peak_rss_kb": status_kb("VmHWM"), "rss_before_model_kb": before, "state_bytes": state,
           "step_s_median": statistics.median(times[1:] or times)}
    if live is not None:
        out.update({k: live.stats[k] for k in ("commits", "commit_bytes", "commit_bytes_total", "in_place_bytes")})
        buddy = live.buddy_stats()
        out["buddy_held_bytes"] = buddy["held_bytes"] if buddy else 0
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank_{rank}.json"), "w") as fh:
        json.dump(out, fh)
    if net is not model:
        del net   # before the group goes (examples/ddp_train.py: gloo's exit deadlock)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--form", choices=("ddp", "app"), default="ddp")
    p.add_argument("--live", type=int, default=1)
    p.add_argument("--buddy-every", type=int, default=0)
    p.add_argument("--buddy-keep", type=int, default=2)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", default="out")
    ft.restartable(train)(p.parse_args())


if __name__ == "__main__":
    main()
