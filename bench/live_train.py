"""The training job of bench/live_recovery.py: one MLP with AdamW and an LR schedule, the same
model and state size for every contender, which kills one of its ranks at a chosen step.

    --mode ddp      DDP on gloo; under ft_launcher, torchrun or plain python. With --restartable it
                    runs under ft.restartable (in-place restart), with --live it also hands its
                    state to ft.LiveState and resumes from it (checkpoint only as the fallback).
    --mode torchft  one TorchFT 0.2.0 replica (1 rank) of REPLICA_ID: its Manager (quorum through
                    the lighthouse at TORCHFT_LIGHTHOUSE) on ProcessGroupGloo; gradients averaged
                    with manager.allreduce (TorchFT's DDP wrapper crashed the healthy replica on
                    gloo when a peer was killed); a recovering replica heals from a healthy peer.

Each rank appends `cycle step unixtime` to <progress-dir>/rank_<r>.txt after each completed
step (cycle: TORCHELASTIC_RESTART_COUNT, or the relaunch count INCARNATION in torchft mode), and
writes <progress-dir>/restore_rank_<r>_cycle_<c>.json saying where its state came from (live:
what LiveState.restore returned; disk: the checkpoint; peer: TorchFT's healing; fresh), how many
bytes and how long it took. With --kill-at-step K, rank --kill-rank of cycle 0 writes the time to
<progress-dir>/fault.txt and SIGKILLs itself at the start of step K (steps 1..K-1 done, K in flight).
The batch of step s on rank r is a function of (seed, s, r), so a DDP run that recovers exactly ends
with the checksum of a fault-free run (rank 0 writes it to <ckpt-dir>/final.json).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import time

import torch
import torch.distributed as dist
import torch.nn as nn


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("ddp", "torchft"), default="ddp")
    p.add_argument("--steps", type=int, default=170)
    p.add_argument("--width", type=int, default=1280, help="hidden width of the MLP")
    p.add_argument("--inputs", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--ckpt-dir", default="ckpt")
    p.add_argument("--ckpt-every", type=int, default=50, help="ddp mode: rank 0 saves a checkpoint every N steps")
    p.add_argument("--progress-dir", default="progress")
    p.add_argument("--kill-at-step", type=int, default=None)
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--kill-cycles", type=int, default=1, help="kill in every cycle below this (default: cycle 0 only)")
    p.add_argument("--restartable", action="store_true", help="ddp mode: run under ft_launcher.restartable")
    p.add_argument("--live", action="store_true", help="ddp mode: ft.LiveState (implies --restartable)")
    p.add_argument("--buddy-every", type=int, default=0,
                   help="ddp mode, --live: a buddy copy of the state every K steps (ft.LiveState(buddy_every=K))")
    p.add_argument("--guard", choices=("off", "norm", "given"), default="off",
                   help="ddp mode, --live: the step guard, live.commit(step, loss=loss) (norm: it takes the "
                        "gradients' norm itself; given: the loop's clip_grad_norm_ value is passed, grad_norm=)")
    p.add_argument("--clip", action="store_true",
                   help="ddp mode: the loop takes clip_grad_norm_ every step (as --guard given does) without the guard")
    p.add_argument("--rerun-in-place", action="store_true",
                   help="ddp mode, --guard: live.commit(step, run=forward_backward): a re-run calls it again in place")
    p.add_argument("--fingerprint-every", type=int, default=None,
                   help="--guard: LiveState's fingerprint_every (default: K from the 1 %% budget; 0: off)")
    p.add_argument("--heartbeat-ms", type=int, default=100, help="torchft mode: the Manager's heartbeat interval")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="ddp mode: cuda puts model and batches on cuda:LOCAL_RANK over NCCL (batches drawn on the "
                        "device, so no step waits on a host copy)")
    p.add_argument("--time-from", type=int, default=None,
                   help="ddp mode: the steady window, from the start of this step to the end of the last one (the "
                        "device synchronized at both ends), in final.json's steady_step_s")
    args = p.parse_args(argv)
    if args.buddy_every:
        args.live = True
    if args.live:
        args.restartable = True
    if args.mode == "torchft" and (args.live or args.restartable):
        p.error("--live/--restartable are ft_launcher's; --mode torchft heals through TorchFT's Manager")
    if args.steps < 1 or args.width < 1 or args.ckpt_every < 1:
        p.error("--steps, --width and --ckpt-every must be positive")
    return args


def build_model(args) -> nn.Module:
    torch.manual_seed(args.seed)
    random.seed(args.seed)   # every replica draws alike (LiveState keeps the RNG state: rng=True)
    w, d = args.width, args.inputs
    return nn.Sequential(nn.Linear(d, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(),
                         nn.Linear(w, d))


def build_optim(args, model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    return opt, sched


def state_bytes(model, opt) -> int:
    """Bytes of model + optimizer tensors (what a peer sends or a checkpoint holds)."""
    n = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for st in opt.state.values():
        n += sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))
    return n


def batch(args, step, rank, device=None):
    seed = args.seed * 1_000_003 + step * 1009 + rank
    if device is not None and device.type == "cuda":   # drawn where it is used: no host copy, no sync
        x = torch.randn(args.batch, args.inputs, generator=torch.Generator(device).manual_seed(seed), device=device)
    else:
        x = torch.randn(args.batch, args.inputs, generator=torch.Generator().manual_seed(seed))
    return x, torch.tanh(x.flip(1)) * 0.5


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def checksum(model) -> float:
    with torch.no_grad():
        return float(sum(p.double().sum() for p in model.parameters()))


def _peak_rss() -> int:
    """This process's peak RSS (VmHWM) in bytes."""
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """The highest RSS of this process while the block runs (sampled every millisecond by a thread)."""

    def __enter__(self):
        import threading

        self.before = self.peak = rss_bytes()
        self._stop = threading.Event()

        def sample():
            while not self._stop.wait(0.001):
                self.peak = max(self.peak, rss_bytes())

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        return False


