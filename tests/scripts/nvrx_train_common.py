"""What the two NVRx-style training scripts share and NVRx has no part in: a tiny DDP model on
gloo, its checkpoint (which carries the FT client's state_dict, as NVRx's examples do), the
per-rank progress file the tests wait on, and the report of the FT client's attributes.

Arguments of both scripts:  OUT --epochs N --steps-per-epoch S --hang-epoch E [--ft-cfg YAML]
Rank 1 of cycle 0 stops itself (SIGSTOP: a hang that only a timeout can find) at the start of
epoch E. Each rank appends `cycle epoch pid` to OUT/rank_<r>.txt after every epoch.
"""
import argparse
import dataclasses
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.nn as nn


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--steps-per-epoch", type=int, default=6)
    p.add_argument("--step-time", type=float, default=0.03)
    p.add_argument("--hang-epoch", type=int, default=None)
    p.add_argument("--ft-cfg", default=None, help="the job's YAML, to compare with ft_client.cfg")
    return p.parse_args()


def rank_and_cycle():
    return int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])


def build():
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def train_step(model, opt, epoch, step):
    g = torch.Generator().manual_seed(epoch * 1000 + step * 10 + dist.get_rank())
    x = torch.randn(4, 8, generator=g)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def ckpt_path(out):
    return os.path.join(out, "ckpt.pt")


def load_checkpoint(out, model, opt):
    """The checkpoint's (next epoch, FT state), or (0, None)."""
    if not os.path.exists(ckpt_path(out)):
        return 0, None
    ckpt = torch.load(ckpt_path(out), weights_only=False)
    model.module.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    return ckpt["epoch"] + 1, ckpt["ft_state"]


def save_checkpoint(out, model, opt, epoch, ft_state):
    if dist.get_rank() != 0:
        return
    tmp = ckpt_path(out) + ".tmp"
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                "ft_state": ft_state}, tmp)
    os.replace(tmp, ckpt_path(out))


def maybe_hang(args, epoch):
    rank, cycle = rank_and_cycle()
    if rank == 1 and cycle == 0 and epoch == args.hang_epoch:
        os.kill(os.getpid(), signal.SIGSTOP)


def progress(out, epoch):
    rank, cycle = rank_and_cycle()
    with open(os.path.join(out, f"rank_{rank}.txt"), "a") as fh:
        fh.write(f"{cycle} {epoch} {os.getpid()}\n")


def report(out, name, data):
    """OUT/<name>_rank<r>_cycle<c>.json: what the FT client showed (dataclasses as dicts)."""
    rank, cycle = rank_and_cycle()

    def plain(v):
        if dataclasses.is_dataclass(v):
            return plain(dataclasses.asdict(v))
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        if isinstance(v, (set, list, tuple)):
            return sorted(plain(x) for x in v)
        return v

    with open(os.path.join(out, f"{name}_rank{rank}_cycle{cycle}.json"), "w") as fh:
        json.dump(plain(data), fh, sort_keys=True)


def finish():
    """Tear the group down and leave without the interpreter's teardown. On torch 2.13 a 2-rank DDP
    job on gloo that calls destroy_process_group aborts at interpreter exit ("terminate called
    without an active exception", SIGABRT) in about 1 run of 4, with no launcher at all (8 of 30
    runs of a 20-line script here): these tests are about the launcher, not that."""
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
