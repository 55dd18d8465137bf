"""Rendezvous at scale: N agents on this machine, one rank each running bench/sleeper_rank.py (no
torch in the rank, so only the launchers' protocols are measured), for ft_launcher and for
torch's c10d rendezvous (`torch.distributed.run`, through bench/torchrun_counted.py) in the same run.

    python bench/rendezvous_scale.py [--sizes 2,8,32] [--hold 3]

The first agent starts alone and hosts the store; the others start once it listens, together for
N <= 8 and --stagger s apart above (as the measurements in docs/store-and-scale.md were taken).

Per launcher and N it reports:
  start->ranks    the last agent's start -> every rank process started (both launchers;
                  includes the last agent's own start-up: its torch import)
  join->known     ft_launcher only: the last agent's join (its `add` to r0/joined) -> every
                  agent has read the closed round, i.e. knows its ranks
  ops/agent       store calls per agent in the round, by the round protocol (ours: the main
                  connection; torch: every TCPStore/PrefixStore call of the agent), mean and max,
                  with the payload bytes (keys and values, both ways)
  keep-alive      ours: calls per agent per second on the watcher connection (the round's
                  bell wait, store pings; node liveness is TCP, not the store)
  start-up        ours: the last agent's start-up by phase (python and imports, orphan
                  watchdog, monitors, reserves, rendezvous imports, store connection, monitors
                  ready, health checks, join, round known, ranks started), from marks the agent
                  keeps with FT_LAUNCHER_STORE_STATS
The calls are counted inside the agents: ours with FT_LAUNCHER_STORE_STATS (agent/rounds.rendezvous.py),
torch's by wrapping its store classes in bench/torchrun_counted.py.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLEEPER = os.path.join(ROOT, "bench", "sleeper_rank.py")
TORCHRUN = os.path.join(ROOT, "bench", "torchrun_counted.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, first: subprocess.Popen, limit: float) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and first.poll() is None:
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)


def run_agents(kind: str, n: int, hold: float, limit: float, stagger: float = 0.0) -> dict:
    work = tempfile.mkdtemp(prefix=f"rdzv_scale_{kind}_{n}_")
    out, stats, logs = (os.path.join(work, d) for d in ("ranks", "stats", "logs"))
    for d in (out, stats, logs):
        os.makedirs(d)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if kind == "ft_launcher":
        cmd = [sys.executable, "-m", "ft_launcher", "--nnodes", str(n), "--nproc-per-node", "1",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"scale{port}", "--max-restarts", "0",
               "--rdzv-conf", "join_timeout=600,last_call_timeout=30", "--ft-warm-reserves", "0"]
        env["FT_LAUNCHER_STORE_STATS"] = stats
    else:
        cmd = [sys.executable, TORCHRUN, "--nnodes", str(n), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"scale{port}", "--max-restarts", "0",
               "--rdzv-conf", "join_timeout=600,last_call_timeout=30"]
        env["FT_BENCH_TORCH_STORE_STATS"] = stats
    cmd += [SLEEPER, out, str(hold)]
    procs, starts = [], []
    try:
        for i in range(n):
            if i == 1:  # the first agent hosts the store: the others start once it listens
                _wait_listening(port, procs[0], limit)
            elif i > 1 and stagger:
                time.sleep(stagger)
            agent_env = dict(env, GROUP_RANK=str(i)) if kind == "ft_launcher" else env
            with open(os.path.join(logs, f"agent_{i}.log"), "w") as log:
                starts.append(time.time())
                procs.append(subprocess.Popen(cmd, env=agent_env, cwd=work, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        deadline = time.monotonic() + limit
        for proc in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        codes = [p.poll() for p in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
    result = {"kind": kind, "n": n, "codes_ok": sum(1 for c in codes if c == 0), "dir": work}
    spawned = {p.pid: t for p, t in zip(procs, starts)}
    rank_starts = []
    for path in glob.glob(os.path.join(out, "rank_*")):
        with open(path) as fh:
            rank_starts.append(float(fh.read().split()[1]))
    if len(rank_starts) == n:
        result["start_to_ranks"] = max(rank_starts) - max(starts)
    records = []
    for path in glob.glob(os.path.join(stats, "*.json")):
        with open(path) as fh:
            record = json.load(fh)
        record["spawned"] = spawned.get(int(os.path.basename(path).split(".")[0]))
        records.append(record)
    result["agents_counted"] = len(records)

    def totals(label):
        calls = [sum(v[0] for v in r["calls"].get(label, {}).values()) for r in records]
        nbytes = [sum(v[1] for v in r["calls"].get(label, {}).values()) for r in records]
        return calls, nbytes
    label = "main" if kind == "ft_launcher" else "all"
    calls, nbytes = totals(label)
    if calls:
        result.update(ops_mean=statistics.mean(calls), ops_max=max(calls), bytes_mean=statistics.mean(nbytes),
                      bytes_max=max(nbytes))
        by_method = {}
        for r in records:
            for method, (count, _) in r["calls"].get(label, {}).items():
                by_method[method] = by_method.get(method, 0) + count
        result["by_method"] = {m: round(c / len(records), 1) for m, c in sorted(by_method.items())}
    if kind == "ft_launcher" and records:
        result["startup"] = startup(records)
        joined = [r["marks"].get("joined_at") for r in records]
        known = [r["marks"].get("round_known_at") for r in records]
        if all(joined) and all(known):
            result["join_to_known"] = max(known) - max(joined)
        rates = []
        for r in records:
            watcher = sum(v[0] for v in r["calls"].get("watcher", {}).values())
            span = r["marks"].get("exit_at", 0) - r["marks"].get("joined_at", 0)
            if span > 0:
                rates.append(watcher / span)
        if rates:
            result["keepalive_per_s"] = statistics.mean(rates)
        wbytes = [sum(v[1] for v in r["calls"].get("watcher", {}).values()) /
                  max(1e-9, r["marks"].get("exit_at", 0) - r["marks"].get("joined_at", 0)) for r in records]
        result["keepalive_bytes_per_s"] = statistics.mean(wbytes)
    return result


PHASES = ("agent_start", "watchdog", "monitors_started", "reserves", "imports", "store", "monitors_ready",
          "health_checks", "joined_at", "round_known_at", "ranks_started")


def startup(records: list) -> dict:
    """The last-spawned agent's start-up by phase (seconds from the previous mark; the first from
    its spawn), and each phase's mean over the agents."""
    def phases(r):
        marks, prev, out = r["marks"], r.get("spawned"), {}
        if prev is None:
            return None
        for name in PHASES:
            if name in marks:
                out[name] = marks[name] - prev
                prev = marks[name]
        return out
    rows = [(r["spawned"], phases(r)) for r in records if r.get("spawned")]
    rows = [(t, p) for t, p in rows if p]
    if not rows:
        return {}
    last = max(rows)[1]
    mean = {name: statistics.mean(p[name] for _, p in rows if name in p) for name in PHASES
            if any(name in p for _, p in rows)}
    return {"last": {k: round(v, 2) for k, v in last.items()}, "mean": {k: round(v, 2) for k, v in mean.items()}}


