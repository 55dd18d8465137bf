"""GPU recovery on NCCL: ft_launcher beside the installed torchrun, same job, same run.

    python bench/gpu_recovery.py [--reps 2]

Runs the example DDP job with `--device cuda` (NCCL, one rank per visible GPU:
`--nproc-per-node gpu`, checkpoint every 5 steps, 50 ms per step) and measures
  launch      launcher start -> every rank has made its first step (both launchers)
  kill        SIGKILL to a rank -> every rank stepping again in the next cycle (both launchers;
              ft_launcher once its warm reserves are ready, and 12 steps in, while they still warm)
  hang        a rank stuck in a CUDA kernel (`torch.cuda._sleep`, the example's --cuda-hang-in
              step) under a 2 s step timeout -> every rank stepping again (ft_launcher, at step 40
              and at step 400, after its reserve is ready; torchrun does not detect it before
              NCCL's own timeout, 10 min)
and, for the hang, prints the flight-recorder summary the launcher logged (`flight_recorder`
event: the collective that never completed and who never joined it) and the head of torch's
analyzer output gathered into the cycle's log dir. Needs only torch (with CUDA) and psutil.
On a machine without a usable CUDA GPU it says so in one line and exits 0.
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
HANG_STEP = 40         # the hang comes ~2 s after the first step: before the warm reserve is ready
HANG_STEP_LATE = 400   # ~20 s after it: the reserve is ready (ft_launcher's steady state)


def script_args(extra=()):
    return ["--device", "cuda", "--steps", "100000", "--step-time", "0.05", "--ckpt-every", "5",
            "--progress-dir", "progress", "--ckpt-dir", "ckpt", *extra]


def events(job: Job, kind: str):
    path = os.path.join(job.dir, "logs", "events.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    return [r for r in records if r["kind"] == kind]


def run(kind: str, nranks: int, fault: str, report: dict):
    """-> (launch seconds, recovery seconds or None). `fault`: kill (ft_launcher: once its warm
    reserves are ready), kill-early (12 steps in: the reserve still warming), hang (in a CUDA kernel
    at HANG_STEP), hang-late (at HANG_STEP_LATE)."""
    extra = ["--max-restarts", "3"]
    if kind == "ft_launcher":
        extra += ["--log-dir", "logs"]
    victim = min(1, nranks - 1)
    hook = []
    hang_step = HANG_STEP_LATE if fault == "hang-late" else HANG_STEP
    if fault.startswith("hang"):
        extra += ["--ft-rank-section-timeouts", f"setup:180,step:{STEP_TIMEOUT:g},checkpointing:120"]
        hook = ["--cuda-hang-in", "step", "--hold-step", str(hang_step), "--fail-rank", str(victim)]
    job = Job(kind, "gpu", extra, script_args(hook))
    ok = False
    try:
        first = job.wait_for(lambda: job.all_stepping(nranks, 0), 300, "the first step")
        launch = first - job.started
        if fault == "none":
            ok = True
            return launch, None
        t0 = None
        if fault.startswith("kill"):
            job.wait_for(lambda: len(job.progress()) == nranks and all(len(r) >= 12 for r in job.progress().values()),
                         120, "12 steps")
            if kind == "ft_launcher" and fault == "kill":
                ready = job.wait_for(lambda: reserves_ready(job, nranks), 120, "warm reserves")
                report.setdefault("warm_s", []).extend(r["time"] - job.started for r in ready.values())
            t0 = time.time()
            os.kill(job.rank_pid(victim), signal.SIGKILL)
        else:   # the victim enters its endless kernel at HANG_STEP: the fault starts there
            def at_hang_step():
                rows = job.progress().get(victim, [])
                return next((t for c, s, t in rows if c == 0 and s == hang_step - 1), None)
            t0 = job.wait_for(at_hang_step, 120, f"rank {victim} at step {hang_step}")
        try:
            back = job.wait_for(lambda: job.all_stepping(nranks, 1, after=t0), 180, "all ranks stepping again")
        except RuntimeError as exc:
            print(f"  {kind}: did not recover: {exc}", flush=True)
            return launch, None
        if kind == "ft_launcher":   # how cycle 1's ranks started: r ready reserve, w warming, c cold
            report.setdefault("starts", {}).setdefault(fault, []).append(cycle1_starts(job))
        if fault.startswith("hang"):
            fr = job.wait_for(lambda: events(job, "flight_recorder") or None, 90, "the flight-recorder summary")
            report["fr_event"] = fr[0]
            trace = os.path.join(fr[0]["detail"].get("dir", ""), "fr_trace.txt")
            if os.path.exists(trace):
                with open(trace) as fh:
                    report["fr_trace"] = fh.read()
            report["hang_events"] = [e["detail"].get("section") for e in events(job, "hang")]
        ok = True
        return launch, back - t0
    finally:
        job.stop(keep_dir=not ok)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=2)
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_recovery: skipped: no usable CUDA GPU here (torch.cuda.is_available() is False); "
              "run it on a GPU machine")
        return 0
    nranks = torch.cuda.device_count()
    print(f"{nranks} GPU(s): {torch.cuda.get_device_name(0)}; torch {torch.__version__}", flush=True)
    run("ft_launcher", nranks, "none", {})   # warm the page cache and the driver
    run("torchrun", nranks, "none", {})
    report = {}
    runs = (("torchrun", "kill"), ("ft_launcher", "kill"), ("ft_launcher", "kill-early"), ("ft_launcher", "hang"),
            ("ft_launcher", "hang-late"))
    results = repeat(runs, args.reps, lambda entry: run(entry[0], nranks, entry[1], report))
    starts = report.get("starts", {})
    print(f"\n{nranks} rank(s) on NCCL, {args.reps} repetitions (cycle 1's ranks: r a ready warm reserve, "
          f"w a reserve still warming, c cold)")
    print(f"launch -> first step      torchrun    {summary(results[('torchrun', 'launch')])}")
    print(f"                          ft_launcher {summary(results[('ft_launcher', 'launch')])}"
          f"   ratio {ratio(results[('ft_launcher', 'launch')], results[('torchrun', 'launch')])}")
    print(f"kill rank -> stepping     torchrun    {summary(results[('torchrun', 'kill')])}"
          f"   {recovered(results, 'torchrun', 'kill', args.reps)}")
    for fault, when in (("kill", "reserve ready"), ("kill-early", "12 steps in")):
        print(f"  ({when:13s})           ft_launcher {summary(results[('ft_launcher', fault)])}"
              f"   {recovered(results, 'ft_launcher', fault, args.reps)}"
              f"   ratio {ratio(results[('ft_launcher', fault)], results[('torchrun', 'kill')])}"
              f"   starts {','.join(starts.get(fault, []))}")
    if report.get("warm_s"):
        print(f"warm reserve ready {statistics.median(report['warm_s']):.1f} s after launch (median)")
    print(f"CUDA-kernel hang (T={STEP_TIMEOUT:g} s) torchrun    not detected (NCCL's own timeout: 10 min)")
    for fault, when in (("hang", f"step {HANG_STEP}"), ("hang-late", f"step {HANG_STEP_LATE}")):
        hang = results[("ft_launcher", fault)]
        print(f"  (at {when:9s})           ft_launcher {summary(hang)}"
              + (f"   = T + {statistics.median(hang) - STEP_TIMEOUT:.2f} s" if hang else "")
              + f"   {recovered(results, 'ft_launcher', fault, args.reps)}   starts {','.join(starts.get(fault, []))}")
    fr = report.get("fr_event")
    if fr:
        d = fr["detail"]
        print(f"\nflight recorder (last hang): dumped ranks {d.get('dumped')}, skipped {d.get('skipped') or 'none'}; "
              f"collective {d.get('collective', 'none named')}, missing ranks {d.get('missing_ranks', [])}; "
              f"waiting {d.get('waiting') or 'none'}")
        head = [line for line in report.get("fr_trace", "").splitlines() if line.strip()][:12]
        if head:
            print("torch's analyzer said:\n  " + "\n  ".join(head))
    else:
        print("\nflight recorder: no summary was logged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
