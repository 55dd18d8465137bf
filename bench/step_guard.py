"""What the step guard costs (rank_monitor/rank_side/live/step_guard.py, docs/sdc-and-nan.md), in one
run on the CPU bench's job (bench/live_train.py: an MLP of 3.9 M parameters, AdamW, 2 DDP ranks on
gloo under ft_launcher with ft.LiveState, a checkpoint every 50 steps):

1. the guard's per-step cost: `live.commit(step, loss=loss)` (the guard takes the gradients' norm
   itself) and `grad_norm=` given (the loop's clip_grad_norm_ value), guarding every 2nd step of
   one job: the median guarded step beside the median plain step of the same job, and the time
   LiveState measures inside the guard (`stats["guard_s"]`, which includes waiting in its
   all_reduce for the slower rank: time the next DDP all-reduce would otherwise wait);
2. fault -> stepping again for a transient NaN (the simulated fault rank_sdc, nan at STEP, once):
   what the guard's line says the re-run from memory took (from the hit to the re-run's verdict),
   and the gap between steps STEP-1 and STEP in rank 0's progress minus a median step;
3. Megatron's path on the same job, from our own checkpoint restart: the checkpoint save (the
   extra time of rank 0's checkpoint steps over a median step) plus fault -> stepping again after
   a rank is killed at STEP without LiveState (every rank restarts in place and loads the checkpoint).

    python bench/step_guard.py                      # about 2 minutes on 2 cores
    python bench/step_guard.py --steps 40 --fault 30 --width 256    # a short look
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "bench", "live_train.py")


def run(tmp: str, name: str, job_args: list, ft_args: list = ()) -> dict:
    """One ft_launcher job (1 agent x 2 ranks); -> its progress rows, final.json, events."""
    root = os.path.join(tmp, name)
    cmd = [sys.executable, "-m", "ft_launcher", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
           "--log-dir", os.path.join(root, "logs"), *ft_args, JOB, "--mode", "ddp",
           "--ckpt-dir", os.path.join(root, "ckpt"), "--progress-dir", os.path.join(root, "progress"), *job_args]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}")
    rows = []
    with open(os.path.join(root, "progress", "rank_0.txt")) as fh:
        for line in fh:
            c, s, t = line.split()
            rows.append((int(c), int(s), float(t)))
    events = []
    with open(os.path.join(root, "logs", "events.jsonl")) as fh:
        events = [json.loads(line) for line in fh]
    fault = None
    path = os.path.join(root, "progress", "fault.txt")
    if os.path.exists(path):
        with open(path) as fh:
            fault = float(fh.read().split()[0])
    with open(os.path.join(root, "ckpt", "final.json")) as fh:
        final = json.load(fh)
    return {"rows": rows, "final": final, "events": events, "fault": fault}


def step_times(rows, ckpt_every: int, skip=()) -> list:
    """Gaps between consecutive steps of one cycle, except after a checkpoint step and around `skip`."""
    out = []
    for (c0, s0, t0), (c1, s1, t1) in zip(rows, rows[1:]):
        if c0 == c1 and s1 == s0 + 1 and s0 % ckpt_every and s1 not in skip and s0 > 2:
            out.append(t1 - t0)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--fault", type=int, default=70, help="the step of the transient NaN and of the kill")
    p.add_argument("--width", type=int, default=1280)
    args = p.parse_args(argv)
    ck = 50
    base = ["--live", "--steps", str(args.steps), "--width", str(args.width), "--ckpt-every", str(ck)]
    sdc = ["--ft-simulate-fault", "true", "--ft-simulated-fault-type", "rank_sdc", "--ft-simulated-fault-rank", "1",
           "--ft-simulated-sdc", f"nan:{args.fault}:once"]
    with tempfile.TemporaryDirectory(prefix="step_guard_bench_") as tmp:
        off = run(tmp, "off", base)
        norm = run(tmp, "norm", base + ["--guard", "norm", "--guard-every", "2"])
        given = run(tmp, "given", base + ["--guard", "given", "--guard-every", "2"])
        transient = run(tmp, "transient", base + ["--guard", "norm"], sdc)
        ckpt = run(tmp, "ckpt_restart", ["--restartable", "--steps", str(args.steps), "--width", str(args.width),
                                         "--ckpt-every", str(ck), "--kill-at-step", str(args.fault)])
    step = statistics.median(step_times(off["rows"], ck))
    print(f"job: bench/live_train.py --width {args.width}, 2 DDP ranks on gloo, {args.steps} steps; "
          f"median step without the guard {step * 1e3:.1f} ms")
    print("| measure | value | per step | goal |")
    print("|---|---|---|---|")
    for name, r in (("guard, its own gradient norm", norm), ("guard, grad_norm= given", given)):
        g = r["final"]["guard_s"] / max(1, r["final"]["guarded"])
        rows = r["rows"]
        on = statistics.median(step_times(rows, ck, skip={s for _, s, _ in rows if s % 2}))
        plain = statistics.median(step_times(rows, ck, skip={s for _, s, _ in rows if s % 2 == 0}))
        print(f"| {name}: guarded vs plain steps of one job (every 2nd step guarded) | {on * 1e3:.1f} vs "
              f"{plain * 1e3:.1f} ms | {100 * (on / plain - 1):+.2f} % | <= 1 % |")
        print(f"| {name}: time inside the guard (LiveState's timer; it includes waiting in its all_reduce for "
              f"the slower rank) | {g * 1e3:.2f} ms | {100 * g / plain:.2f} % | |")
    lines = [e["detail"]["decision"] for e in transient["events"] if e["kind"] == "step_guard"]
    took = next((float(m.group(1)) for line in lines for m in [re.search(r"took ([0-9.]+) s", line)] if m), None)
    rows = transient["rows"]
    t = {s: ts for c, s, ts in rows}
    gap = t[args.fault] - t[args.fault - 1] - step
    print(f"| transient NaN at step {args.fault}: the re-run from memory (the guard's line) | {took:.3f} s | "
          f"{took / step:.1f} steps | <= 2 steps |")
    print(f"| transient NaN: step {args.fault - 1} -> {args.fault} committed, less a step | {gap:.3f} s | "
          f"{gap / step:.1f} steps | |")
    save = statistics.median([t1 - t0 - step for (c0, s0, t0), (c1, s1, t1) in zip(ckpt["rows"], ckpt["rows"][1:])
                              if s0 % ck == 0 and s1 == s0 + 1 and c0 == c1 == 0])
    after = min(ts for c, s, ts in ckpt["rows"] if c == 1)
    restart = after - ckpt["fault"]
    redone = args.fault - 1 - (args.fault - 1) // ck * ck
    print(f"| Megatron's path: checkpoint save (rank 0's extra time at a checkpoint step) | {save:.3f} s | "
          f"{save / step:.1f} steps | |")
    print(f"| Megatron's path: kill at step {args.fault} -> first step after the checkpoint restart (ours, in "
          f"place) | {restart:.3f} s | {restart / step:.1f} steps (+ {redone} steps redone) | |")
    print(f"| Megatron's path, save + restart (+ the steps since the last checkpoint, here 0: it saves at the "
          f"hit) | {save + restart:.3f} s | {(save + restart) / step:.1f} steps | |")
    print("transient run's guard lines:\n  " + "\n  ".join(lines))
    same = transient["final"]["checksum"] == norm["final"]["checksum"]
    print(f"transient run's final checksum {'equals' if same else 'DIFFERS from'} the fault-free guarded run's")


if __name__ == "__main__":
    main()
