"""A small DDP training job on gloo that checkpoints and resumes: the example for the README,
and the job the tests and benchmarks run.

    ft_launcher --standalone --nproc-per-node 2 examples/ddp_train.py --steps 300
    ft_launcher --standalone --nproc-per-node gpu examples/ddp_train.py --device cuda

With `--device cuda` it trains on NCCL, one GPU per rank (`torch.cuda.set_device(LOCAL_RANK)`),
model and batches on that GPU; the checkpoint holds CPU tensors either way (batches are drawn on
the CPU), so a resumed run is the same as on the CPU path. `--device cpu` (the default) is gloo.

Deterministic: the model is seeded and the batch of step s on rank r is a function of (seed,
s, r), and a restart resumes from the last checkpoint, so a run with failures ends with exactly
the model of a run without them. Rank 0 prints `FINAL step=<n> checksum=<c>` and writes
`final.json` into --ckpt-dir. The same file runs under torchrun or plain python (one rank).

With `--live` (implies `--restartable`) the model and optimizer are `ft.LiveState`: after an
in-place restart the healthy ranks keep them in memory and a replaced rank receives them from a
peer (docs/live-state.md), so the job resumes at the last completed step instead of the
checkpoint; where no live state exists (first start, job-level restart, plain python, torchrun)
it loads the checkpoint as without the flag.

With `--noise SIGMA` every step also draws from the global random generators, as augmentation or
dropout do: the inputs get SIGMA * torch.randn noise (torch's global generator) and the loss a
weight 1 + SIGMA * (random.random() - 0.5) (Python's `random`, seeded with --seed at each start).
Every rank draws the same stream, so a replaced rank can continue its peer's. `--live-rng` (implies
`--live`) keeps that RNG state as of each commit too (`ft.LiveState(..., rng=True)`); with
--progress-dir each rank appends 'cycle step digest' of the RNG state it starts each step with to
rng_rank_<r>.txt. Both are off by default.
"""
import argparse
import contextlib
import hashlib
import json
import os
import random
import signal
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import ft_launcher as ft


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--ckpt-dir", default="ckpt")
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: gloo (default); cuda: NCCL, one GPU per rank by LOCAL_RANK")
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (a slower job, e.g. for a simulated fault to land in)")
    p.add_argument("--progress-dir", default=None, help="each rank appends 'cycle step time' lines here")
    p.add_argument("--fail-at-step", type=int, default=None, help="exit 1 at this step (tests)")
    p.add_argument("--fail-rank", type=int, default=0)
    p.add_argument("--fail-cycles", type=int, default=1, help="fail only in cycles below this (-1: always)")
    # Fault-matrix hooks (cycle 0 only): make a phase last long enough for a fault to land in it,
    # or fail inside it. PHASE is setup, step, checkpointing or oos (out of section, after a step).
    p.add_argument("--hold", default=None, metavar="PHASE:SECONDS", help="all ranks spend this long in PHASE once")
    p.add_argument("--hold-step", type=int, default=6, help="the step at which step/checkpointing/oos holds happen")
    p.add_argument("--raise-in", default=None, metavar="PHASE",
                   help="--fail-rank raises an exception in PHASE (after the --hold there, if any)")
    p.add_argument("--exit0-in", default=None, metavar="PHASE", help="--fail-rank exits 0 early in PHASE")
    p.add_argument("--raise-on", default=None, metavar="SIGNAL",
                   help="raise an exception at the end of the step in which this signal (e.g. USR1) arrives "
                        "(benchmarks)")
    p.add_argument("--restartable", action="store_true",
                   help="run the training function under ft_launcher.restartable: on a failure the healthy "
                        "ranks restart in their own process")
    p.add_argument("--live", action="store_true",
                   help="keep the model and optimizer as ft.LiveState (implies --restartable): an in-place "
                        "restart resumes at the last completed step, a replaced rank heals from a peer")
    p.add_argument("--noise", type=float, default=0.0, metavar="SIGMA",
                   help="each step draws from the global RNGs: SIGMA * torch.randn input noise and a loss weight "
                        "1 + SIGMA * (random.random() - 0.5) (default 0: off)")
    p.add_argument("--live-rng", action="store_true",
                   help="--live, and keep the RNG state (torch, Python's random) as of each commit too "
                        "(ft.LiveState(rng=True))")
    p.add_argument("--hang-in", default=None, metavar="PHASE",
                   help="--fail-rank hangs in PHASE at --hold-step (cycle 0 only): it sleeps, no heartbeat, "
                        "until the launcher's monitor finds it")
    p.add_argument("--hang-by", choices=("sleep", "sigstop"), default="sleep",
                   help="how --hang-in hangs: sleep forever, or SIGSTOP itself (as a simulated rank_hung: "
                        "the monitor's SIGCONT for the stack dump resumes it)")
    p.add_argument("--cuda-hang-in", default=None, metavar="PHASE",
                   help="--fail-rank gets stuck in a CUDA kernel that never ends in PHASE (--device cuda)")
    args = p.parse_args()
    args.live = args.live or args.live_rng
    args.restartable = args.restartable or args.live
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU is usable here (torch.cuda.is_available() is False)")
    return args