class Progress:
    def __init__(self, args, rank, cycle):
        os.makedirs(args.progress_dir, exist_ok=True)
        self.dir, self.rank, self.cycle = args.progress_dir, rank, cycle
        self.fh = open(os.path.join(self.dir, f"rank_{rank}.txt"), "a", buffering=1)
        self.peaks = []

    def step(self, step):
        self.fh.write(f"{self.cycle} {step} {time.time():.6f}\n")
        if torch.cuda.is_available() and torch.cuda.is_initialized():   # the step at which the device's peak grew
            peak = torch.cuda.max_memory_allocated()
            if not self.peaks or self.peaks[-1][1] != peak:
                self.peaks.append((step, peak))
        with open(os.path.join(self.dir, f"rss_rank_{self.rank}.txt"), "a") as fh:   # memory, per step
            fh.write(f"{self.cycle} {step} {rss_bytes()}\n")

    def restored(self, **info):
        path = os.path.join(self.dir, f"restore_rank_{self.rank}_cycle_{self.cycle}.json")
        with open(path + ".tmp", "w") as fh:
            json.dump(info, fh)
        os.replace(path + ".tmp", path)

    def maybe_die(self, args, step):
        if args.kill_at_step == step and self.rank == args.kill_rank and self.cycle < args.kill_cycles:
            with open(os.path.join(self.dir, "fault.txt"), "w") as fh:
                fh.write(f"{time.time():.6f} {step} {self.rank}\n")
            os.kill(os.getpid(), signal.SIGKILL)

    def close(self):
        self.fh.close()


def final(args, model, rank, world, cycle, extra=None):
    os.makedirs(args.ckpt_dir, exist_ok=True)
    result = {"step": args.steps, "checksum": checksum(model), "world_size": world, "cycle": cycle, **(extra or {})}
    with open(os.path.join(args.ckpt_dir, f"final_rank_{rank}.json" if args.mode == "torchft" else "final.json"),
              "w") as fh:
        json.dump(result, fh)
    print(f"FINAL rank={rank} step={args.steps} checksum={result['checksum']:.10f}", flush=True)


