"""HSDP with live state: 4 ranks as 2 replicas x 2 shards (torch's fully_shard on a (replicate,
shard) DeviceMesh, gloo on the CPU), AdamW, ft.LiveState(model=..., optimizer=...): the parameters
are DTensors, whose mesh coordinates say which shard a rank holds, so a replaced rank heals from
the same shard in the other replica (docs/live-state.md).

    ft_launcher --standalone --nproc-per-node 4 examples/hsdp_train.py --steps 40 --fail-at-step 17 --fail-rank 3

`--fail-in forward` kills the fault rank inside the FSDP forward pass of the fault step instead of
at its start: a forward pre-hook on the second Linear exits there (after the first layer's forward
and FSDP's all-gather of the second layer's parameters, whose own pre-hook runs first), while its
peers are in that step's collectives. `--fail-in reduce_scatter` makes it hang there instead: it
sleeps for an hour just before its first shard-group reduce_scatter of the fault step (its shard
peer waits in that reduce_scatter, its replica peers in the replicate all_reduce after it), so a
step-section timeout finds the hang (`--ft-rank-section-timeouts step:T`) and hang blame must name it.

`--mesh shard,replicate` lays the mesh out the other way: ranks 0, 1 hold shard 0 (the two replicas
of it) and ranks 2, 3 shard 1, so a node of 2 ranks holds one whole shard.

`--replicas 1` is pure FSDP (a 1-D mesh over every rank: no replica), and `--buddy-every K` keeps a
buddy copy of each rank's state every K steps (ft.LiveState(buddy_every=K)), so a killed rank or a
lost node resumes from host memory (docs/live-state.md, "Buddy copies"):

    ft_launcher --standalone --nproc-per-node 2 examples/hsdp_train.py --replicas 1 --buddy-every 1 \
        --fail-at-step 17 --fail-rank 1

`--state app` hands LiveState the state as PyTorch's DCP recipe writes it: a `Stateful` AppState whose
state_dict() is `get_state_dict(model, optimizer)` and whose load_state_dict() is `set_state_dict`
(`ft.LiveState(app=AppState(model, opt))`), and checkpoints `{"app": AppState}` with dcp.save/load;
`--state app-flat` the same with `StateDictOptions(flatten_optimizer_state_dict=True)`; `--state
parts` as torchtitan's CheckpointManager holds it: `model` (get/set_model_state_dict) and
`optimizer`, an Optimizer subclass whose state_dict() is get_optimizer_state_dict with flattened
keys (torchtitan's OptimizersContainer). `--fail-load-rank R` makes rank R's first load_state_dict
of the state raise in cycle 1 (a heal that fails: the job falls back to its checkpoint, saying why
in one line). `--fail-again-at-step S` makes --fail-rank fail again, at step S of cycle 1 (a second
failure after a restart).

`--ckpt-every N` saves a torch.distributed.checkpoint every N steps into --ckpt-dir, the fallback
when there is no live state (without it, a fallback trains from step 0). `--progress-dir` makes
each rank append `cycle step time` lines to rank_<r>.txt there. `--fail-how kill` SIGKILLs the
fault rank instead of its exit 1.

`--guard` checks each step before its commit (`live.commit(step, loss=loss)`, the step guard,
docs/sdc-and-nan.md); `--grad-norm` also passes `grad_norm=clip_grad_norm_(...)`, `--watch-every-step`
watches each rank's own backward at every step (`ft.LiveState(watch_every_step=True)`).

Deterministic (the batch of step s on rank r is a function of (s, r); with `--data shard` of (s, the
rank's shard), so replicas draw alike and the model is the same on any number of replicas). Rank 0 prints `FINAL
step=<n> checksum=<c> shards=<d0>,<d1>,...` (the full parameters' sum; each rank's local shards'
sha256, so replicas of a shard print the same).
"""
import argparse
import os
import random
import signal
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, get_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict,
                                                     set_state_dict)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import ft_launcher as ft


class AppState(Stateful):
    """PyTorch's DCP recipe: the application state as one Stateful (model and optimizer)."""

    def __init__(self, model, optimizer, options=None):
        self.model = model
        self.optimizer = optimizer
        self.options = options

    def state_dict(self):
        # automatically manages FSDP FQNs and the sharded state dict type
        model_state_dict, optimizer_state_dict = get_state_dict(self.model, self.optimizer, options=self.options)
        return {"model": model_state_dict, "optim": optimizer_state_dict}

    def load_state_dict(self, state_dict):
        # sets our state dicts on the model and optimizer, now that we've loaded
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"], options=self.options)


class ModelWrapper(Stateful):
    """As torchtitan's: the model parts' state through get_model_state_dict."""

    def __init__(self, model):
        self.model = [model]

    def state_dict(self):
        return {k: v for part in self.model for k, v in get_model_state_dict(part).items()}

    def load_state_dict(self, state_dict):
        for part in self.model:
            set_model_state_dict(part, state_dict, options=StateDictOptions(strict=False))