class Hooks:
    """The test hooks of one rank: where to hold, raise or exit early (cycle 0 only)."""

    def __init__(self, args, rank, cycle):
        self.phase, self.seconds = None, 0.0
        if args.hold and cycle == 0:
            phase, _, seconds = args.hold.partition(":")
            self.phase, self.seconds = phase, float(seconds)
        me = rank == args.fail_rank and cycle == 0
        self.raise_in = args.raise_in if me else None
        self.exit0_in = args.exit0_in if me else None
        self.cuda_hang_in = args.cuda_hang_in if me else None
        self.hang_in = args.hang_in if me else None
        self.hang_by = args.hang_by
        self.step = args.hold_step

    def at(self, phase, step=None):
        if step is not None and step != self.step:
            return
        if self.raise_in == phase and self.phase != phase:
            raise RuntimeError(f"simulated exception in {phase}")
        if self.exit0_in == phase:
            print(f"exiting 0 early in {phase}", flush=True)
            os._exit(0)
        if self.hang_in == phase:   # a real hang: only a section or heartbeat timeout finds it
            print(f"rank {args_rank()} hangs in {phase} at step {step} (simulated)", flush=True)
            if self.hang_by == "sigstop":
                os.kill(os.getpid(), signal.SIGSTOP)
                return
            while True:
                time.sleep(3600)
        if self.cuda_hang_in == phase:   # a kernel that spins for ~forever, then wait for it
            print(f"stuck in a CUDA kernel in {phase}", flush=True)
            torch.cuda._sleep(1 << 62)
            torch.cuda.synchronize()
        if self.phase == phase:
            end = time.monotonic() + self.seconds
            while time.monotonic() < end:  # a slow phase, not a hang: keep heartbeating
                ft.heartbeat()
                time.sleep(0.1)
            if self.raise_in == phase:   # with --hold in the same phase: raise once the hold is over
                raise RuntimeError(f"simulated exception in {phase}")


def args_rank():
    return int(os.environ.get("RANK", 0))


def batch(seed, step, rank):
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    x = torch.randn(32, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True) * 0.5 + 0.1


def settle_gradient_buckets(ddp, device="cpu"):
    """One backward pass that changes nothing, so DDP rebuilds its gradient buckets now.

    DDP reorders its buckets after the first backward; with more than 2 ranks the order decides
    how the all-reduce adds up each gradient, so a run resumed at step k (first backward after a
    restart) would sum step k+1 differently from an uninterrupted run and drift in the last bits.
    Settling the buckets before the first real step makes a resumed run exactly equal."""
    ddp(torch.zeros(1, 16, device=device)).sum().backward()
    ddp.zero_grad(set_to_none=True)


