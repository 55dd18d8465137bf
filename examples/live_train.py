"""A training loop written from docs/live-state.md: DDP on gloo, torchdata's StatefulDataLoader over
a StatefulDistributedSampler, the batch drawn at the top of each step, AdamW with a warm-up
schedule, everything in one ft.LiveState (RNG included: the default), a checkpoint every 50 steps.

    ft_launcher --standalone --nproc-per-node 2 examples/live_train.py --steps 150

Options that make the model harder to recover exactly: `--batchnorm` (BatchNorm1d: running
statistics change in every forward, outside commit), `--dropout P` (draws from torch's generator),
`--ema` (an EMA teacher in a second LiveState, `name="teacher"`, committed with the first).
After an in-place restart the healthy ranks keep their state as of their last commit (the loader's
position, BatchNorm statistics and RNG rolled back to it) and a replaced rank receives it from a
peer; with no live state it loads the checkpoint. Deterministic: a run with failures ends with
exactly the model of a run without them. Rank 0 prints `FINAL step=<n> loss=<l> checksum=<c>` and
writes final.json into --ckpt-dir; every rank writes final_rank_<r>.json (its replica's checksum).

The test hooks below the loop (cycle 0 only unless said): --fail-at-step (exit at the top of the
step, every rank first holding --hold seconds after the previous step's commit), --raise-at-step / --hang-at-step (after the step's commit, every rank first holding --hold
seconds), --die-in-restore R (cycle 1: rank R dies inside restore(), while its objects load),
--unsendable-scheduler (a schedule that holds a lambda in its state: LiveState refuses it at the
first commit), --hang-rank / --hang-cycle (the rank and cycle --hang-at-step hits: default
--fail-rank, cycle 0), --linger-rank R (rank R sleeps for ever after its last step, outside any
section: a rank that hangs in its teardown), --gather-at-end (the run ends as many scripts do: an
all_gather_object of every rank's checksum, destroy_process_group(), DDP freed as the function
returns; under ft.restartable the call's groups are held until torch's threads settle), --guard
(`live.commit(step, loss=loss)`: the step guard, rank_side.live.step_guard; with --skip-bad-batches;
--grad-norm: also `grad_norm=clip_grad_norm_(...)`, the clip at --clip; --scaler: a GradScaler in the
LiveState, `scaler.scale(loss).backward()`, `unscale_`, the clip, `scaler.step(opt)` in the commit;
--no-loss-rank R: rank R commits without a loss, as a pipeline stage without one),
--poison-step S / --spike-step S (--poison-rank's batch at step S gets a NaN, on every run of the
step / its targets x1000), --fsdp (the model under torch's fully_shard over every rank, no replicas, without
`shard=`: a replaced rank has no peer to heal from; no checkpoint either: a fallback trains from
step 0). --progress-dir: each rank appends
'cycle step time' after each step. --step-time S: each step of cycle 0 sleeps S seconds first (a
window in which a test kills a node; --step-time-always: of every cycle).
"""
import argparse
import json
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

import ft_launcher as ft


class EpochSampler(StatefulDistributedSampler):
    """StatefulDistributedSampler keeps its place in the epoch, not the epoch: keep both."""

    def state_dict(self):
        return {**super().state_dict(), "epoch": self.epoch}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.set_epoch(state["epoch"])


class Warmup:
    """The learning-rate factor of step s (a callable object: LambdaLR keeps its __dict__)."""

    def __init__(self, steps, unsendable=False):
        self.steps = steps
        if unsendable:
            self.curve = lambda s: s   # a lambda in the scheduler's state: no peer could receive it

    def __call__(self, s):
        return min(1.0, (s + 1) / self.steps)


def build(args, rank, world):
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    w = args.width
    layers = [nn.Linear(16, w)] + ([nn.BatchNorm1d(w)] if args.batchnorm else []) + [nn.Tanh()]
    layers += ([nn.Dropout(args.dropout)] if args.dropout else []) + [nn.Linear(w, 1)]
    model = nn.Sequential(*layers)
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.samples, 16, generator=g)
    data = torch.utils.data.TensorDataset(x, torch.tanh(x[:, :4].sum(1, keepdim=True)) + 0.1 * x[:, 4:5])
    sampler = EpochSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = StatefulDataLoader(data, batch_size=args.batch, sampler=sampler, drop_last=True)
    return model, loader, sampler