# --- ddp mode: ft_launcher (--live: LiveState), torchrun, plain python ---------------------------

def train_ddp(args):
    import ft_launcher as ft

    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    cycle = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    progress = Progress(args, rank, cycle)
    ft.heartbeat()
    device = torch.device("cpu")
    with ft.section("setup"):
        if args.device == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        model = build_model(args).to(device)
        opt, sched = build_optim(args, model)
        start, source, t0 = None, None, time.perf_counter()
        live = None
        peak = None
        if args.live:
            live = ft.LiveState(model=model, optimizer=opt, scheduler=sched, buddy_every=args.buddy_every,
                                fingerprint_every=args.fingerprint_every)
            with PeakRss() as peak:
                start = live.restore()
            if start is not None:
                source = "live"
        if start is None:
            path = os.path.join(args.ckpt_dir, "ckpt.pt")
            start, source = 0, "fresh"
            if os.path.exists(path):
                state = torch.load(path, weights_only=True)
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["opt"])
                sched.load_state_dict(state["sched"])
                start, source = state["step"], "disk"
        took = time.perf_counter() - t0
        # every rank holds the same state now: DDP's broadcast from rank 0 changes nothing
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
        progress.restored(source=source, step=start, seconds=took, bytes=state_bytes(model, opt), time=time.time(),
                          live=getattr(live, "last_recovery", None),
                          rss_before=peak.before if peak else None, rss_peak=peak.peak if peak else None)
        if rank == 0:
            print(f"cycle {cycle}: resuming after step {start} ({source}, {took:.3f} s)", flush=True)

    window = None
    for step in range(start + 1, args.steps + 1):
        if step == args.time_from:
            sync(device)
            window = time.perf_counter()
        with ft.section("step"):
            progress.maybe_die(args, step)
            x, y = batch(args, step, rank, device)

            def forward_backward():
                opt.zero_grad(set_to_none=True)
                loss = nn.functional.mse_loss(ddp(x), y)
                loss.backward()
                norm = (nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
                        if args.guard == "given" or args.clip else None)
                return loss, norm

            given = args.guard == "given"
            if live is not None and args.guard != "off" and args.rerun_in_place:   # the commit runs it
                checked = live.commit(step, run=lambda: forward_backward() if given else forward_backward()[0])
            else:
                loss, norm = forward_backward()
                if live is not None:
                    checked = (live.commit(step, loss=loss, grad_norm=norm if given else None) if args.guard != "off"
                               else live.commit(step))
            if live is not None:
                with checked:
                    opt.step()
                    sched.step()
            else:
                opt.step()
                sched.step()
        ft.heartbeat()
        if step == args.steps and window is not None:
            sync(device)
            window = (time.perf_counter() - window) / (args.steps - args.time_from + 1)
        progress.step(step)
        if step % args.ckpt_every == 0 or step == args.steps:
            with ft.section("checkpointing"):
                if rank == 0:
                    os.makedirs(args.ckpt_dir, exist_ok=True)
                    path = os.path.join(args.ckpt_dir, "ckpt.pt")
                    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict(), "step": step}, path + ".tmp")
                    os.replace(path + ".tmp", path)
                dist.barrier()
    if rank == 0:
        extra = {"state_bytes": state_bytes(model, opt), "steady_step_s": window,
                 "peak_rss": _peak_rss()}
        if device.type == "cuda":
            extra.update(cuda_peak=torch.cuda.max_memory_allocated(device), device_name=torch.cuda.get_device_name(device),
                         cuda_peak_steps=progress.peaks)
        if live is not None:   # the per-step cost of keeping the committed state (snapshots at commit)
            extra.update(commits=live.stats["commits"], snapshot_s=live.stats["snapshot_s"],
                         commit_bytes=live.stats["commit_bytes"], in_place_bytes=live.stats["in_place_bytes"],
                         guarded=live.stats["guarded"], guard_s=live.stats["guard_s"])
            from ft_launcher.rank_monitor.rank_side.live import step_guard
            extra.update(fingerprint_k=step_guard.MEM.fp.k, fingerprint_s=step_guard.MEM.fp.cost)
            if live.stats["guarded"]:   # the guard's table's collective
                extra.update(reduce_s=step_guard.MEM.reduce_s, reduce_min=step_guard.MEM.reduce_min)
        final(args, model, rank, world, cycle, extra)
    stats = live.buddy_stats() if live is not None else None
    if stats is not None:   # this cycle's buddy-copy figures (the bench's per-step cost)
        with open(os.path.join(args.progress_dir, f"buddy_rank_{rank}_cycle_{cycle}.json"), "w") as fh:
            json.dump(dict(stats, steps=args.steps - start), fh)
    progress.close()
    del ddp   # before the group goes (see examples/ddp_train.py: gloo's exit deadlock)
    dist.destroy_process_group()


