"""Hot-path cost: section enter+exit and heartbeat, measured inside real ranks.

    python bench/sections.py

Runs bench/section_rank.py (2 ranks) under ft_launcher, with the monitors running and then
SIGSTOPped (a stalled monitor must not slow training), and under the installed torchrun, where
the same calls are the no-op path. Prints per-call medians; goals: section pair <= 3 us,
heartbeat <= 2 us (NVRx's socket client: ~90 us to ~480 us per pair on this machine).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import tempfile

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_jobs import Job  # noqa: E402

RANK_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "section_rank.py")
NPROC = 2


def run(kind: str, stop_monitors: bool) -> list:
    out = tempfile.mkdtemp(prefix="ftbench_sections_")
    args = [out] + (["--stop-monitor-phase"] if stop_monitors else [])
    extra = ["--ft-rank-section-timeouts", "step:60"] if kind == "ft_launcher" else []
    job = Job(kind, NPROC, extra, args, script=RANK_SCRIPT)
    stopped = []
    try:
        if stop_monitors:
            job.wait_for(lambda: all(os.path.exists(os.path.join(out, f"ready_{r}")) for r in range(NPROC)),
                         120, "the first phase")
            for p in psutil.Process(job.proc.pid).children():
                if p.cmdline()[0].startswith("ft_launcher: rank_monitor"):
                    p.send_signal(signal.SIGSTOP)
                    stopped.append(p)
            assert len(stopped) == NPROC, "monitors not found"
            open(os.path.join(out, "stopped"), "w").close()
        job.proc.wait(timeout=180)
        rows = []
        for r in range(NPROC):
            with open(os.path.join(out, f"rank_{r}.jsonl")) as fh:
                rows += [json.loads(line) for line in fh]
        return rows
    finally:
        for p in stopped:
            try:
                p.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass
        job.stop()


def main() -> None:
    rows = [dict(r, launcher="ft_launcher") for r in run("ft_launcher", stop_monitors=True)]
    rows += [dict(r, launcher="torchrun", phase="no-op (no monitor)") for r in run("torchrun", stop_monitors=False)]
    print(f"{'launcher':12s} {'phase':20s} {'section pair':>13s} {'by name':>9s} {'heartbeat':>10s} {'empty loop':>11s}")
    for r in rows:
        print(f"{r['launcher']:12s} {r['phase']:20s} {r['section_pair_ns'] / 1000:10.3f} us {r['section_by_name_pair_ns'] / 1000:6.3f} us"
              f" {r['heartbeat_ns'] / 1000:7.3f} us {r['loop_ns'] / 1000:8.3f} us")
    ours = [r for r in rows if r["launcher"] == "ft_launcher"]
    worst = max(r["section_pair_ns"] for r in ours) / 1000
    hb = max(r["heartbeat_ns"] for r in ours) / 1000
    print(f"\nworst rank, ft_launcher: section pair {worst:.3f} us (goal <= 3), heartbeat {hb:.3f} us (goal <= 2); "
          f"NVRx reference on this machine: ~90-480 us per pair, i.e. {90 / worst:.0f}x-{480 / worst:.0f}x")


if __name__ == "__main__":
    main()