def line(r: dict) -> str:
    def f(key, fmt="{:.2f}s"):
        return fmt.format(r[key]) if key in r else "n/a"
    text = (f"{r['kind']:11s} N={r['n']:3d}  ok {r['codes_ok']}/{r['n']}  start->ranks {f('start_to_ranks')}"
            f"  join->known {f('join_to_known')}  ops/agent {f('ops_mean', '{:.1f}')} (max {f('ops_max', '{:.0f}')})"
            f"  bytes/agent {f('bytes_mean', '{:.0f}')} (max {f('bytes_max', '{:.0f}')})")
    if "keepalive_per_s" in r:
        text += f"  keep-alive {r['keepalive_per_s']:.1f} calls/s, {r['keepalive_bytes_per_s']:.0f} B/s per agent"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,8,32")
    parser.add_argument("--hold", type=float, default=3.0, help="seconds each rank sleeps")
    parser.add_argument("--limit", type=float, default=400.0, help="seconds one launcher's run may take")
    parser.add_argument("--keep", action="store_true", help="keep the scratch dirs")
    parser.add_argument("--stagger", type=float, default=1.0, help="seconds between agent starts when N > 8")
    args = parser.parse_args()
    for n in [int(x) for x in args.sizes.split(",")]:
        for kind in ("ft_launcher", "torchrun"):
            result = run_agents(kind, n, args.hold, args.limit, args.stagger if n > 8 else 0.0)
            print(line(result), flush=True)
            print("    calls per agent by method:", json.dumps(result.get("by_method", {})), flush=True)
            if result.get("startup"):
                print("    start-up of the last agent by phase (s):", json.dumps(result["startup"]["last"]), flush=True)
                print("    start-up, mean over agents (s):", json.dumps(result["startup"]["mean"]), flush=True)
            if not args.keep:
                shutil.rmtree(result["dir"], ignore_errors=True)


if __name__ == "__main__":
    main()
