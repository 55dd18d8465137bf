"""What the benchmarks share: start a job under ft_launcher or the installed torchrun, find its
ranks, read the example's progress files, end the job cleanly, and summarise timings.

Both launchers run the same script with the same flags, so a ratio compares launchers only.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Dict, List, Optional

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "ddp_train.py")


def launcher_cmd(kind: str, nproc: int, extra: List[str]) -> List[str]:
    if kind == "ft_launcher":
        return [sys.executable, "-m", "ft_launcher", "--standalone", "--nproc-per-node", str(nproc), *extra]
    torchrun = shutil.which("torchrun")
    if not torchrun:
        raise SystemExit("torchrun is not installed: pip install torch==2.13.0")
    return [torchrun, "--standalone", "--nproc-per-node", str(nproc), *extra]


class Job:
    """One run of a script under a launcher, in a scratch directory, with its output in a log."""

    def __init__(self, kind: str, nproc: int, launcher_args: List[str], script_args: List[str],
                 script: str = EXAMPLE, cmd: Optional[List[str]] = None):
        self.kind = kind
        self.dir = tempfile.mkdtemp(prefix=f"ftbench_{kind}_")
        self.progress_dir = os.path.join(self.dir, "progress")
        self.log = open(os.path.join(self.dir, "launcher.log"), "w")
        env = bench_env(FT_BENCH_TOKEN=uuid.uuid4().hex)
        self.token = env["FT_BENCH_TOKEN"]
        cmd = (cmd or launcher_cmd(kind, nproc, launcher_args)) + [script, *script_args]
        self.started = time.time()
        self.proc = subprocess.Popen(cmd, cwd=self.dir, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def progress(self) -> Dict[int, List[tuple]]:
        return read_progress(self.progress_dir)

    def all_stepping(self, nranks: int, cycle: int, after: float = 0.0) -> Optional[float]:
        """When the last rank made its first step in `cycle` (after `after`), or None yet."""
        firsts = []
        for rows in self.progress().values():
            times = [t for c, _, t in rows if c == cycle and t >= after]
            if not times:
                return None
            firsts.append(min(times))
        return max(firsts) if len(firsts) == nranks else None

    def wait_for(self, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value is not None and value is not False:
                return value
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited ({self.proc.returncode}) while waiting for {what}; "
                                   f"see {self.log.name}")
            time.sleep(0.01)
        raise RuntimeError(f"{self.kind}: timed out after {timeout}s waiting for {what}; see {self.log.name}")

    def rank_pid(self, rank: int) -> int:
        """The pid of global rank `rank` (a process of this job whose RANK is that)."""
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                env = p.environ()
                if env.get("RANK") == str(rank) and "LOCAL_RANK" in env and EXAMPLE in " ".join(p.cmdline()):
                    return p.pid
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        raise RuntimeError(f"rank {rank} not found")

    def stop(self, keep_dir: bool = False) -> None:
        """SIGTERM the launcher (it forwards to the ranks); SIGKILL whatever is left after 20 s.
        The scratch directory (with launcher.log) is removed unless `keep_dir`."""
        stop_launcher(self.proc)
        left = []
        for p in psutil.process_iter():
            try:
                if p.environ().get("FT_BENCH_TOKEN") == self.token:
                    left.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        for p in left:
            p.kill()
        self.log.close()
        if not keep_dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def stop_launcher(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM a launcher started in its own session (it forwards to its ranks); after `grace`
    seconds SIGKILL whatever of that session is left."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def read_progress(progress_dir: str) -> Dict[int, List[tuple]]:
    """{rank: [(cycle, step, unix time), ...]} from the example's --progress-dir."""
    out: Dict[int, List[tuple]] = {}
    if not os.path.isdir(progress_dir):
        return out
    for name in os.listdir(progress_dir):
        if not name.startswith("rank_"):   # e.g. raised_rank_1.txt: not a progress file
            continue
        rows = []
        with open(os.path.join(progress_dir, name)) as fh:
            for line in fh:
                parts = line.split()
                if len(parts) == 3:
                    rows.append((int(parts[0]), int(parts[1]), float(parts[2])))
        out[int(name.split("_")[1].split(".")[0])] = rows
    return out


