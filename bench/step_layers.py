"""The steady step split by layer, in one run, at two sizes (issue 46): what each layer of ft_launcher
adds to a training step over torchrun, once the warm reserves are ready.

    python bench/step_layers.py                          # CPU: 2 gloo ranks, about 6 minutes on 2 cores
    python bench/step_layers.py --device cuda            # one GPU: 1 NCCL rank
    python bench/step_layers.py --widths 128 --steps 60 --reps 1   # a short look

The job: bench/live_train.py (an MLP, AdamW, LambdaLR, DDP), no checkpoint inside the window. Layers,
each the one above plus one thing, jobs alternated `--reps` times (a drift of the machine's speed
hits every layer alike):
  torchrun              `python -m torch.distributed.run`; every ft call in the script is a no-op
  ft_launcher, no reserves   our agent, the rank monitors, sections and heartbeats, --ft-warm-reserves 0
  ft_launcher           the same with its default warm reserves (each rank's spare interpreter)
  + LiveState           ft.LiveState(model=, optimizer=, scheduler=) and live.commit(step) each step
  + guard (loss= alone) live.commit(step, loss=loss): the step guard (its own norm pass over the
                        gradients), the replicas' fingerprint every K steps (K from its 1 % budget)
  + LiveState, the loop clips  the LiveState job whose loop takes clip_grad_norm_ (no guard)
  + guard (grad_norm=)  that loop with live.commit(step, loss=, grad_norm=clip_grad_norm_(...)):
                        against the loop that clips, so the row is the guard's own cost
  + buddy copies every 10    (2+ ranks) LiveState(buddy_every=10)
The step: on the CPU the median gap between rank 0's consecutive steps that began after every warm
reserve was ready (torchrun: after step 5); on a GPU the mean step of a window the device is
synchronized at both ends (from the middle step to the last: per-step stamps only show the host
running ahead). Per layer: the step, its ratio to torchrun, its cost per step over the layer above
(us and %), and, with LiveState, the bytes the last commit copied; peak RSS of rank 0 (and on a GPU
the peak of allocated device memory) beside torchrun's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_jobs import Job, reserves_ready  # noqa: E402

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "live_train.py")

NO_RESERVES = ["--ft-warm-reserves", "0"]
LAYERS = [   # (name, launcher, launcher flags, job flags, ranks needed, the layer it adds to)
    ("torchrun", "torchrun", [], [], 1, None),
    ("ft_launcher, no reserves", "ft_launcher", NO_RESERVES, [], 1, "torchrun"),
    ("ft_launcher", "ft_launcher", [], [], 1, "ft_launcher, no reserves"),
    # the layers above the launcher run without reserves: on 2 cores a reserve warming at the lowest
    # priority is still warming when a short job ends, and would blur every layer's own cost
    ("+ LiveState", "ft_launcher", NO_RESERVES, ["--live"], 1, "ft_launcher, no reserves"),
    ("+ guard (loss= alone)", "ft_launcher", NO_RESERVES, ["--live", "--guard", "norm"], 1, "+ LiveState"),
    # grad_norm= is the value of the loop's own clip_grad_norm_: the clip is the loop's cost, not the guard's
    ("+ LiveState, the loop clips", "ft_launcher", NO_RESERVES, ["--live", "--clip"], 1, "+ LiveState"),
    ("+ guard (grad_norm=)", "ft_launcher", NO_RESERVES, ["--live", "--guard", "given"], 1,
     "+ LiveState, the loop clips"),
    ("+ buddy copies every 10", "ft_launcher", NO_RESERVES, ["--live", "--buddy-every", "10"], 2, "+ LiveState"),
]


def launch(kind: str, nproc: int, flags: list, job_args: list) -> Job:
    if kind == "torchrun":   # the torch that runs the bench, not whichever torchrun is on PATH
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    else:
        cmd = [sys.executable, "-m", "ft_launcher", "--standalone", "--nproc-per-node", str(nproc),
               "--max-restarts", "0", *flags]
    return Job(kind, nproc, [], job_args, script=JOB, cmd=cmd)


def reserves_ready_at(job: Job, nproc: int, flags: list):
    """The wall time every warm reserve of the job had first said it was ready (0.0: it has none;
    None: one never was)."""
    if job.kind != "ft_launcher" or "--ft-warm-reserves" in flags:
        return 0.0
    ready = reserves_ready(job, nproc)
    return None if ready is None else max(r["time"] for r in ready.values())


def one(layer, args, width: int, batch: int, steps: int, nproc: int) -> dict:
    name, kind, flags, extra, _, _ = layer
    job_args = ["--mode", "ddp", "--steps", str(steps), "--width", str(width), "--batch", str(batch),
                "--ckpt-every", str(steps + 1), "--device", args.device,
                "--time-from", str(steps // 2), *extra]
    if kind == "ft_launcher":
        flags = [*flags, "--log-dir", "logs"]
    job = launch(kind, nproc, flags, job_args)
    try:
        code = job.proc.wait(timeout=args.timeout)
        if code != 0:
            with open(job.log.name) as fh:
                raise SystemExit(f"{name} (width {width}): exit {code}\n{fh.read()[-3000:]}")
        with open(os.path.join(job.dir, "ckpt", "final.json")) as fh:
            final = json.load(fh)
        ready = reserves_ready_at(job, nproc, flags)
        rows = job.progress()[0]
    finally:
        job.stop()
    gaps = [(t0, t1 - t0) for (c0, s0, t0), (c1, s1, t1) in zip(rows, rows[1:]) if c0 == c1 and s1 == s0 + 1 and s0 > 5]
    after = [g for t, g in gaps if ready is not None and t > ready]
    warming = [g for t, g in gaps if ready is None or t <= ready]
    if args.device == "cuda":
        step = final["steady_step_s"]
    else:   # after the reserves were ready, or, where one never was in the job, while they warmed
        step = statistics.median(after if len(after) >= 10 else warming)
    return {"step": step, "final": final, "warming": statistics.median(warming) if len(warming) >= 5 else None,
            "ready_step": None if ready is None else next((s for _, s, t in rows if t > ready), None),
            "reserves": "--ft-warm-reserves" not in flags and kind == "ft_launcher"}


def size(args, width: int, batch: int, steps_per_job: int, nproc: int) -> dict:
    layers = [layer for layer in LAYERS if nproc >= layer[4]]
    if args.layers:
        wanted = {"torchrun", *args.layers.split(",")}
        while True:   # with the layers each adds to
            more = wanted | {layer[5] for layer in layers if layer[0] in wanted and layer[5]}
            if more == wanted:
                break
            wanted = more
        layers = [layer for layer in layers if layer[0] in wanted]
    steps = {layer[0]: [] for layer in layers}
    finals = {}
    for rep in range(args.reps):
        for layer in layers:
            r = one(layer, args, width, batch, steps_per_job, nproc)
            steps[layer[0]].append(r["step"])
            finals[layer[0]] = r["final"]
            note = ""
            if r["reserves"] and r["ready_step"] is None:
                note = "  (the reserves were never ready: every step ran while they warmed)"
            elif r["reserves"]:
                warm = "" if r["warming"] is None else f"; the step while they warmed: {r['warming'] * 1e3:.3f} ms"
                note = f"  (reserves ready before step {r['ready_step']}{warm})"
            print(f"  width {width} rep {rep}: {layer[0]:26s} {r['step'] * 1e3:8.3f} ms{note}", flush=True)
    base = statistics.median(steps["torchrun"])
    mib = 1 << 20
    f0 = finals["torchrun"]
    print(f"\nwidth {width}, batch {batch}, {nproc} rank(s) on {args.device}"
          f"{' (' + f0['device_name'] + ')' if 'device_name' in f0 else ''}: "
          f"{f0['state_bytes'] / 1e6:.1f} MB of parameters and AdamW state per rank; torchrun's step "
          f"{base * 1e3:.3f} ms ({args.reps} jobs of {steps_per_job} steps per layer)")
    mem = "peak device memory" if args.device == "cuda" else "peak RSS"
    print(f"| layer | step | vs torchrun | over the layer it adds to | of a step | last commit copied | {mem} |")
    print("|---|---|---|---|---|---|---|")
    table = {}
    for name, *_, under in layers:
        m = statistics.median(steps[name])
        f = finals[name]
        below = None if under is None else statistics.median(steps[under])
        over = "-" if below is None else f"{(m - below) * 1e6:+.0f} us ({under})"
        share = "-" if below is None else f"{(m - below) / below * 100:+.2f} %"
        copied = f"{f['commit_bytes']:,} B" if "commit_bytes" in f else "-"
        peak = f.get("cuda_peak") if args.device == "cuda" else f.get("peak_rss")
        peak0 = f0.get("cuda_peak") if args.device == "cuda" else f0.get("peak_rss")
        memory = "-" if not peak else f"{peak / mib:,.0f} MiB ({peak / peak0:.3f}x)"
        print(f"| {name} | {m * 1e3:.3f} ms ({', '.join(f'{x * 1e3:.2f}' for x in steps[name])}) | "
              f"{m / base:.3f} | {over} | {share} | {copied} | {memory} |", flush=True)
        table[name] = {"step_s": m, "runs": steps[name], "final": f}
    return table


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--widths", default=None, help="the MLP's hidden widths, comma-separated (default: "
                                                    "cpu 256,2048; cuda 1024,8192)")
    p.add_argument("--batches", default=None, help="the batch per size (default: cpu 32,32; cuda 32,8192)")
    p.add_argument("--steps", default=None, help="steps per job, per size (default: cpu 2000,150: the window "
                                                  "opens once the reserves are ready; cuda 300,60)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--nproc", type=int, default=None, help="ranks (default: cpu 2, cuda 1: one GPU)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", default=None, help="write every layer's figures here")
    p.add_argument("--layers", default=None, help="only these layers (comma-separated names as in the table; "
                                                   "torchrun and each one's base are always run)")
    args = p.parse_args(argv)
    gpu = args.device == "cuda"
    widths = [int(w) for w in (args.widths or ("1024,8192" if gpu else "256,2048")).split(",")]
    batches = [int(b) for b in (args.batches or ("32,8192" if gpu else "32,32")).split(",")]
    if len(batches) < len(widths):
        batches += batches[-1:] * (len(widths) - len(batches))
    steps = [int(n) for n in (args.steps or ("300,60" if gpu else "2000,150")).split(",")]
    steps += steps[-1:] * (len(widths) - len(steps))
    nproc = args.nproc or (1 if gpu else 2)
    os.environ.setdefault("OMP_NUM_THREADS", "1")   # torchrun sets it for several ranks per node; ours alike
    out = {}
    for width, batch, n in zip(widths, batches, steps):
        out[f"{width}x{batch}"] = size(args, width, batch, n, nproc)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
