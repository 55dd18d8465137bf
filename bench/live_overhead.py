"""What a LiveState costs in memory and copies per commit, per state form, in one run.

    python bench/live_overhead.py [--width 1024] [--layers 8] [--steps 8] [--buddy] [--json out.json]
    python bench/live_overhead.py --dry-run      # a tiny model, seconds

Real jobs under ft_launcher (1 agent x 2 gloo ranks; bench/live_overhead_rank.py, ft.restartable in
every case), one MLP with AdamW, fault-free:
  ddp        DDP, `ft.LiveState(model=model, optimizer=opt)`, against the same job without it
  app        FSDP2 (`fully_shard` over both ranks) through PyTorch's DCP recipe,
             `ft.LiveState(app=AppState(model, opt))`, against the same job without it
  app+buddy  (--buddy) the app job with `buddy_every=1` (buddy_keep=2: 2 own copies + 2 of its buddy's)
  app+buddy1 (--buddy) the same with `buddy_keep=1` (1 + 1)
  titan      (--titan) torchtitan 0.3.0's own trainer (tests/third_party/torchtitan/cpu_train.py: its
             llama3 debugmodel, FSDP over 2 gloo ranks, or HSDP 2 x 2 over 4 with --titan-hsdp) with
             ft_launcher's adapter's LiveState (no buddy copies), against the same job without it
Per contender and rank: the bytes the last commit copied (`live.stats["commit_bytes"]`; with --titan also
by object, `commit_bytes_by`), the bytes
the first read in place (`in_place_bytes`: parameters and optimizer state), the rank's own state
(parameters and AdamW state, its shard under FSDP), and its peak RSS (VmHWM), with the ratio to the
job without the LiveState and the difference in units of the rank's state; with buddy copies, the
slot files the rank maps (its own copies and its source's, `buddy_stats()["held_bytes"]`) in units
of its state (peak RSS differs by up to ~0.9 of a 200 MB state between two ranks of one job here,
so the slot bytes are the exact figure).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_jobs import Job  # noqa: E402

RANK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "live_overhead_rank.py")


def run(form: str, live: bool, buddy: int, args, keep: int = 2) -> list:
    job = Job("ft_launcher", 2, ["--max-restarts", "0"],
              ["--form", form, "--live", str(int(live)), "--buddy-every", str(buddy), "--buddy-keep", str(keep),
               "--width", str(args.width),
               "--layers", str(args.layers), "--steps", str(args.steps), "--out", "out"], script=RANK)
    try:
        job.proc.wait(timeout=args.timeout)
    except BaseException:
        job.stop(keep_dir=True)
        raise
    out = os.path.join(job.dir, "out")
    if job.proc.returncode != 0 or not os.path.isdir(out):
        job.stop(keep_dir=True)
        raise SystemExit(f"{form} live={live}: exit {job.proc.returncode}; see {job.log.name}")
    ranks = [json.load(open(os.path.join(out, f))) for f in sorted(os.listdir(out))]
    job.stop()
    return ranks


TITAN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "third_party", "torchtitan")


def run_titan(live: bool, args, assets: str) -> list:
    """torchtitan's trainer (cpu_train.py) under ft_launcher, fault-free; per rank the figures it
    writes (stats_rank<r>.json: peak RSS, its state's bytes, the LiveState's stats)."""
    import shutil
    import subprocess
    import tempfile

    from bench_jobs import bench_env, launcher_cmd

    nproc = 4 if args.titan_hsdp else 2
    hsdp = (["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]
            if args.titan_hsdp else [])
    work = tempfile.mkdtemp(prefix="ftbench_titan_")
    out = os.path.join(work, "out")
    os.makedirs(out)
    env = bench_env(TITAN_ASSETS=assets, TITAN_OUT=out, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
                    HF_DATASETS_CACHE=os.path.join(work, "hf_cache"), TITAN_LIVE=str(int(live)), TITAN_BUDDY_EVERY="0")
    env["PYTHONPATH"] = TITAN + os.pathsep + env["PYTHONPATH"]
    cmd = launcher_cmd("ft_launcher", nproc, ["--max-restarts", "0"]) + [
        os.path.join(TITAN, "cpu_train.py"), "--module", "titan_cpu_config", "--config", "cpu_debugmodel",
        "--dump_folder", os.path.join(work, "dump"), "--training.steps", str(args.steps),
        "--checkpoint.interval", "1000"] + hsdp
    with open(os.path.join(work, "launcher.log"), "w") as log:
        proc = subprocess.run(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout)
    names = sorted(f for f in os.listdir(out) if f.startswith("stats_rank"))
    if proc.returncode != 0 or len(names) != nproc:
        raise SystemExit(f"torchtitan live={live}: exit {proc.returncode}; see {work}/launcher.log")
    ranks = [json.load(open(os.path.join(out, f))) for f in names]
    for r in ranks:
        stats = r.get("live") or {}
        r.update(commit_bytes=stats.get("commit_bytes", 0), in_place_bytes=stats.get("in_place_bytes", 0),
                 record_bytes=stats.get("record_bytes", 0))
    shutil.rmtree(work, ignore_errors=True)
    return ranks


def titan_main(args) -> None:
    import tempfile

    sys.path.insert(0, TITAN)
    from titan_assets import write_assets

    assets = tempfile.mkdtemp(prefix="live_overhead_titan_")
    write_assets(assets)
    t0 = time.time()
    results = {live: run_titan(live, args, assets) for live in (False, True)}
    shape = "HSDP 2 x 2 (4 ranks)" if args.titan_hsdp else "FSDP (2 ranks)"
    print(f"live_overhead: torchtitan 0.3.0 llama3 debugmodel, {shape}, gloo, {args.steps} steps, "
          f"{time.time() - t0:.0f} s")
    print(f"{'form':10} {'LiveState':10} {'state MB/rank':>14} {'commit bytes':>13} {'record bytes':>13} "
          f"{'in place MB':>12} {'peak RSS MiB per rank':>30} {'vs without':>11}")
    rows = []
    for live, ranks in results.items():
        base = results[False]
        ratio = max(r["peak_rss_kb"] / b["peak_rss_kb"] for r, b in zip(ranks, base))
        rss = ", ".join(mib(r["peak_rss_kb"]) for r in ranks)
        print(f"{'titan':10} {'on' if live else 'off':10} {max(r['state_bytes'] for r in ranks) / 1e6:14.1f} "
              f"{max(r['commit_bytes'] for r in ranks) if live else '-':>13} "
              f"{max(r['record_bytes'] for r in ranks) if live else '-':>13} "
              f"{(max(r['in_place_bytes'] for r in ranks) / 1e6 if live else float('nan')):12.1f} "
              f"{rss:>30} {ratio:10.3f}x")
        rows.append({"form": "titan", "live": live, "ranks": ranks, "rss_ratio": ratio})
    by = {}
    for r in results[True]:
        for name, n in ((r.get("live") or {}).get("commit_bytes_by") or {}).items():
            by[name] = max(by.get(name, 0), n)
    print("a commit copies, by object (bytes, the largest rank's): "
          + ", ".join(f"{name} {n:,}" for name, n in sorted(by.items(), key=lambda kv: -kv[1])))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


def mib(kb: int) -> str:
    return f"{kb / 1024:,.0f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--buddy", action="store_true", help="also the app job with buddy_every=1, buddy_keep 2 and 1")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", default=None, help="write every rank's figures here")
    p.add_argument("--dry-run", action="store_true", help="a tiny model: the bench's own check")
    p.add_argument("--titan", action="store_true", help="torchtitan's trainer instead (needs torchtitan 0.3.0)")
    p.add_argument("--titan-hsdp", action="store_true", help="with --titan: HSDP 2 x 2 over 4 ranks")
    args = p.parse_args()
    if args.titan:
        return titan_main(args)
    if args.dry_run:
        args.width, args.layers, args.steps = 64, 2, 3
    cases = [("ddp", False, 0, 2), ("ddp", True, 0, 2), ("app", False, 0, 2), ("app", True, 0, 2)]
    if args.buddy:
        cases += [("app", True, 1, 2), ("app", True, 1, 1)]
    t0 = time.time()
    results = {}
    for form, live, buddy, keep in cases:
        results[(form, live, buddy, keep)] = run(form, live, buddy, args, keep)
    print(f"live_overhead: MLP {args.layers} x {args.width}, AdamW, 2 gloo ranks, {args.steps} steps, "
          f"{time.time() - t0:.0f} s")
    print(f"{'form':10} {'LiveState':10} {'state MB/rank':>14} {'commit bytes':>13} {'in place MB':>12} "
          f"{'peak RSS MiB (r0, r1)':>22} {'vs without':>11} {'extra / state':>14} {'copies / state':>15} {'step ms':>8}")
    rows = []
    for (form, live, buddy, keep), ranks in results.items():
        base = results[(form, False, 0, 2)]
        ratio = max(r["peak_rss_kb"] / b["peak_rss_kb"] for r, b in zip(ranks, base))
        extra = max((r["peak_rss_kb"] - b["peak_rss_kb"]) * 1024 / r["state_bytes"] for r, b in zip(ranks, base))
        copies = max(r.get("buddy_held_bytes", 0) / r["state_bytes"] for r in ranks)   # slot files mapped
        name = form + ("" if not buddy else "+buddy" if keep == 2 else "+buddy1")
        what = "on" if live else "off"
        commit = "-" if not live else f"{max(r['commit_bytes'] for r in ranks):,}"
        in_place = "-" if not live else f"{max(r['in_place_bytes'] for r in ranks) / 1e6:.1f}"
        print(f"{name:10} {what:10} {max(r['state_bytes'] for r in ranks) / 1e6:14.1f} {commit:>13} {in_place:>12} "
              f"{mib(ranks[0]['peak_rss_kb']) + ', ' + mib(ranks[1]['peak_rss_kb']):>22} "
              f"{ratio:10.3f}x {extra:+13.2f}x {copies:14.2f}x {1e3 * max(r['step_s_median'] for r in ranks):8.1f}")
        rows.append({"form": name, "live": live, "ranks": ranks, "rss_ratio": ratio, "extra_in_states": extra})
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
