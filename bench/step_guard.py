"""What the step guard and the replica fingerprint cost, and how fast they find a fault
(rank_monitor/rank_side/live/step_guard.py, replica_fingerprint.py; docs/sdc-and-nan.md), in one run
on the CPU bench's job (bench/live_train.py: an MLP, AdamW, 2 DDP ranks on gloo under ft_launcher
with ft.LiveState, a checkpoint every 50 steps), at two sizes (`--widths`: a small step where fixed
costs show, and a step of >= 100 ms on this CPU):

1. the steady step, jobs alternated `--reps` times (median of each job's median step, the ratio to
   the LiveState job without the guard; `inside the guard`: LiveState's own timer per guarded step,
   which includes waiting in the table's all_reduce for the slower rank; `its own work + the
   collective's latency`: that timer less the time in the all_reduce, plus the all_reduce's fastest
   run, per guarded step, and its share of the median step: what the guard costs a step once no
   slower peer is counted):
   - `live`: LiveState, no guard (the baseline);
   - `loss=`: the guard takes the gradients' norm itself, the fingerprint's K from its 1 % budget;
   - `grad_norm=`: the loop's clip_grad_norm_ value given, K from the budget;
   - `grad_norm=, K=1`: the same with a digest of every replica's state at every step (the worst case);
   and the fingerprint's K each job agreed on and one digest's time;
2. detection: a finite flip (expflip) in rank 1's parameter after the optimizer step at STEP (no
   loss or norm shows it): the step at which the replicas' digests disagree, in steps after it;
3. a transient NaN in rank 1's backward at STEP: what the guard's line says the re-run from memory
   took, in steps.

    python bench/step_guard.py                                   # about 8 minutes on 2 cores
    python bench/step_guard.py --widths 256 --reps 1 --steps 40  # a short look
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
CK = 50


def run(tmp: str, name: str, job_args: list, ft_args: list = ()) -> dict:
    """One ft_launcher job (1 agent x 2 ranks); -> its progress rows, final.json, guard lines."""
    root = os.path.join(tmp, name)
    cmd = [sys.executable, "-m", "ft_launcher", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
           "--log-dir", os.path.join(root, "logs"), *ft_args, JOB, "--mode", "ddp", "--live",
           "--ckpt-every", str(CK), "--ckpt-dir", os.path.join(root, "ckpt"),
           "--progress-dir", os.path.join(root, "progress"), *job_args]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}")
    rows = []
    with open(os.path.join(root, "progress", "rank_0.txt")) as fh:
        for line in fh:
            c, s, t = line.split()
            rows.append((int(c), int(s), float(t)))
    with open(os.path.join(root, "logs", "events.jsonl")) as fh:
        events = [json.loads(line) for line in fh]
    with open(os.path.join(root, "ckpt", "final.json")) as fh:
        final = json.load(fh)
    lines = [e["detail"]["decision"] for e in events if e["kind"] == "step_guard"]
    return {"rows": rows, "final": final, "lines": lines}


def median_step(rows) -> float:
    """The median gap between consecutive steps of one cycle, checkpoint steps and the first ones left out."""
    gaps = [t1 - t0 for (c0, s0, t0), (c1, s1, t1) in zip(rows, rows[1:])
            if c0 == c1 and s1 == s0 + 1 and s0 % CK and s0 > 3]
    return statistics.median(gaps)


def steady(tmp: str, width: int, steps: int, reps: int) -> None:
    kinds = {"live": [], "loss=": ["--guard", "norm"], "grad_norm=": ["--guard", "given"],
             "grad_norm=, K=1": ["--guard", "given", "--fingerprint-every", "1"]}
    medians = {k: [] for k in kinds}
    finals = {}
    for rep in range(reps):   # alternated: a drift of the machine's speed hits every kind alike
        for kind, extra in kinds.items():
            r = run(tmp, f"w{width}_{kind.replace('=', '').replace(', ', '_')}_{rep}",
                    ["--steps", str(steps), "--width", str(width), *extra])
            medians[kind].append(median_step(r["rows"]))
            finals[kind] = r["final"]
    base = statistics.median(medians["live"])
    print(f"\nwidth {width}: {finals['live']['state_bytes'] / 1e6:.1f} MB of parameters and AdamW state per rank; "
          f"median step with LiveState, no guard: {base * 1e3:.2f} ms ({reps} jobs of {steps} steps per kind)")
    print("| kind | median step | vs no guard | per step | inside the guard | its own work + the collective's "
          "latency | of a step | K agreed | one digest |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kind in kinds:
        m = statistics.median(medians[kind])
        f = finals[kind]
        k = f.get("fingerprint_k") if kind != "live" else None
        cost = f"{f['fingerprint_s'] * 1e3:.3f} ms" if kind != "live" and f.get("fingerprint_s") else "-"
        inside = f"{f['guard_s'] / f['guarded'] * 1e3:.2f} ms" if f.get("guarded") else "-"
        own = share = "-"
        if f.get("guarded") and "reduce_s" in f:   # the time no slower peer explains: the guard's own work,
            # plus the all_reduce's fastest run (its latency); the rest of the wait is the peer's step
            per = (f["guard_s"] - f["reduce_s"]) / f["guarded"] + f["reduce_min"]
            own, share = f"{per * 1e3:.2f} ms", f"{per / m * 100:.2f} %"
        print(f"| {kind} | {m * 1e3:.2f} ms ({', '.join(f'{x * 1e3:.1f}' for x in medians[kind])}) | "
              f"{m / base:.3f} | {(m - base) * 1e6:+.0f} us | {inside} | {own} | {share} | "
              f"{k if k is not None else '-'} | {cost} |")


def faults(tmp: str, width: int, steps: int, fault: int) -> None:
    sdc = ["--ft-simulate-fault", "true", "--ft-simulated-fault-type", "rank_sdc", "--ft-simulated-fault-rank", "1",
           "--ft-simulated-sdc"]
    base = ["--steps", str(steps), "--width", str(width), "--guard", "given"]
    flip = run(tmp, f"w{width}_flip", base, sdc + [f"expflip:{fault}:once:memory"])
    found = next((int(m.group(1)) for line in flip["lines"] for m in [re.search(r"^step (\d+): the replicas'", line)]
                  if m), None)
    print(f"| width {width}: a finite flip in rank 1's parameter after step {fault}'s update (K = "
          f"{flip['final'].get('fingerprint_k')}) | found at step {found} | "
          f"{'-' if found is None else found - fault} steps after |")
    shown = flip["lines"]
    for how, extra in (("re-entering the training function", []), ("in place (commit's run=)", ["--rerun-in-place"])):
        nan = run(tmp, f"w{width}_nan{len(extra)}", base + extra, sdc + [f"nan:{fault}:once"])
        took = next((float(m.group(1)) for line in nan["lines"] for m in [re.search(r"took ([0-9.]+) s", line)] if m),
                    None)
        step = median_step(nan["rows"])
        print(f"| width {width}: a NaN in rank 1's backward at step {fault}, the re-run from memory {how} | "
              f"{'-' if took is None else f'{took:.3f} s'} | {'-' if took is None else f'{took / step:.1f}'} steps |")
        shown = shown + nan["lines"]
    for line in shown:
        print(f"  {line[:300]}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widths", default="256,1792", help="the MLP's hidden widths, comma-separated")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--fault", type=int, default=30, help="the step of the simulated faults")
    p.add_argument("--faults-only", action="store_true", help="only the detection and re-run rows")
    args = p.parse_args(argv)
    widths = [int(w) for w in args.widths.split(",")]
    print("bench/step_guard.py: 2 DDP ranks on gloo, one agent, this machine; jobs alternated")
    with tempfile.TemporaryDirectory(prefix="step_guard_bench_") as tmp:
        for width in widths:
            if not args.faults_only:
                steady(tmp, width, args.steps, args.reps)
        print("\n| fault | detection | |\n|---|---|---|")
        for width in widths:
            faults(tmp, width, args.steps, args.fault)


if __name__ == "__main__":
    main()