class OptimizersContainer(torch.optim.Optimizer, Stateful):
    """As torchtitan's: an Optimizer over the model parts whose state is DCP's, flattened."""

    def __init__(self, model_parts, optimizer_cls, optimizer_kwargs):
        self.model_parts = model_parts
        self.optimizers = [optimizer_cls(list(m.parameters()), **optimizer_kwargs) for m in model_parts]
        torch.optim.Optimizer.__init__(self, [p for m in model_parts for p in m.parameters()], optimizer_kwargs)

    def step(self, *args, **kwargs):
        for optimizer in self.optimizers:
            optimizer.step(*args, **kwargs)

    def zero_grad(self, *args, **kwargs):
        for optimizer in self.optimizers:
            optimizer.zero_grad(*args, **kwargs)

    def state_dict(self):
        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        return {k: v for m, o in zip(self.model_parts, self.optimizers)
                for k, v in get_optimizer_state_dict(m, o, options=flat).items()}

    def load_state_dict(self, state_dict):
        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        for m, o in zip(self.model_parts, self.optimizers):
            set_optimizer_state_dict(m, o, optim_state_dict=state_dict, options=flat)


def _failing_load(obj, rank):
    """obj's first load_state_dict raises (--fail-load-rank): a heal whose load fails."""
    load = obj.load_state_dict

    def first_load_raises(state_dict):
        obj.load_state_dict = load
        raise RuntimeError(f"rank {rank}: load_state_dict fails on purpose")
    obj.load_state_dict = first_load_raises
    return obj


