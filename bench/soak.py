"""Soak benchmark: the example DDP job under ft_launcher with a simulated fault in every cycle.

    python bench/soak.py                      # 180 s of random faults, then 60 s rank_killed vs torchrun
    python bench/soak.py --duration 60 --compare-duration 0

The launcher injects `random` faults (rank_hung or rank_killed, from a seed) DELAY s after each
cycle's ranks start (`simulated_fault_count` -1, large --max-restarts); hangs are caught by a
`step` section timeout. From events.jsonl (fault_injected) and the ranks' progress files
(examples/ddp_train.py --progress-dir: "cycle step time" per step) it reports faults injected,
faults recovered (every rank stepping in the next cycle), mean and worst time from the fault to
all ranks stepping again, and steps lost (steps done after the last checkpoint, redone).

The comparison runs rank_killed only (torchrun cannot detect hangs) for both launchers: for
torchrun the benchmark itself SIGKILLs the same rank at the same delay after the rank starts.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_jobs import EXAMPLE, bench_env, read_progress, stop_launcher  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="bench/soak.py", description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=180, help="seconds of the random-fault soak (default 180)")
    p.add_argument("--compare-duration", type=float, default=60,
                   help="seconds of each rank_killed run, ft_launcher and torchrun (0: skip)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--delay", type=float, default=5.0, help="fault due this long after a cycle's ranks start")
    p.add_argument("--step-timeout", type=float, default=2.0, help="'step' section timeout (finds hangs)")
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    if args.duration <= 0 or args.nproc < 2 or args.delay <= 0:
        p.error("need --duration > 0, --nproc >= 2, --delay > 0")
    return args


def job_args(args, work):
    return [EXAMPLE, "--steps", "1000000", "--step-time", args.step_time, "--ckpt-every", args.ckpt_every,
            "--seed", args.seed, "--ckpt-dir", os.path.join(work, "ckpt"),
            "--progress-dir", os.path.join(work, "progress")]


# ---- runs -----------------------------------------------------------------------------------
def run_ft(args, work, kind, duration):
    """ft_launcher with a simulated `kind` fault every cycle; returns [fault times]."""
    logs = os.path.join(work, "logs")
    cmd = [sys.executable, "-m", "ft_launcher", "--standalone", "--nproc-per-node", args.nproc,
           "--max-restarts", "100000", "--log-dir", logs, "--redirects", "3", "--workers-stop-timeout", "2",
           "--term-timeout", "5", "--ft-rank-section-timeouts", f"setup:60,step:{args.step_timeout},checkpointing:10",
           # a rank stopped between sections leaves its peers waiting in 'checkpointing' or the
           # next 'step'; this catches it itself (start-up counts as out of section: keep room)
           "--ft-rank-out-of-section-timeout", "10",
           "--ft-simulate-fault", "true", "--ft-simulated-fault-type", kind, "--ft-simulated-fault-count", "-1",
           "--ft-simulated-fault-base-delay", args.delay, "--ft-simulated-fault-seed", args.seed]
    proc = subprocess.Popen([str(c) for c in cmd + job_args(args, work)], cwd=work, env=bench_env(),
                            stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, "agent.log"), "w"),
                            start_new_session=True)
    try:
        end = time.monotonic() + duration
        while time.monotonic() < end and proc.poll() is None:
            time.sleep(0.5)
    finally:
        stop_launcher(proc)
    faults = []
    with open(os.path.join(logs, "events.jsonl")) as fh:
        for line in fh:
            event = json.loads(line)
            if event["kind"] == "fault_injected":
                faults.append((event["cycle"], event["time"], event["detail"]["fault"]))
    return faults


def run_torchrun(args, work, duration):
    """torchrun with the benchmark SIGKILLing one rank per cycle, `delay` s after it started."""
    torchrun = shutil.which("torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", args.nproc, "--max-restarts", "100000"]
    proc = subprocess.Popen([str(c) for c in cmd + job_args(args, work)], cwd=work, env=bench_env(),
                            stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, "torchrun.log"), "w"),
                            start_new_session=True)
    faults, done, seen, cycle = [], set(), {}, 0
    try:
        end = time.monotonic() + duration
        while time.monotonic() < end and proc.poll() is None:
            time.sleep(0.05)
            for worker in _workers(proc.pid):
                seen[worker.pid] = worker
                if worker.pid in done:
                    continue
                try:
                    wenv = worker.environ()
                    cycle, world = int(wenv.get("TORCHELASTIC_RESTART_COUNT", -1)), int(wenv.get("WORLD_SIZE", 0))
                    rank, started = int(wenv.get("RANK", -1)), worker.create_time()
                except (psutil.NoSuchProcess, ValueError):
                    continue
                if world <= 0:   # torchrun itself (its command line names the script too)
                    continue
                rng = random.Random(args.seed * 1_000_003 + cycle)   # as the launcher draws its plans
                target = rng.randrange(world)
                delay = args.delay * (1.0 + 0.2 * rng.random())
                if rank != target:
                    done.add(worker.pid)
                    continue
                if time.time() >= started + delay:
                    try:
                        worker.send_signal(signal.SIGKILL)
                        faults.append((cycle, time.time(), "rank_killed"))
                    except psutil.NoSuchProcess:
                        pass
                    done.add(worker.pid)
    finally:
        stop_launcher(proc)
        for worker in seen.values():   # torchrun's own workers, should it have left any
            try:
                worker.kill()
            except psutil.NoSuchProcess:
                pass
    return faults


def _workers(agent_pid):
    try:
        return [c for c in psutil.Process(agent_pid).children(recursive=True)
                if EXAMPLE in " ".join(c.cmdline())]
    except psutil.NoSuchProcess:
        return []


# ---- measures -------------------------------------------------------------------------------
def measure(faults, progress, nproc):
    """-> dict(injected, recovered, times, lost)."""
    times, lost = [], 0
    for cycle, at, _ in faults:
        after = [[(c, s, t) for c, s, t in progress[r] if c > cycle] for r in range(nproc)]
        if not all(after):
            continue
        next_cycle = min(c for rows in after for c, _, _ in rows)
        firsts = [min((t, s) for c, s, t in rows if c == next_cycle) if any(c == next_cycle for c, _, _ in rows)
                  else None for rows in after]
        if None in firsts:
            continue
        times.append(max(t for t, _ in firsts) - at)
        reached = max((s for r in range(nproc) for c, s, t in progress[r] if c == cycle), default=0)
        resumed = min(s for _, s in firsts) - 1
        lost += max(0, reached - resumed)
    return {"injected": len(faults), "recovered": len(times), "times": times, "lost": lost}


def row(name, m):
    times = m["times"]
    mean = f"{statistics.mean(times):6.2f} s" if times else "     -  "
    worst = f"{max(times):6.2f} s" if times else "     -  "
    return f"{name:<26} {m['injected']:>7} {m['recovered']:>9}  {mean}  {worst}  {m['lost']:>10}"


def one(args, kind, duration, launcher="ft_launcher"):
    work = tempfile.mkdtemp(prefix=f"soak_{launcher}_{kind}_")
    faults = run_ft(args, work, kind, duration) if launcher == "ft_launcher" else run_torchrun(args, work, duration)
    progress = read_progress(os.path.join(work, "progress"))
    result = measure(faults, {r: progress.get(r, []) for r in range(args.nproc)}, args.nproc)
    result["work"] = work
    return result


def main(argv=None):
    args = parse_args(argv)
    print(f"soak: {args.nproc} ranks, fault {args.delay:g}-{args.delay * 1.2:g} s after each cycle starts, "
          f"step timeout {args.step_timeout:g} s, checkpoint every {args.ckpt_every} steps", flush=True)
    rows = [("ft_launcher random", one(args, "random", args.duration))]
    if args.compare_duration > 0:
        rows.append(("ft_launcher rank_killed", one(args, "rank_killed", args.compare_duration)))
        if shutil.which("torchrun"):
            rows.append(("torchrun rank_killed", one(args, "rank_killed", args.compare_duration, "torchrun")))
        else:
            print("torchrun not found: comparison skipped")
    print(f"\n{'run':<26} {'faults':>7} {'recovered':>9}  {'mean':>8}  {'worst':>8}  {'steps lost':>10}")
    for name, m in rows:
        print(row(name, m))
    if len(rows) == 3 and rows[1][1]["times"] and rows[2][1]["times"]:
        ratio = statistics.mean(rows[2][1]["times"]) / statistics.mean(rows[1][1]["times"])
        print(f"\nkill -> all ranks stepping again, mean: torchrun / ft_launcher = {ratio:.2f}x")
    print("\n(recovery: fault -> every rank has finished a step in the next cycle; logs in "
          + ", ".join(m["work"] for _, m in rows) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
