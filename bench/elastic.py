"""Elastic mode against torchrun's `--nnodes 2:3` and TorchFT 0.2.0, same job, one run (issue 41).

    python bench/elastic.py [--steps 900] [--step-time 0.05] [--reps 2] [--steady-only]

The job: examples/live_train.py (DDP on gloo, torchdata's StatefulDataLoader, everything in one
ft.LiveState, a checkpoint every 50 steps), 3 nodes x 1 rank on this machine; for TorchFT the same
model, data, batch, optimizer and step sleep in bench/torchft_train.py, written as TorchFT's
train_ddp.py and README tell users to: `torchft_lighthouse --min_replicas 2 --quorum_tick_ms 100
--join_timeout_ms 10000` (its README's line, its default 5 s heartbeat timeout), 3 replica groups
of one rank, each its own `torchrun --standalone` with REPLICA_GROUP_ID, its Manager with
`min_replica_size=2` on ProcessGroupGloo, torchft's DDP and Optimizer wrappers, torchft's
DistributedSampler. Each launcher:
1. steady: the step time without faults, against plain DDP (the same script on the same 3 nodes
   under torchrun --nnodes 3, where every ft call is a no-op): the median time between rank 0's
   (replica group 0's) consecutive steps, steps 50 to the end, no --step-time; every rank with
   OMP_NUM_THREADS=1 (3 nodes share this machine's 2 cores; torchrun sets it only for several
   ranks per node); TorchFT pays a quorum and a should_commit round trip every step;
2. lost: the third node's launcher and its rank (TorchFT: group 2's torchrun and its rank)
   SIGKILLed for good when rank 2 has completed step 136 (every step sleeps --step-time, a window
   to kill in), no spare: seconds from the kill to rank 0's first step completed again, and the
   completed steps done twice (the last step completed before the kill, minus the step the job
   resumed from; TorchFT's groups never roll back: 0 by design, measured all the same, and the
   lost group's shard of the data is skipped while it is away);
3. grow: once rank 0 is past step 200, that node's launcher (TorchFT: group 2's torchrun) started
   again: seconds from its start to the first step on 3 replicas (DDP: rank 2's first step; TorchFT:
   the first step with 3 participants, as a group that has just healed from a peer sits out its
   first step), ours also from its ask (`elastic_join`, which comes once its warm reserve is
   ready), and whether the kept ranks kept their processes.
ours: ft_launcher --elastic --nnodes 2:3; torchrun: torch.distributed.run --nnodes 2:3
--max-restarts 3 (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: without it torchrun's restarts on gloo
often fail, docs/architecture.md's traps). TorchFT is measured only where `import torchft` works and
torchft_lighthouse is on PATH (else one line says so). Timings on a busy machine are fragile:
compare within one run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_jobs import ROOT, bench_env, read_progress, wait_until  # noqa: E402

SCRIPT = os.path.join(ROOT, "examples", "live_train.py")
TORCHFT_SCRIPT = os.path.join(ROOT, "bench", "torchft_train.py")
FAULT = 137
LABELS = {"ours": "ours --elastic", "torchft": "TorchFT 0.2.0"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rows(prog: str, rank: int):
    return read_progress(prog).get(rank, [])


def last_step(prog: str, rank: int) -> int:
    r = rows(prog, rank)
    return r[-1][1] if r else 0


def kill_tree(proc: subprocess.Popen) -> None:
    try:
        root = psutil.Process(proc.pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            if "orphan_watchdog" not in " ".join(p.cmdline()):
                p.kill()
        except psutil.NoSuchProcess:
            pass


class Run:
    """One job of one launcher on 3 local nodes x 1 rank (or torchrun --standalone x 3)."""
    script = SCRIPT
    group_env = "RANK"         # the variable that tells the script's processes apart

    def __init__(self, kind: str, base: str, script_args, flags=()):
        self.flags = [str(f) for f in flags]
        self.kind, self.dir = kind, tempfile.mkdtemp(prefix=f"elastic_{kind}_", dir=base)
        self.prog, self.ckpt, self.logs = (os.path.join(self.dir, n) for n in ("progress", "ckpt", "logs"))
        self.port = free_port()
        # one OpenMP thread per rank, as torchrun sets for several ranks per node: 3 "nodes" share 2 cores here
        self.env = bench_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1")
        self.argv = [self.script] + [str(a) for a in script_args] + self.paths()
        self.agents = []

    def paths(self) -> list:
        return ["--progress-dir", self.prog, "--ckpt-dir", self.ckpt]

    def command(self) -> list:
        common = ["--nnodes", "2:3", "--nproc-per-node", "1", "--max-restarts", "3", "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", f"el{self.port}"]
        if self.kind == "ours":
            return [sys.executable, "-m", "ft_launcher", "--elastic", "--log-dir", self.logs, "--rdzv-conf",
                    "join_timeout=60,last_call_timeout=20"] + self.flags + common + self.argv
        if self.kind == "plain":   # plain DDP: torchrun on the same 3 nodes, fixed
            common[1] = "3"
        return [sys.executable, "-m", "torch.distributed.run", "--rdzv-conf",
                "join_timeout=60,last_call_timeout=20"] + common + self.argv

    def start(self, node: int) -> None:
        if node:
            wait_until(lambda: _listening(self.port), 60, "the store host")
        self.agents.append(subprocess.Popen(self.command(), env=dict(self.env, GROUP_RANK=str(node)), cwd=self.dir,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def launch(self) -> "Run":
        self.t0 = time.time()
        for node in range(3):
            self.start(node)
        return self

    def finish(self, bound: float = 600) -> None:
        end = time.monotonic() + bound
        for a in self.agents:
            try:
                a.wait(timeout=max(1.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                raise RuntimeError(f"{self.kind}: the job did not end within {bound}s")

    def kill(self) -> None:
        for a in self.agents:
            kill_tree(a)

    def events(self, kind: str):
        path = os.path.join(self.logs, "events.jsonl")
        if not os.path.exists(path):
            return []
        with open(path) as fh:
            return [e for e in map(json.loads, fh) if e["kind"] == kind]

    def first_on_three(self, since: float):
        """(step, time) of the first step after `since` that the third replica took part in."""
        got = [(s, t) for _, s, t in rows(self.prog, 2) if t > since]   # a DDP step needs every rank
        return got[0] if got else None


class TorchFTRun(Run):
    """TorchFT 0.2.0 as its README runs it: torchft_lighthouse, then one torchrun per replica group
    (REPLICA_GROUP_ID, NUM_REPLICA_GROUPS, TORCHFT_LIGHTHOUSE) of bench/torchft_train.py."""
    script = TORCHFT_SCRIPT
    group_env = "REPLICA_GROUP_ID"

    def __init__(self, kind: str, base: str, script_args, flags=()):
        super().__init__(kind, base, script_args, flags)
        self.env = bench_env(OMP_NUM_THREADS="1", NUM_REPLICA_GROUPS="3",
                             TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{self.port}")
        self.lighthouse = None

    def paths(self) -> list:
        return ["--progress-dir", self.prog]

    def command(self) -> list:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                "--nproc-per-node", "1"] + self.argv

    def start(self, node: int) -> None:
        self.agents.append(subprocess.Popen(self.command(), env=dict(self.env, REPLICA_GROUP_ID=str(node)),
                                            cwd=self.dir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def launch(self) -> "Run":
        self.lighthouse = subprocess.Popen(
            ["torchft_lighthouse", "--min_replicas", "2", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000",
             "--bind", f"127.0.0.1:{self.port}"], cwd=self.dir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(lambda: _listening(self.port), 60, "the lighthouse")
        return super().launch()

    def finish(self, bound: float = 600) -> None:
        try:
            super().finish(bound)
        finally:
            self.lighthouse.kill()
            self.lighthouse.wait()

    def kill(self) -> None:
        super().kill()
        self.lighthouse.kill()

    def first_on_three(self, since: float):
        """TorchFT counts a group that has just healed out of its first step: the first step with
        3 participants."""
        path = os.path.join(self.prog, "participants_2.txt")
        if not os.path.exists(path):
            return None
        with open(path) as fh:
            got = [(int(s), float(t)) for s, n, t in (line.split() for line in fh if len(line.split()) == 3)
                   if int(n) == 3 and float(t) > since]
        return got[0] if got else None


def make_run(kind: str, base: str, steps: int, step_time: float = 0.0) -> Run:
    if kind == "torchft":
        return TorchFTRun(kind, base, ["--steps", steps, "--step-time", step_time])
    extra = ["--step-time", step_time, "--step-time-always"] if step_time else []
    return Run(kind, base, ["--steps", steps, "--ckpt-every", 50] + extra)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def steady(kind: str, base: str, steps: int) -> float:
    run = make_run(kind, base, steps).launch()
    run.finish()
    times = [t for _, s, t in rows(run.prog, 0) if s >= 50]
    return statistics.median(b - a for a, b in zip(times, times[1:]))


def lost_and_grow(kind: str, base: str, steps: int, step_time: float) -> dict:
    run = make_run(kind, base, steps, step_time).launch()
    try:
        return _lost_and_grow(run, step_time)
    finally:
        run.kill()   # nothing left behind if a wait timed out (a no-op once the job ended)


def _lost_and_grow(run: Run, step_time: float) -> dict:
    wait_until(lambda: last_step(run.prog, 2) >= FAULT - 10, 300, "rank 2 near the fault", 0.05)
    wait_until(lambda: last_step(run.prog, 2) >= FAULT - 1, 60, "rank 2 at step 136")
    kill_tree(run.agents[2])
    killed = time.time()
    done_before = max(s for _, s, t in rows(run.prog, 0) if t <= killed)
    again = wait_until(lambda: [(c, s, t) for c, s, t in rows(run.prog, 0) if t > killed], 300, "rank 0 stepping again")
    first = again[0]
    wait_until(lambda: last_step(run.prog, 0) >= 200, 300, "rank 0 past step 200", 0.02)
    pids_before = _rank_pids(run)
    rejoined = time.time()
    run.start(2)
    step, back = wait_until(lambda: run.first_on_three(rejoined), 300, "rank 2 on 3 replicas", 0.02)
    resumed = step - 1
    peak = max(s for _, s, t in rows(run.prog, 0) if t < back - step_time / 2)   # before the 3 replicas' first
    kept = pids_before == _rank_pids(run, (0, 1))
    run.finish()
    out = {"fault_to_stepping_s": first[2] - killed, "steps_redone": done_before - (first[1] - 1),
           "killed_after_step": done_before, "resumed_at": first[1] - 1,
           "join_to_three_s": back - rejoined, "steps_redone_at_grow": max(0, peak - resumed),
           "kept_pids_at_grow": kept}
    asked = run.events("elastic_join")
    if asked:
        out["ask_to_three_s"] = back - asked[0]["time"]
    return out


def _rank_pids(run: Run, ranks=(0, 1)) -> dict:
    """Rank (replica group) -> pid of the live processes running the script, where readable."""
    out = {}
    for p in psutil.process_iter(["cmdline", "environ"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            env = p.info["environ"] or {}
        except (psutil.Error, TypeError):
            continue
        if (run.script in cmd and run.prog in cmd and "torch.distributed.run" not in cmd
                and env.get(run.group_env) is not None and int(env[run.group_env]) in ranks):
            out[int(env[run.group_env])] = p.pid
    return out


def torchft_installed() -> bool:
    try:
        import torchft  # noqa: F401
    except Exception as e:   # not installed, or built against another torch
        print(f"TorchFT: `import torchft` fails here ({type(e).__name__}: {e}): no TorchFT figures")
        return False
    if shutil.which("torchft_lighthouse") is None:
        print("TorchFT: torchft_lighthouse is not on PATH: no TorchFT figures")
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=900)
    ap.add_argument("--steady-steps", type=int, default=400)
    ap.add_argument("--step-time", type=float, default=0.05)
    ap.add_argument("--reps", type=int, default=2, help="steady runs of each, alternating")
    ap.add_argument("--steady-only", action="store_true", help="only the steady step times (no fault, no grow)")
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="bench_elastic_")
    try:
        kinds = ["plain", "ours"] + (["torchft"] if torchft_installed() else [])
        got = {k: [] for k in kinds}
        for _ in range(args.reps):   # alternating
            for k in kinds:
                got[k].append(steady(k, base, args.steady_steps))
        p = statistics.median(got["plain"])
        others = ", ".join(f"{LABELS[k]} {statistics.median(got[k]) * 1e3:.2f} ms "
                           f"({(statistics.median(got[k]) / p - 1) * 100:+.1f} %)" for k in kinds[1:])
        print(f"steady step time (median of {args.reps} runs' medians, steps 50-{args.steady_steps}): plain DDP under "
              f"torchrun {p * 1e3:.2f} ms, {others}; runs: "
              + " vs ".join(str([round(x * 1e3, 2) for x in got[k]]) for k in kinds), flush=True)
        for kind in [] if args.steady_only else ["ours", "torchrun"] + kinds[2:]:
            res = lost_and_grow(kind, base, args.steps, args.step_time)
            print(f"{kind:8s} " + json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}),
                  flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
