"""Launch and recovery times of ft_launcher against the installed torchrun, same job, same run.

    python bench/recovery.py [--reps 3] [--nproc 2]

Measures, on the example DDP job (gloo, checkpoint every 5 steps, 50 ms per step):
  launch      launcher start -> every rank has made its first step
  kill        SIGKILL to rank 1 -> every rank stepping again in the next cycle
  hang        SIGSTOP to rank 1 inside 'step' (timeout 2 s) -> every rank stepping again;
              torchrun has no hang detection, so it has no figure here
and prints medians and the ft_launcher / torchrun ratio.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Job, ratio, summary  # noqa: E402

STEP_TIMEOUT = 2.0


def script_args(ckpt_every=5):
    return ["--steps", "100000", "--step-time", "0.05", "--ckpt-every", str(ckpt_every),
            "--progress-dir", "progress", "--ckpt-dir", "ckpt"]


def launch_and_fault(kind: str, nproc: int, fault: str):
    """-> (launch seconds, recovery seconds or None)."""
    extra = ["--max-restarts", "3"]
    if fault == "hang":
        extra += ["--ft-rank-section-timeouts", f"setup:60,step:{STEP_TIMEOUT:g},checkpointing:60"]
    job = Job(kind, nproc, extra, script_args())
    ok = False
    try:
        first = job.wait_for(lambda: job.all_stepping(nproc, 0), 120, "the first step")
        launch = first - job.started
        if fault == "none":
            ok = True
            return launch, None
        job.wait_for(lambda: all(len(r) >= 12 for r in job.progress().values()) and len(job.progress()) == nproc,
                     60, "12 steps")
        pid = job.rank_pid(1)
        t0 = time.time()
        os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        try:
            back = job.wait_for(lambda: job.all_stepping(nproc, 1, after=t0), 60, "all ranks stepping again")
        except RuntimeError as exc:  # the launcher gave up: no recovery figure, say why
            print(f"  {kind}: did not recover: {exc}", flush=True)
            return launch, None
        ok = True
        return launch, back - t0
    finally:
        job.stop(keep_dir=not ok)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    args = p.parse_args()
    launch_and_fault("ft_launcher", args.nproc, "none")  # warm the page cache (torch import)
    launch_and_fault("torchrun", args.nproc, "none")
    results = {}
    for rep in range(args.reps):
        for kind, fault in (("torchrun", "kill"), ("ft_launcher", "kill"), ("ft_launcher", "hang")):
            launch, recovery = launch_and_fault(kind, args.nproc, fault)
            results.setdefault((kind, "launch"), []).append(launch)
            results.setdefault((kind, fault), [])
            failed = results.setdefault((kind, fault, "failed"), [])
            if recovery is None:
                failed.append(rep)
            else:
                results[(kind, fault)].append(recovery)
            shown = "did not recover" if recovery is None else f"{recovery:5.2f} s"
            print(f"  rep {rep}: {kind:11s} launch {launch:5.2f} s, {fault} -> stepping again {shown}", flush=True)
    print(f"\n{args.nproc} ranks, {args.reps} repetitions, {os.cpu_count()} cores")
    print(f"launch -> first step      torchrun    {summary(results[('torchrun', 'launch')])}")
    print(f"                          ft_launcher {summary(results[('ft_launcher', 'launch')])}"
          f"   ratio {ratio(results[('ft_launcher', 'launch')], results[('torchrun', 'launch')])}")
    print(f"kill rank -> stepping     torchrun    {summary(results[('torchrun', 'kill')])}"
          f"   recovered {args.reps - len(results[('torchrun', 'kill', 'failed')])}/{args.reps}")
    print(f"                          ft_launcher {summary(results[('ft_launcher', 'kill')])}"
          f"   recovered {args.reps - len(results[('ft_launcher', 'kill', 'failed')])}/{args.reps}"
          f"   ratio {ratio(results[('ft_launcher', 'kill')], results[('torchrun', 'kill')])}")
    hang = results[("ft_launcher", "hang")]
    print(f"hang in step (T={STEP_TIMEOUT:g} s)     torchrun    never detected")
    print(f"                          ft_launcher {summary(hang)}"
          + (f"   = T + {statistics.median(hang) - STEP_TIMEOUT:.2f} s" if hang else ""))


if __name__ == "__main__":
    main()