def train(args):
    rank, cycle = int(os.environ.get("RANK", 0)), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if args.replicas == 1:   # pure FSDP: every rank holds its own shard, no replica
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    elif args.mesh == "replicate,shard":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    else:   # the same (replicate, shard) dimensions over the ranks in the other order
        layout = torch.arange(world).view(2, world // 2).t().contiguous()
        mesh = DeviceMesh("cpu", layout, mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    random.seed(0)   # replicas draw alike: LiveState keeps the RNG state (rng=True) and heals it from a peer
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if args.state == "parts":
        opt = OptimizersContainer([model], torch.optim.AdamW, {"lr": 1e-2})
        states = {"model": ModelWrapper(model), "optimizer": opt}
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        flat = StateDictOptions(flatten_optimizer_state_dict=True) if args.state == "app-flat" else None
        states = {"model": model, "optimizer": opt} if args.state == "objects" else {"app": AppState(model, opt, flat)}
    if rank == args.fail_load_rank and cycle == 1:
        _failing_load(states[sorted(states)[0]], rank)
    live = ft.LiveState(**states, buddy_every=args.buddy_every, buddy_memory_limit_mb=args.buddy_memory_limit_mb,
                        buddy_keep=args.buddy_keep, watch_every_step=args.watch_every_step)
    start = live.restore()
    if start is None:
        start = load_checkpoint(args, model, opt, states)
        if start and rank == 0:
            print(f"resumed from the checkpoint at step {start} (cycle {cycle})", flush=True)
    elif rank == 0:
        print(f"resumed from live state at step {start} (cycle {cycle})", flush=True)
    progress = None
    if args.progress_dir:
        os.makedirs(args.progress_dir, exist_ok=True)
        progress = open(os.path.join(args.progress_dir, f"rank_{rank}.txt"), "a", buffering=1)
    for step in range(start + 1, args.steps + 1):
        if rank == args.fail_rank and (step, cycle) in ((args.fail_at_step, 0), (args.fail_again_at_step, 1)):
            if args.fail_in == "forward":
                model[2].register_forward_pre_hook(_die_in_forward(rank, step))
            elif args.fail_in == "reduce_scatter":
                dist.reduce_scatter_single = _hang_before(dist.reduce_scatter_single, rank, step)
            else:
                print(f"rank {rank}: failing on purpose at step {step}", flush=True)
                if args.fail_how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                os._exit(1)
        g = torch.Generator().manual_seed(step * 1009 + (_shard_index(mesh) if args.data == "shard" else rank))
        x = torch.randn(8, 16, generator=g)
        with ft.section("step"):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0) if args.grad_norm else None
            with live.commit(step, loss=loss, grad_norm=norm) if args.guard else live.commit(step):
                opt.step()
        if progress:
            progress.write(f"{cycle} {step} {time.time():.6f}\n")
        if args.ckpt_every and step % args.ckpt_every == 0:
            save_checkpoint(args, model, opt, step, rank, states)
        if args.step_time:
            time.sleep(args.step_time)
    with torch.no_grad():
        total = float(sum(p.full_tensor().double().sum() for p in model.parameters()))
    digests = [None] * world
    dist.all_gather_object(digests, _digest(model))   # each rank's shards' bytes: replicas must be bit-equal
    if rank == 0:
        print(f"FINAL step={args.steps} checksum={total!r} shards={','.join(digests)}", flush=True)
    if progress:
        progress.close()
    dist.destroy_process_group()


def _shard_index(mesh) -> int:
    """This rank's place on the mesh's shard dimension (--data shard: replicas draw the same batch)."""
    return mesh.get_local_rank("shard")


def _digest(model) -> str:
    """Every bit of this rank's local shards (sha256): replicas of a shard print the same."""
    import hashlib

    h = hashlib.sha256()
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        h.update(local.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:12]


def save_checkpoint(args, model, opt, step, rank, states):
    """A sharded checkpoint (torch.distributed.checkpoint) of step `step`; rank 0 then names it the latest.
    With --state other than objects, the Stateful objects themselves (DCP calls their state_dict())."""
    if args.state == "objects":
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
    else:
        state = dict(states)
    dcp.save(state, checkpoint_id=os.path.join(args.ckpt_dir, f"step_{step}"))
    dist.barrier()
    if rank == 0:
        with open(os.path.join(args.ckpt_dir, "latest.tmp"), "w") as fh:
            fh.write(str(step))
        os.replace(os.path.join(args.ckpt_dir, "latest.tmp"), os.path.join(args.ckpt_dir, "latest"))


def load_checkpoint(args, model, opt, states) -> int:
    """The newest checkpoint's step, loaded into model and optimizer; 0 when there is none."""
    try:
        with open(os.path.join(args.ckpt_dir, "latest")) as fh:
            step = int(fh.read())
    except (OSError, ValueError):
        return 0
    if args.state != "objects":   # DCP loads each Stateful in place (its load_state_dict)
        dcp.load(dict(states), checkpoint_id=os.path.join(args.ckpt_dir, f"step_{step}"))
        return step
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=os.path.join(args.ckpt_dir, f"step_{step}"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return step


def _die_in_forward(rank, step):
    def hook(module, inputs):
        print(f"rank {rank}: failing on purpose inside the forward pass of step {step}", flush=True)
        os._exit(1)
    return hook


def _hang_before(reduce_scatter, rank, step):
    def hang(*args, **kwargs):   # FSDP's reduce-scatter of gradients calls dist.reduce_scatter_single
        print(f"rank {rank}: hanging on purpose before the shard reduce_scatter of step {step}", flush=True)
        time.sleep(3600)
        return reduce_scatter(*args, **kwargs)
    return hang


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--fail-at-step", type=int, default=None)
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (time for a fault to land)")
    p.add_argument("--fail-rank", type=int, default=3)
    p.add_argument("--fail-again-at-step", type=int, default=None, help="--fail-rank fails again at this step of cycle 1")
    p.add_argument("--mesh", choices=("replicate,shard", "shard,replicate"), default="replicate,shard",
                   help="the order of the mesh's dimensions over the ranks (default: a replica's shards on "
                        "neighbouring ranks)")
    p.add_argument("--fail-in", choices=("step", "forward", "reduce_scatter"), default="step",
                   help="where --fail-rank fails: exits at the start of the step (default) or inside its FSDP "
                        "forward, or hangs before its shard reduce_scatter")
    p.add_argument("--fail-how", choices=("exit", "kill"), default="exit", help="exit 1 (default) or SIGKILL")
    p.add_argument("--replicas", type=int, default=2, help="replicas of the model (1: pure FSDP, no replica)")
    p.add_argument("--buddy-every", type=int, default=0, help="a buddy copy every K steps (0: off)")
    p.add_argument("--buddy-keep", type=int, default=2,
                   help="copies of each kind a rank keeps: 2 (4 x its state in host memory) or 1 (2 x; a node lost "
                        "while a copy is replaced falls back to the checkpoint)")
    p.add_argument("--buddy-memory-limit-mb", type=float, default=None,
                   help="the most host memory a node's buddy copies may take (default: 80 %% of what is available)")
    p.add_argument("--state", choices=("objects", "app", "app-flat", "parts"), default="objects",
                   help="what LiveState holds: the model and optimizer (default), a DCP AppState (app; app-flat: "
                        "flattened optimizer keys), or torchtitan-like Stateful containers (parts)")
    p.add_argument("--fail-load-rank", type=int, default=None,
                   help="this rank's first load_state_dict in cycle 1 (after the first restart) raises")
    p.add_argument("--ckpt-every", type=int, default=0, help="a checkpoint every N steps (0: none)")
    p.add_argument("--ckpt-dir", default="ckpt")
    p.add_argument("--progress-dir", default=None, help="each rank appends 'cycle step time' lines here")
    p.add_argument("--data", choices=("rank", "shard"), default="rank",
                   help="the batch of a step is a function of (step, rank) (default), or of (step, shard): every "
                        "replica of a shard draws the same, so the job trains the same model on any number of "
                        "replicas (an elastic job that shrinks and grows back ends bit-equal to a fault-free one)")
    p.add_argument("--guard", action="store_true", help="live.commit(step, loss=loss): the step guard")
    p.add_argument("--grad-norm", action="store_true", help="also grad_norm=clip_grad_norm_(...)")
    p.add_argument("--watch-every-step", action="store_true", help="LiveState's watch_every_step")
    ft.restartable(train)(p.parse_args())


if __name__ == "__main__":
    main()