def train(args):
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    cycle = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    hooks = Hooks(args, rank, cycle)
    ft.heartbeat()
    with ft.section("setup"):
        dist.init_process_group("gloo")
        model, loader, sampler = build(args, rank, world)
        if args.fsdp:
            from torch.distributed.fsdp import fully_shard
            fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, Warmup(20, args.unsendable_scheduler))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16) if args.scaler else None
        extra = {"scaler": scaler} if scaler is not None else {}
        live = ft.LiveState(model=model, optimizer=opt, scheduler=sched, loader=loader,
                            skip_bad_batches=args.skip_bad_batches, fingerprint_every=args.fingerprint_every,
                            watch_every_step=args.watch_every_step,
                            **extra, **hooks.objects())
        teacher = teacher_live = None
        if args.ema:
            teacher = build(args, rank, world)[0].requires_grad_(False)
            teacher_live = ft.LiveState(name="teacher", teacher=teacher, rng=False)
        start = live.restore()                          # before DDP: its constructor broadcasts rank 0's state
        if teacher_live is not None and teacher_live.restore() != start:
            start = None                                # both live at the same step, or both from the checkpoint
        rng = None
        if start is None:
            start, rng = load_checkpoint(args, model, opt, sched, loader, teacher, scaler)
        elif rank == 0:
            print(f"resumed from live state at step {start} (cycle {cycle})", flush=True)
        ddp = model if args.fsdp else nn.parallel.DistributedDataParallel(model)
        if not args.fsdp:
            settle_gradient_buckets(ddp)
        # A loader whose state was just loaded makes its new iterator here, and that draws a seed
        # from torch's generator: the checkpoint's RNG state goes in after it, so the next step
        # draws (dropout) what the run without the restart drew. (LiveState orders this itself.)
        batches = iter(loader)
        if rng is not None:
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])

    loss = torch.tensor(0.0)
    for step in range(start + 1, args.steps + 1):
        with ft.section("step"):
            hooks.top_of_step(step)
            try:
                x, y = next(batches)
            except StopIteration:                       # a new epoch
                sampler.set_epoch(sampler.epoch + 1)
                batches = iter(loader)
                x, y = next(batches)
            x, y = hooks.batch(step, x, y)

            def forward_backward():
                opt.zero_grad(set_to_none=True)
                loss = nn.functional.mse_loss(ddp(x), y)
                (scaler.scale(loss) if scaler is not None else loss).backward()
                norm = None
                if args.grad_norm or scaler is not None:
                    if scaler is not None:
                        scaler.unscale_(opt)
                    norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), args.clip)
                return loss, norm

            if args.rerun_in_place and args.guard and rank != args.plain_commit_rank:
                # the commit runs forward and backward, and again in place if the guard re-runs the step
                def run():
                    nonlocal loss
                    loss, norm = forward_backward()
                    if rank == args.no_loss_rank:   # a stage without a loss: it re-runs all the same
                        return None
                    return (loss, norm) if args.grad_norm else loss

                checked = live.commit(step, run=run)
            else:
                loss, norm = forward_backward()
                if rank == args.no_loss_rank:   # a pipeline stage without a loss of its own
                    checked = live.commit(step)
                elif args.guard:   # the step guard
                    checked = live.commit(step, loss=loss, grad_norm=norm if args.grad_norm else None)
                else:
                    checked = live.commit(step)
            with checked, (teacher_live.commit(step) if teacher_live else _nothing()):
                if scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                sched.step()
                if teacher is not None:
                    with torch.no_grad():
                        for t, p in zip(teacher.parameters(), model.parameters()):
                            t.lerp_(p, 0.1)
            opt.zero_grad(set_to_none=True)
            hooks.after_commit(step)
        ft.heartbeat()
        hooks.progress(step)
        if step % args.ckpt_every == 0 or step == args.steps:
            with ft.section("checkpointing"):
                save_checkpoint(args, rank, step, model, opt, sched, loader, teacher, scaler)
    finish(args, rank, world, cycle, model, teacher, loss, scaler.get_scale() if scaler is not None else None)
    if args.gather_at_end:   # as many scripts end: DDP alive, a closing gather, the group destroyed
        sums = [None] * world
        dist.all_gather_object(sums, checksum(model))
        if rank == 0:
            print(f"GATHERED {len(set(sums))} distinct checksum(s) of {world} ranks", flush=True)
        dist.destroy_process_group()
        hooks.at_end()
        return                    # DDP's Reducer, the group's last reference, goes with this frame
    if ddp is not model:
        del ddp   # before the group goes (examples/ddp_train.py: gloo's exit deadlock)
    dist.destroy_process_group()
    hooks.at_end()


