"""The TorchFT 0.2.0 job of bench/elastic.py: one replica group (one rank) of
examples/live_train.py's training, written as TorchFT's train_ddp.py and README tell users to.

    torchft_lighthouse --min_replicas 2 --quorum_tick_ms 100 --join_timeout_ms 10000
    REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=3 TORCHFT_LIGHTHOUSE=http://localhost:29510 \\
        torchrun --standalone --nnodes 1 --nproc-per-node 1 bench/torchft_train.py --steps 400

Its Manager (ProcessGroupGloo, `min_replica_size=2`, the model, optimizer and schedule as the
state a joining group heals from a peer over TorchFT's HTTP transport), torchft's
DistributedDataParallel and Optimizer wrappers (a quorum at each `zero_grad`, the optimizer
stepped only where `should_commit` says so), and torchft's DistributedSampler over
NUM_REPLICA_GROUPS groups: group g reads the shard rank g of live_train.py's 3-rank run reads. A
lost group's shard is skipped while it is away, and a group that joins starts its shard from the
top: TorchFT's data rule. The same model, data, batch, AdamW, warm-up and --step-time (a sleep at
the top of every step) as examples/live_train.py; no checkpoint (a group heals from its peers).

Each group appends `cycle step unixtime` to <progress-dir>/rank_<group>.txt after each committed
step (cycle: TORCHELASTIC_RESTART_COUNT, as live_train.py), and `step participants unixtime` to
<progress-dir>/participants_<group>.txt: a group that has just healed commits its first step
without its gradients (TorchFT counts it out), so a job is back on 3 replicas at the first step
with 3 participants. The loop ends once the Manager's step reaches --steps.
"""
import argparse
import os
import time
from datetime import timedelta

import torch
import torch.nn as nn
from torchdata.stateful_dataloader import StatefulDataLoader
from torchft import DistributedDataParallel, DistributedSampler, Manager, Optimizer, ProcessGroupGloo


class Warmup:
    """The learning-rate factor of step s (live_train.py's schedule)."""

    def __init__(self, steps):
        self.steps = steps

    def __call__(self, s):
        return min(1.0, (s + 1) / self.steps)


def main(args):
    group, groups = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["NUM_REPLICA_GROUPS"])
    cycle = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(16, args.width), nn.Tanh(), nn.Linear(args.width, 1))
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.samples, 16, generator=g)
    data = torch.utils.data.TensorDataset(x, torch.tanh(x[:, :4].sum(1, keepdim=True)) + 0.1 * x[:, 4:5])
    sampler = DistributedSampler(data, replica_rank=group, num_replica_groups=groups, group_rank=0,
                                 num_replicas=1, shuffle=True, seed=args.seed)
    loader = StatefulDataLoader(data, batch_size=args.batch, sampler=sampler, drop_last=True)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(inner, Warmup(20))

    def load_state_dict(state):
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict(), "sched": sched.state_dict()}

    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), min_replica_size=args.min_replicas,
                      load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"train_ddp_{group}",
                      timeout=timedelta(seconds=30))
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)
    os.makedirs(args.progress_dir, exist_ok=True)
    progress = open(os.path.join(args.progress_dir, f"rank_{group}.txt"), "a", buffering=1)
    participants = open(os.path.join(args.progress_dir, f"participants_{group}.txt"), "a", buffering=1)
    epoch = 0
    batches = iter(loader)
    try:
        while manager.current_step() < args.steps:
            if args.step_time:
                time.sleep(args.step_time)
            try:
                x, y = next(batches)
            except StopIteration:                 # a new epoch
                epoch += 1
                sampler.set_epoch(epoch)
                batches = iter(loader)
                x, y = next(batches)
            before = manager.current_step()
            optimizer.zero_grad()                 # the quorum, at the start of every step
            loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()                       # gradients averaged over the quorum's groups
            optimizer.step()                      # stepped only if should_commit()
            if manager.current_step() > before:   # committed
                sched.step()
                now = time.time()
                progress.write(f"{cycle} {manager.current_step()} {now:.6f}\n")
                participants.write(f"{manager.current_step()} {manager.num_participants()} {now:.6f}\n")
    finally:
        progress.close()
        participants.close()
        manager.shutdown(wait=False)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16, help="per replica group")
    p.add_argument("--width", type=int, default=64, help="the hidden layer's width")
    p.add_argument("--min-replicas", type=int, default=2, help="the Manager's min_replica_size")
    p.add_argument("--step-time", type=float, default=0.0, help="seconds each step sleeps first")
    p.add_argument("--progress-dir", default="progress")
    return p.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