def to_cpu(obj):
    """A state dict with every tensor on the CPU (the checkpoint's form whatever the device)."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def rng_digest():
    """A short digest of the global RNG state (torch's CPU generator and Python's random)."""
    h = hashlib.sha1(torch.get_rng_state().numpy().tobytes())
    h.update(repr(random.getstate()).encode())
    return h.hexdigest()[:16]


def checksum(model):
    with torch.no_grad():
        return float(sum(p.double().sum() for p in model.parameters()))


RAISE_REQUESTED = []   # --raise-on: the signal arrived; the step that sees it raises


def main():
    args = parse_args()
    if args.raise_on:
        signal.signal(getattr(signal, "SIG" + args.raise_on.upper().removeprefix("SIG")),
                      lambda *_: RAISE_REQUESTED.append(time.time()))
    if args.restartable:
        ft.restartable(train)(args)
    else:
        train(args)


def train(args):
    """One incarnation of the job: join the group, resume from the checkpoint, train. Under
    ft.restartable it runs again in the same process after an in-process restart, so it builds
    everything that holds the process group (the group, DDP, the optimizer) on every call."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    cycle = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    progress = rng_log = None
    if args.progress_dir:
        os.makedirs(args.progress_dir, exist_ok=True)
        progress = open(os.path.join(args.progress_dir, f"rank_{rank}.txt"), "a", buffering=1)
        if args.noise:
            rng_log = open(os.path.join(args.progress_dir, f"rng_rank_{rank}.txt"), "a", buffering=1)

    hooks = Hooks(args, rank, cycle)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    ft.heartbeat()
    with ft.section("setup"):
        hooks.at("setup")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        torch.manual_seed(args.seed)
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if args.noise:
            random.seed(args.seed)   # torch's generator: seeded above
        live = ft.LiveState(model=model, optimizer=opt, rng=args.live_rng) if args.live else None
        # before DDP: its constructor broadcasts rank 0's parameters, which must be the resumed ones
        start = live.restore() if live is not None else None
        if start is not None and rank == 0:
            print(f"resumed from live state at step {start} (cycle {cycle})", flush=True)
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        settle_gradient_buckets(ddp, device)
        os.makedirs(args.ckpt_dir, exist_ok=True)
        path = os.path.join(args.ckpt_dir, "ckpt.pt")
        loss = torch.tensor(0.0)
        from_disk = start is None   # no live state: the checkpoint, as without --live
        if from_disk:
            start = 0
        if from_disk and os.path.exists(path):
            state = torch.load(path, weights_only=True, map_location=device)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            start = state["step"]
            loss = torch.tensor(state.get("loss", 0.0))
            if rank == 0 and start >= args.steps:  # a re-run of a finished job
                print(f"{path} holds a finished run (step {start} of {args.steps}): nothing left to "
                      f"train; delete {args.ckpt_dir} (or pass another --ckpt-dir) to train again", flush=True)
            elif rank == 0:
                print(f"resumed from step {start} (cycle {cycle})", flush=True)

    for step in range(start + 1, args.steps + 1):
        with ft.section("step"):
            if (args.fail_at_step == step and rank == args.fail_rank
                    and (args.fail_cycles < 0 or cycle < args.fail_cycles)):
                print(f"rank {rank}: failing on purpose at step {step}", flush=True)
                os._exit(1)  # like a crash: no teardown (gloo's may abort with peers mid-collective)
            x, y = batch(args.seed, step, rank)
            if args.noise:
                if rng_log:
                    rng_log.write(f"{cycle} {step} {rng_digest()}\n")
                x = x + args.noise * torch.randn(x.shape)
                weight = 1 + args.noise * (random.random() - 0.5)
            x, y = x.to(device), y.to(device)
            opt.zero_grad()
            loss = nn.functional.mse_loss(ddp(x), y)
            if args.noise:
                loss = loss * weight
            loss.backward()
            with live.commit(step) if live is not None else contextlib.nullcontext():
                opt.step()
            if args.step_time:
                time.sleep(args.step_time)
            hooks.at("step", step)
            if RAISE_REQUESTED:
                RAISE_REQUESTED.clear()
                if args.progress_dir:   # when it raised, for the benchmark's clock
                    with open(os.path.join(args.progress_dir, f"raised_rank_{rank}.txt"), "w") as fh:
                        fh.write(f"{time.time():.6f}\n")
                raise RuntimeError(f"simulated exception ({args.raise_on})")
        ft.heartbeat()
        hooks.at("oos", step)
        if progress:
            progress.write(f"{cycle} {step} {time.time():.6f}\n")
        if step % args.ckpt_every == 0 or step == args.steps:
            with ft.section("checkpointing"):
                hooks.at("checkpointing", step)
                if rank == 0:
                    tmp = path + ".tmp"
                    torch.save({"model": to_cpu(model.state_dict()), "opt": to_cpu(opt.state_dict()), "step": step,
                                "loss": loss.item()}, tmp)
                    os.replace(tmp, path)
                dist.barrier()
        if rank == 0 and step % 100 == 0:
            print(f"step {step} loss {loss.item():.5f}", flush=True)

    if rank == 0:
        result = {"step": args.steps, "checksum": checksum(model), "world_size": world, "cycle": cycle}
        with open(os.path.join(args.ckpt_dir, "final.json"), "w") as fh:
            json.dump(result, fh)
        print(f"FINAL step={args.steps} loss={loss.item():.6f} checksum={result['checksum']:.10f}", flush=True)
    # Free DDP while the process group is still registered: if DDP's reducer held the last reference,
    # it would destroy the group with the GIL held, and gloo's destructor joins a worker thread that
    # may still need the GIL to free the last collective: a deadlock at exit (torch issue 56297).
    del ddp, loss
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