# --- torchft mode: one replica of TorchFT 0.2.0 ----------------------------------------------------

def train_torchft(args):
    from datetime import timedelta

    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing import HTTPTransport

    replica = int(os.environ["REPLICA_ID"])
    cycle = int(os.environ.get("INCARNATION", 0))
    progress = Progress(args, replica, cycle)
    model = build_model(args)
    opt, sched = build_optim(args, model)
    healed = {}

    class TimedTransport(HTTPTransport):
        """TorchFT's HTTP transport, timing what a recovering replica receives."""

        def recv_checkpoint(self, src_rank, metadata, step, timeout):
            t0 = time.perf_counter()
            out = super().recv_checkpoint(src_rank, metadata, step, timeout)
            healed.update(seconds=time.perf_counter() - t0, src=src_rank, step=step, time=time.time())
            return out

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])
        sched.load_state_dict(sd["sched"])

    def state_dict():
        return {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}

    # A replica group of one rank: its own store (the Manager's rank-0 server registers there).
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=30)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1,
        load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"bench_{replica}",
        rank=0, world_size=1, store_addr="localhost", store_port=store.port,
        lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"], timeout=timeout, quorum_timeout=timeout,
        connect_timeout=timeout, heartbeat_interval=timedelta(milliseconds=args.heartbeat_ms),
        checkpoint_transport=TimedTransport(timeout=timeout, num_chunks=0))
    reported = False
    try:
        while manager.current_step() < args.steps:
            step = manager.current_step() + 1
            progress.maybe_die(args, step)
            opt.zero_grad(set_to_none=True)
            manager.start_quorum()
            x, y = batch(args, step, replica)
            nn.functional.mse_loss(model(x), y).backward()
            works = [manager.allreduce(p.grad) for p in model.parameters() if p.grad is not None]
            for w in works:
                w.wait()
            if manager.should_commit():
                opt.step()
                sched.step()
                progress.step(manager.current_step())
            if not reported and manager.current_step() > 0:
                reported = True
                if healed:
                    progress.restored(source=f"peer replica {healed['src']}", step=healed["step"],
                                      seconds=healed["seconds"], bytes=state_bytes(model, opt), time=healed["time"])
                else:
                    progress.restored(source="fresh", step=0, seconds=0.0, bytes=state_bytes(model, opt),
                                      time=time.time())
        final(args, model, replica, 2, cycle, {"state_bytes": state_bytes(model, opt)})
    finally:
        progress.close()
        manager.shutdown(wait=False)


def main(argv=None):
    args = parse_args(argv)
    if args.mode == "torchft":
        train_torchft(args)
    elif args.restartable:
        import ft_launcher as ft
        ft.restartable(train_ddp)(args)
    else:
        train_ddp(args)


if __name__ == "__main__":
    main()
