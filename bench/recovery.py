"""Launch and recovery times of ft_launcher against the installed torchrun, same job, same run.

    python bench/recovery.py [--reps 3] [--nproc 2]

Measures, on the example DDP job (gloo, checkpoint every 5 steps, 50 ms per step):
  launch      launcher start -> every rank has made its first step (every run measures it;
              `--only torchrun:launch,ft_launcher:launch` measures only that, alternating)
  kill        SIGKILL to rank 1 -> every rank stepping again in the next cycle
  hang        SIGSTOP to rank 1 inside 'step' (timeout 2 s) -> every rank stepping again;
              torchrun has no hang detection, so it has no figure here
  raise       SIGUSR1 to rank 1, whose step then raises an exception (ddp_train --raise-on USR1);
              from the raise (the time the example writes) -> every rank stepping again
  early       SIGKILL to rank 1 EARLY_S after every rank's first step (no reserve is ready yet)
              -> every rank stepping again; torchrun in the same run; also how each rank of the
              next cycle started (a reserve taken while still warming, a ready one, or cold)
The in-place hang (hang-inplace) also counts the runs in which every victim (the ranks not
SIGSTOPped) kept its process (hang blame, agent/recovery.hang_blame.py).
ft_launcher runs with its default warm reserves (the fault is injected once every slot's reserve
is warm, as in a job that has run for more than a few seconds), for comparison with
`--ft-warm-reserves 0` (every restart cold), and with the training function under
ft.restartable (ddp_train --restartable: in-process restart, the healthy rank keeps its process),
and the warm kill again with `--ft-reserve-preimport recorded` (every library the rank imported)
and `none` (nothing: the reserve saves only the interpreter's start) beside the default `torch`.
Prints medians, the ft_launcher / torchrun ratio, and how long a reserve took to warm and its
memory (RSS) per slot.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_jobs import Job, cycle1_starts, ratio, recovered, repeat, reserves_ready, summary  # noqa: E402

STEP_TIMEOUT = 2.0
EARLY_S = 0.25


def script_args(ckpt_every=5, in_place=False):
    return ["--steps", "100000", "--step-time", "0.05", "--ckpt-every", str(ckpt_every),
            "--progress-dir", "progress", "--ckpt-dir", "ckpt", "--raise-on", "USR1"] + (
        ["--restartable"] if in_place else [])


def _read_time(path: str):
    try:
        with open(path) as fh:
            return float(fh.read().strip())
    except (OSError, ValueError):
        return None


def _victims_kept(job: Job, nproc: int) -> bool:
    """Every rank but rank 1 restarted in place with its cycle-0 pid (ranks_started events)."""
    path = os.path.join(job.dir, "logs", "events.jsonl")
    pids = {}
    with open(path) as fh:
        for line in fh:
            event = json.loads(line)
            if event["kind"] == "ranks_started":
                for r in event["detail"]["ranks"]:
                    pids.setdefault(event["cycle"], {})[r["rank"]] = (r["pid"], r.get("in_place", False))
    return all(pids.get(1, {}).get(r) == (pids[0][r][0], True) for r in range(nproc) if r != 1)


def launch_and_fault(kind: str, nproc: int, fault: str, reserves: bool = True, stats: dict = None,
                     in_place: bool = False, preimport: str = None):
    """-> (launch seconds, recovery seconds or None)."""
    extra = ["--max-restarts", "3"]
    if kind == "ft_launcher":
        extra += ["--log-dir", "logs"] + ([] if reserves else ["--ft-warm-reserves", "0"])
        extra += ["--ft-reserve-preimport", preimport] if preimport else []
    if fault == "hang":
        extra += ["--ft-rank-section-timeouts", f"setup:60,step:{STEP_TIMEOUT:g},checkpointing:60"]
    job = Job(kind, nproc, extra, script_args(in_place=in_place))
    ok = False
    try:
        first = job.wait_for(lambda: job.all_stepping(nproc, 0), 120, "the first step")
        launch = first - job.started
        if fault in ("none", "launch"):
            ok = True
            return launch, None
        if fault == "early":   # before any reserve is ready: SIGKILL rank 1 EARLY_S after the first step
            pid = job.rank_pid(1)
            time.sleep(max(0.0, first + EARLY_S - time.time()))
            t0 = time.time()
            os.kill(pid, signal.SIGKILL)
            try:
                back = job.wait_for(lambda: job.all_stepping(nproc, 1, after=t0), 60, "all ranks stepping again")
            except RuntimeError as exc:
                print(f"  {kind}: did not recover: {exc}", flush=True)
                return launch, None
            ok = True
            if kind == "ft_launcher" and stats is not None:
                stats.setdefault("early_starts", []).append(cycle1_starts(job))
            return launch, back - t0
        job.wait_for(lambda: all(len(r) >= 12 for r in job.progress().values()) and len(job.progress()) == nproc,
                     60, "12 steps")
        if kind == "ft_launcher" and reserves:
            ready = job.wait_for(lambda: reserves_ready(job, nproc), 120, "warm reserves")
            if stats is not None and not preimport:   # the default's reserves
                for info in ready.values():
                    stats.setdefault("warm_s", []).append(info["time"] - job.started)
                    stats.setdefault("rss_mb", []).append(info["rss"] / 2**20)
        pid = job.rank_pid(1)
        t0 = time.time()
        os.kill(pid, {"kill": signal.SIGKILL, "hang": signal.SIGSTOP, "raise": signal.SIGUSR1}[fault])
        if fault == "raise":   # the clock starts when the step raised (the example writes the time)
            raised = os.path.join(job.dir, "progress", "raised_rank_1.txt")
            t0 = job.wait_for(lambda: _read_time(raised), 30, "the exception")
        try:
            back = job.wait_for(lambda: job.all_stepping(nproc, 1, after=t0), 60, "all ranks stepping again")
        except RuntimeError as exc:  # the launcher gave up: no recovery figure, say why
            print(f"  {kind}: did not recover: {exc}", flush=True)
            return launch, None
        if fault == "hang" and in_place and stats is not None:
            stats.setdefault("victims_kept", []).append(_victims_kept(job, nproc))
        ok = True
        return launch, back - t0
    finally:
        job.stop(keep_dir=not ok)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--only", default=None, help="comma-separated runs to measure, e.g. "
                   "torchrun:kill,ft_launcher:hang-inplace,torchrun:early,ft_launcher:early")
    args = p.parse_args()
    launch_and_fault("ft_launcher", args.nproc, "none")  # warm the page cache (torch import)
    launch_and_fault("torchrun", args.nproc, "none")
    stats = {}
    runs = (("torchrun", "kill", True), ("torchrun", "raise", True),
            ("ft_launcher", "kill", True), ("ft_launcher", "hang", True), ("ft_launcher", "raise", True),
            ("ft_launcher", "kill-cold", False), ("ft_launcher", "hang-cold", False),
            ("ft_launcher", "kill-recorded", True), ("ft_launcher", "kill-none", True),
            ("ft_launcher", "kill-inplace", True), ("ft_launcher", "hang-inplace", True),
            ("ft_launcher", "raise-inplace", True), ("torchrun", "early", True), ("ft_launcher", "early", True))
    if args.only:   # launch-only runs exist only where asked for
        runs += (("torchrun", "launch", True), ("ft_launcher", "launch", True))
        wanted = set(args.only.split(","))
        runs = tuple(r for r in runs if f"{r[0]}:{r[1]}" in wanted)
    results = repeat(runs, args.reps, lambda run: launch_and_fault(
        run[0], args.nproc, run[1].split("-")[0], run[2], stats, in_place=run[1].endswith("-inplace"),
        preimport=next((m for m in ("recorded", "none") if run[1].endswith("-" + m)), None)))
    print(f"\n{args.nproc} ranks, {args.reps} repetitions, {os.cpu_count()} cores")
    for kind, fault in (("torchrun", "launch"), ("ft_launcher", "launch")):
        results.setdefault((kind, fault), [])
    for kind, fault, _ in ((k, f, 0) for k in ("torchrun", "ft_launcher") for f in (
            "kill", "raise", "hang", "kill-cold", "hang-cold", "kill-recorded", "kill-none", "kill-inplace",
            "hang-inplace", "raise-inplace",
            "early")):
        results.setdefault((kind, fault), [])
        results.setdefault((kind, fault, "failed"), [])
    print(f"launch -> first step      torchrun    {summary(results[('torchrun', 'launch')])}")
    print(f"                          ft_launcher {summary(results[('ft_launcher', 'launch')])}"
          f"   ratio {ratio(results[('ft_launcher', 'launch')], results[('torchrun', 'launch')])}")
    print(f"kill rank -> stepping     torchrun    {summary(results[('torchrun', 'kill')])}"
          f"   {recovered(results, 'torchrun', 'kill', args.reps)}")
    for fault, label in (("kill", "warm"), ("kill-recorded", "warm, reserve_preimport recorded"),
                         ("kill-none", "warm, reserve_preimport none"), ("kill-cold", "cold"),
                         ("kill-inplace", "in place")):
        print(f"                          ft_launcher {summary(results[('ft_launcher', fault)])}"
              f"   {recovered(results, 'ft_launcher', fault, args.reps)}"
              f"   ratio {ratio(results[('ft_launcher', fault)], results[('torchrun', 'kill')])}  ({label})")
    print(f"exception -> stepping     torchrun    {summary(results[('torchrun', 'raise')])}"
          f"   {recovered(results, 'torchrun', 'raise', args.reps)}")
    for fault, label in (("raise", "warm"), ("raise-inplace", "in place")):
        print(f"                          ft_launcher {summary(results[('ft_launcher', fault)])}"
              f"   {recovered(results, 'ft_launcher', fault, args.reps)}"
              f"   ratio {ratio(results[('ft_launcher', fault)], results[('torchrun', 'raise')])}  ({label})")
    print(f"hang in step (T={STEP_TIMEOUT:g} s)     torchrun    never detected")
    for fault, label in (("hang", "warm"), ("hang-cold", "cold"), ("hang-inplace", "in place")):
        hang = results[("ft_launcher", fault)]
        print(f"                          ft_launcher {summary(hang)}"
              + (f"   = T + {statistics.median(hang) - STEP_TIMEOUT:.2f} s" if hang else "") + f"  ({label})")
    hang, kill = results[("ft_launcher", "hang-inplace")], results[("ft_launcher", "kill-inplace")]
    if hang:
        kept = stats.get("victims_kept", [])
        print(f"in place: kill -> stepping {summary(kill)}; hang in step -> stepping "
              f"T + {statistics.median(hang) - STEP_TIMEOUT:.2f} s (victims kept their process in "
              f"{sum(kept)}/{len(kept)} runs)")
    print(f"kill {EARLY_S:g} s after the first step     torchrun    {summary(results[('torchrun', 'early')])}"
          f"   {recovered(results, 'torchrun', 'early', args.reps)}")
    print(f"                          ft_launcher {summary(results[('ft_launcher', 'early')])}"
          f"   {recovered(results, 'ft_launcher', 'early', args.reps)}"
          f"   ratio {ratio(results[('ft_launcher', 'early')], results[('torchrun', 'early')])}")
    if stats.get("early_starts"):
        print(f"early kill, how cycle 1's ranks started (w: reserve taken while warming, r: ready reserve, "
              f"c: cold): {' '.join(stats['early_starts'])}")
    if stats.get("warm_s"):
        print(f"warm reserve: ready {statistics.median(stats['warm_s']):.1f} s after launch (median), "
              f"RSS {statistics.median(stats['rss_mb']):.0f} MB per slot "
              f"(min {min(stats['rss_mb']):.0f}, max {max(stats['rss_mb']):.0f})")


if __name__ == "__main__":
    main()