def wait_until(predicate, timeout: float, what: str, interval: float = 0.005):
    """Poll `predicate` until it returns something truthy (returned); RuntimeError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")


def bench_env(**extra: str) -> dict:
    """The environment of a benchmarked launcher: this checkout first on PYTHONPATH, its modules
    compiled once and cached as an installed package's are (pip compiles them at install): with
    PYTHONDONTWRITEBYTECODE set, every start of ours compiled ~90 modules from source (0.2-0.3 s
    here) while torch's came compiled, so the launch ratio measured the setting, not the launcher."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def summary(values: List[float]) -> str:
    if not values:
        return "n/a"
    return f"median {statistics.median(values):6.2f} s  (min {min(values):.2f}, max {max(values):.2f}, n={len(values)})"


def ratio(ours: List[float], theirs: List[float]) -> str:
    if not ours or not theirs:
        return "n/a"
    return f"{statistics.median(ours) / statistics.median(theirs):.2f}x"


def repeat(runs, reps: int, measure) -> dict:
    """Run each entry of `runs` (its first two items: launcher kind, fault) `reps` times through
    `measure(entry) -> (launch seconds, recovery seconds or None)`, printing one line per run.
    Returns {(kind, "launch"): [s], (kind, fault): [s], (kind, fault, "failed"): [rep, ...]}."""
    results: dict = {}
    for rep in range(reps):
        for entry in runs:
            kind, fault = entry[0], entry[1]
            launch, recovery = measure(entry)
            results.setdefault((kind, "launch"), []).append(launch)
            if fault == "launch":   # a launch-only run: no recovery to count
                print(f"  rep {rep}: {kind:11s} launch {launch:5.2f} s", flush=True)
                continue
            results.setdefault((kind, fault), [])
            failed = results.setdefault((kind, fault, "failed"), [])
            if recovery is None:
                failed.append(rep)
            else:
                results[(kind, fault)].append(recovery)
            shown = "did not recover" if recovery is None else f"{recovery:5.2f} s"
            print(f"  rep {rep}: {kind:11s} launch {launch:5.2f} s, {fault} -> stepping again {shown}", flush=True)
    return results


def recovered(results: dict, kind: str, fault: str, reps: int) -> str:
    failed = len(results[(kind, fault, "failed")])
    if not failed and not results[(kind, fault)]:
        return "not run"
    return f"recovered {reps - failed}/{reps}"


# ---- what ft_launcher's events say about its warm reserves -------------------------------------------
def reserves_ready(job: Job, nproc: int):
    """The ready reports of this job's warm reserves, once every slot has one (else None)."""
    path = os.path.join(job.dir, "logs", "events.jsonl")
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        ready = {}
        for line in fh:
            event = json.loads(line)
            if event["kind"] == "reserve_ready" and not event["detail"].get("refreshed"):
                ready.setdefault(event["detail"]["local_rank"], dict(event["detail"], time=event["time"]))
    return ready if len(ready) == nproc else None


def cycle1_starts(job: Job) -> str:
    """How cycle 1's ranks started: 'w' a reserve still warming (taken), 'r' a ready reserve,
    'c' cold, 'p' in place; one letter per rank."""
    path = os.path.join(job.dir, "logs", "events.jsonl")
    taken, ranks = set(), {}
    with open(path) as fh:
        for line in fh:
            event = json.loads(line)
            if event["kind"] == "reserve_taken_warming":
                taken.add(event["detail"]["pid"])
            elif event["kind"] == "ranks_started" and event["cycle"] == 1:
                ranks = {r["rank"]: r for r in event["detail"]["ranks"]}
    return "".join("p" if r.get("in_place") else ("w" if r["pid"] in taken else "r") if r["warm"] else "c"
                   for _, r in sorted(ranks.items()))