def settle_gradient_buckets(ddp):
    """One backward pass that changes nothing (eval mode: no BatchNorm update, no dropout draw), so
    DDP builds its gradient buckets now: with 3 or more ranks the bucket order decides how the
    all-reduce adds up, and a run resumed at step k would otherwise differ in the last bits."""
    ddp.eval()
    ddp(torch.zeros(2, 16)).sum().backward()
    ddp.zero_grad(set_to_none=True)
    ddp.train()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def save_checkpoint(args, rank, step, model, opt, sched, loader, teacher, scaler=None):
    if args.fsdp:   # this example keeps no checkpoint of sharded state: a fallback trains from step 0
        return
    sched_state = dict(sched.state_dict(), lr_lambdas=[None])   # the schedule's function is code: the script's
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched_state,
             "loader": loader.state_dict(), "teacher": teacher.state_dict() if teacher is not None else None,
             "rng": torch.get_rng_state(), "py_rng": random.getstate(), "step": step,
             "scaler": scaler.state_dict() if scaler is not None else None}
    os.makedirs(args.ckpt_dir, exist_ok=True)
    if rank == 0:
        path = os.path.join(args.ckpt_dir, "ckpt.pt")
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
    dist.barrier()


def load_checkpoint(args, model, opt, sched, loader, teacher, scaler=None):
    """The checkpoint's step and its RNG state, which the caller restores once the loader has made
    its iterator; (0, None) without a checkpoint."""
    path = os.path.join(args.ckpt_dir, "ckpt.pt")
    if args.fsdp or not os.path.exists(path):
        return 0, None
    state = torch.load(path, weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])
    loader.load_state_dict(state["loader"])
    if teacher is not None:
        teacher.load_state_dict(state["teacher"])
    if scaler is not None:
        scaler.load_state_dict(state["scaler"])
    if dist.get_rank() == 0:
        print(f"resumed from step {state['step']} (checkpoint)", flush=True)
    return state["step"], {"torch": state["rng"], "python": state["py_rng"]}


def checksum(*modules):
    with torch.no_grad():
        total = 0.0
        for m in modules:
            if m is None:
                continue
            for t in list(m.parameters()) + list(m.buffers()):
                t = t.full_tensor() if hasattr(t, "full_tensor") else t
                total += float(t.double().sum())
        return total


def digest(model):
    """Every bit of the parameters (a checksum of floats can hide a low bit): sha256 of their bytes."""
    import hashlib

    h = hashlib.sha256()
    for p in model.parameters():
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def finish(args, rank, world, cycle, model, teacher, loss, scale=None):
    result = {"step": args.steps, "checksum": checksum(model, teacher), "loss": float(loss), "world_size": world,
              "cycle": cycle, "digest": digest(model), "scale": scale}
    os.makedirs(args.ckpt_dir, exist_ok=True)
    with open(os.path.join(args.ckpt_dir, f"final_rank_{rank}.json"), "w") as fh:
        json.dump(result, fh)
    if rank == 0:
        with open(os.path.join(args.ckpt_dir, "final.json"), "w") as fh:
            json.dump(result, fh)
        print(f"FINAL step={args.steps} loss={result['loss']:.6f} checksum={result['checksum']!r}", flush=True)


# ---- test hooks (not part of the loop a user writes) ---------------------------------------------
class Hooks:
    def __init__(self, args, rank, cycle):
        self.args, self.rank, self.cycle = args, rank, cycle
        self.fault = rank == args.fail_rank and cycle == 0
        self.log = None
        if args.progress_dir:
            os.makedirs(args.progress_dir, exist_ok=True)
            self.log = open(os.path.join(args.progress_dir, f"rank_{rank}.txt"), "a", buffering=1)

    def objects(self):
        """An extra LiveState object that dies inside restore() (--die-in-restore, cycle 1)."""
        if self.args.die_in_restore is None:
            return {}
        return {"probe": DieInRestore(self.rank == self.args.die_in_restore and self.cycle == 1)}

    def top_of_step(self, step):
        if self.args.step_time and (self.cycle == 0 or self.args.step_time_always):
            time.sleep(self.args.step_time)
        if self.fault and step == self.args.fail_at_step:
            print(f"rank {self.rank}: failing on purpose at step {step}", flush=True)
            os._exit(1)

    def batch(self, step, x, y):
        """--poison-step: a NaN in --poison-rank's batch at that step, on every run of it (the data);
        --spike-step: that batch's targets x1000 on --poison-rank (a loss spike)."""
        a = self.args
        if self.rank == a.poison_rank and step == a.poison_step:
            x = x.clone()
            x[0, 0] = float("nan")
        if self.rank == a.poison_rank and step == a.spike_step:
            y = y * 1000.0
        return x, y

    def after_commit(self, step):
        a = self.args
        before_kill = a.fail_at_step is not None and step == a.fail_at_step - 1
        hang_cycle = self.cycle == a.hang_cycle and step == a.hang_at_step
        if not hang_cycle and (self.cycle != 0 or (step != a.raise_at_step and not before_kill)):
            return
        end = time.monotonic() + self.args.hold   # every rank completes this step's commit first
        while time.monotonic() < end:
            ft.heartbeat()
            time.sleep(0.05)
        if self.fault and step == self.args.raise_at_step:
            raise RuntimeError(f"simulated exception after the commit of step {step}")
        if hang_cycle and self.rank == (a.fail_rank if a.hang_rank is None else a.hang_rank):
            print(f"rank {self.rank} hangs after step {step} (simulated)", flush=True)
            while True:
                time.sleep(3600)

    def at_end(self):
        if self.rank == self.args.linger_rank:
            print(f"rank {self.rank} hangs after its last step (simulated teardown hang)", flush=True)
            while True:
                time.sleep(3600)

    def progress(self, step):
        if self.log:
            self.log.write(f"{self.cycle} {step} {time.time():.6f}\n")


