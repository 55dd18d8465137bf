"""torchtitan 0.3.0's own trainer, a rank killed mid-run: torchrun against ft_launcher, one run.

    python bench/torchtitan_recovery.py [--steps 22] [--fail-step 14] [--ckpt-every 10]

The job is tests/third_party/torchtitan/cpu_train.py (torchtitan.train.main: its llama3 debug
model, FSDP over 2 gloo ranks on this CPU, its dataloader, AdamW, LR schedule and DCP checkpoint
every --ckpt-every steps; README.md there says what a CPU needs). In this one run, in order:
  fault-free   torchrun, no fault: the parameters (SHA-256 of every gathered parameter) and loss
               every recovered run must end with
  torchrun     torchrun --max-restarts 1, rank 1 SIGKILLed as step --fail-step starts: torchrun
               restarts both ranks, torchtitan loads its last checkpoint
  torchrun unshared  (only with --ways) torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: its
               restarted workers get a fresh store instead of the rendezvous' (their gloo meshes
               otherwise read the dead incarnation's addresses)
  ft ckpt      ft_launcher (--ft-warm-reserves 0), the same fault: both ranks restart, the checkpoint
  ft live      ft_launcher, the same fault, with ft_launcher's adapter's LiveState over torchtitan's
               checkpointer states and buddy_every=1 (pure FSDP has no replica): the healthy rank
               restarts in place and keeps its state, the killed one loads its host copy
With --ways, also HSDP 2x2 (4 ranks: 2 replicas x 2 shards; on 2 cores a step takes about twice
as long): `hsdp fault-free` (ft_launcher, the HSDP reference) and `hsdp ft live` (rank 3 killed,
LiveState without buddy copies: a replica heal, its model and optimizer from rank 1, its
dataloader position from its own host-memory record: the adapter's `per_rank`) and `hsdp ft live
buddy` (with `buddy_every=1`: rank 3 loads its host copy).
Per way: recovered (exit 0 at the last step), the first step trained after the fault, completed
steps trained again, fault -> every rank
stepping (from the killed rank's last step start to the last rank's first step start after it),
and whether the final parameters and loss equal the fault-free run's. The figures go to stdout as
a table and, with --json FILE, as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TITAN = os.path.join(ROOT, "tests", "third_party", "torchtitan")
sys.path.insert(0, TITAN)


def run(way: str, out: str, assets: str, args, fault: bool, live: bool = False) -> dict:
    os.makedirs(out)
    hsdp = way.startswith("hsdp")
    nproc, fail_rank = (4, 3) if hsdp else (2, 1)
    env = dict(os.environ, TITAN_ASSETS=assets, TITAN_OUT=out, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               HF_DATASETS_CACHE=os.path.join(out, "hf_cache"),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if fault:
        env.update(TITAN_FAIL_STEP=str(args.fail_step), TITAN_FAIL_RANK=str(fail_rank))
    if live:
        env.update(TITAN_LIVE="1", TITAN_BUDDY_EVERY="0" if hsdp and not way.endswith("buddy") else "1")
    if way == "torchrun unshared":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    titan = [os.path.join(TITAN, "cpu_train.py"), "--module", "titan_cpu_config", "--config", "cpu_debugmodel",
             "--dump_folder", os.path.join(out, "dump"), "--training.steps", str(args.steps),
             "--checkpoint.interval", str(args.ckpt_every)] + (
        ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]
        if hsdp else [])
    if way.startswith("torchrun") or way == "fault-free":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "--max-restarts", "1"] + titan
    else:
        cmd = [sys.executable, "-m", "ft_launcher", "--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "1",
               "--ft-warm-reserves", "0", "--log-dir", os.path.join(out, "logs")] + titan
    start = time.time()
    with open(os.path.join(out, "console.txt"), "w") as console:
        try:
            rc = subprocess.run(cmd, env=env, stdout=console, stderr=subprocess.STDOUT, timeout=args.timeout,
                                start_new_session=True).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    result = {"way": way, "rc": rc, "wall_s": round(time.time() - start, 1)}
    starts, results = {}, {}
    for rank in range(nproc):
        path = os.path.join(out, f"steps_rank{rank}.jsonl")
        starts[rank] = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
        path = os.path.join(out, f"result_rank{rank}.json")
        results[rank] = json.load(open(path)) if os.path.exists(path) else None
    final = results[0] if all(results[r] == results[0] for r in range(nproc)) else None
    result["final"] = final
    result["recovered"] = rc == 0 and final is not None and final["step"] == args.steps
    if fault:
        killed = [s for s in starts[fail_rank] if s["step"] == args.fail_step]
        after = []
        for rank in range(nproc):
            steps = [s["step"] for s in starts[rank]]
            i = steps.index(args.fail_step) if args.fail_step in steps else None
            after.append(starts[rank][i + 1] if i is not None and i + 1 < len(starts[rank]) else None)
        if killed and all(after):
            result["resumed_at"] = after[0]["step"]
            result["steps_redone"] = args.fail_step - after[0]["step"]
            result["fault_to_stepping_s"] = round(max(a["t"] for a in after) - killed[0]["t"], 2)
        lines = open(os.path.join(out, "console.txt"), errors="replace").read().splitlines()
        live_lines = [line.strip() for line in lines if "live recovery" in line or "no live state" in line]
        result["live_line"] = live_lines[0][:300] if live_lines else None
        if not result["recovered"]:   # why: the last error the console shows
            errors = [line.strip() for line in lines if "Error" in line or "error:" in line]
            result["error"] = errors[-1][:300] if errors else None
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=22)
    parser.add_argument("--fail-step", type=int, default=14)
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--ways", default="fault-free,torchrun,ft ckpt,ft live")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from titan_assets import write_assets

    work = tempfile.mkdtemp(prefix="torchtitan_recovery_")
    try:
        assets = os.path.join(work, "assets")
        write_assets(assets)
        rows = []
        for i, way in enumerate(args.ways.split(",")):
            row = run(way, os.path.join(work, f"run{i}"), assets, args, fault="fault-free" not in way,
                      live="ft live" in way)
            rows.append(row)
            print(json.dumps(row), flush=True)
        reference = {kind: next((r["final"] for r in rows if r["way"] == f"{kind}fault-free".lstrip()), None)
                     for kind in ("", "hsdp ")}
        print(f"\n{'way':<18} {'recovered':<10} {'next step':<11} {'redone':<7} {'fault->stepping':<16} "
              f"{'final = fault-free':<19} wall")
        for r in rows:
            ref = reference["hsdp " if r["way"].startswith("hsdp") else ""]
            exact = "-" if "fault-free" in r["way"] or ref is None else ("yes" if r["final"] == ref else "NO")
            print(f"{r['way']:<18} {str(r['recovered']):<10} {str(r.get('resumed_at', '-')):<11} "
                  f"{str(r.get('steps_redone', '-')):<7} {str(r.get('fault_to_stepping_s', '-')) + ' s':<16} "
                  f"{exact:<19} {r['wall_s']} s")
            for key in ("live_line", "error"):
                if r.get(key):
                    print(f"    {r[key]}")
        for kind, ref in reference.items():
            if ref:
                print(f"{kind}fault-free: step {ref['step']}, loss {ref['loss']}, sha256 {ref['checksum'][:16]}")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(rows, fh, indent=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