class DieInRestore:
    """A LiveState object whose load_state_dict kills its rank (a second fault inside restore())."""

    def __init__(self, die):
        self.die = die

    def state_dict(self):
        return {"n": 1}

    def load_state_dict(self, state):
        if self.die:
            print(f"rank {os.environ.get('RANK')}: dying inside restore() on purpose", flush=True)
            os._exit(1)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--ckpt-dir", default="ckpt")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16, help="per rank")
    p.add_argument("--width", type=int, default=64, help="the hidden layer's width")
    p.add_argument("--batchnorm", action="store_true")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--ema", action="store_true", help="an EMA teacher in a second LiveState")
    p.add_argument("--fsdp", action="store_true", help="fully_shard over every rank (no replicas), no shard=")
    p.add_argument("--progress-dir", default=None)
    p.add_argument("--fail-rank", type=int, default=0)
    p.add_argument("--fail-at-step", type=int, default=None)
    p.add_argument("--raise-at-step", type=int, default=None)
    p.add_argument("--hang-at-step", type=int, default=None)
    p.add_argument("--hang-rank", type=int, default=None, help="the rank --hang-at-step hits (default --fail-rank)")
    p.add_argument("--hang-cycle", type=int, default=0, help="the cycle --hang-at-step hits")
    p.add_argument("--linger-rank", type=int, default=None)
    p.add_argument("--gather-at-end", action="store_true")
    p.add_argument("--hold", type=float, default=0.5)
    p.add_argument("--step-time", type=float, default=0.0, help="seconds each step of cycle 0 sleeps first")
    p.add_argument("--step-time-always", action="store_true", help="--step-time in every cycle")
    p.add_argument("--die-in-restore", type=int, default=None, metavar="RANK")
    p.add_argument("--unsendable-scheduler", action="store_true")
    p.add_argument("--guard", action="store_true", help="commit(step, loss=loss): the step guard")
    p.add_argument("--skip-bad-batches", action="store_true")
    p.add_argument("--grad-norm", action="store_true", help="commit(step, loss=loss, grad_norm=clip_grad_norm_(...))")
    p.add_argument("--rerun-in-place", action="store_true",
                   help="--guard: commit(step, run=forward_backward): a re-run of the step calls it again in place")
    p.add_argument("--plain-commit-rank", type=int, default=None,
                   help="with --rerun-in-place: this rank commits with loss= instead (every rank then re-runs by restart)")
    p.add_argument("--fingerprint-every", type=int, default=None, help="LiveState's fingerprint_every")
    p.add_argument("--watch-every-step", action="store_true", help="LiveState's watch_every_step")
    p.add_argument("--clip", type=float, default=1.0, help="clip_grad_norm_'s max_norm")
    p.add_argument("--no-loss-rank", type=int, default=None, help="this rank commits without loss= (a loss-less stage)")
    p.add_argument("--scaler", action="store_true", help="a GradScaler (cpu) in the loop and the LiveState")
    p.add_argument("--poison-step", type=int, default=None, help="a NaN in --poison-rank's batch at this step")
    p.add_argument("--spike-step", type=int, default=None, help="--poison-rank's targets x1000 at this step")
    p.add_argument("--poison-rank", type=int, default=1)
    return p.parse_args(argv)


if __name__ == "__main__":
    ft.restartable(train)(parse_args())
