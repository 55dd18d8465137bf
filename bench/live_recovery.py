"""Live recovery side by side: ft_launcher --live, ft_launcher's checkpoint restore, torchrun's
restart and TorchFT 0.2.0, on the same model and state size, in one run.

    python bench/live_recovery.py [--reps 3] [--kill-at 137] [--ckpt-every 50] [--only live,torchft]
    python bench/live_recovery.py --dry-run      # one tiny case, seconds (the tests run this)

The job is bench/live_train.py: an MLP with AdamW and an LR schedule (--width 1280: ~47 MB of
model + AdamW state), two data-parallel replicas of one rank each on gloo. Rank 1 (--kill-rank)
SIGKILLs itself at the start of step --kill-at (steps 1..K-1 done, K in flight); the clock starts at
the time it writes just before. Contenders:
  live      ft_launcher, 1 agent x 2 ranks, ft.restartable + ft.LiveState: the healthy rank
            restarts in place and keeps its state, the replaced rank heals from it
  ckpt      the same under ft_launcher without LiveState: every rank reloads the checkpoint
  torchrun  torchrun --max-restarts 3 of the same script: every rank restarts and reloads it
  buddy1    --live with a buddy copy every step (ft.LiveState(buddy_every=1)): the state also in host
            memory (this node's shared memory, and the buddy rank's: one node here); the killed rank
            loads its own copy there ("host copy")
  buddy10   the same every 10 steps: the killed rank's copy is older than the resume step, so it
            heals from its live peer as --live does; the figure here is the per-step cost
  torchft   2 TorchFT replica groups (1 rank each, Manager on ProcessGroupGloo, gradients
            averaged with manager.allreduce) under torchft_lighthouse (--min_replicas 1, its
            default 5 s heartbeat timeout unless --torchft-heartbeat-timeout-ms); this bench
            relaunches the killed replica at once (a fresh interpreter, as a relaunch loop or a
            scheduler would) and it heals from the healthy replica over TorchFT's HTTP transport
Figures (per rank from its progress lines; a step counts when its line is written):
  fault -> all stepping   the fault until every rank has completed a step after it
  healthy stall           the fault until the healthy rank completed a step after it
  steps redone            K - (first step after the fault) + 1, the largest over ranks (0 when a
                          rank skips ahead: a healed TorchFT replica starts at its peer's step)
  state source            where the recovering rank's state came from: the live_recovery event of
                          events.jsonl (ft_launcher --live), else the script's restore record
  transfer MB/s           state bytes / the time the recovering rank took to get it (peer or disk)
  checksum                the DDP contenders' final model against a fault-free run of the same job
  buddy copy cost         with a buddy contender: fault-free runs of --live without and with buddy
                          copies (K = 1, 10), the same steps: the mean step time over steps 20..end
                          against --live's, and the ranks' own account (LiveState.buddy_stats: the
                          copy into host memory and the wait for the previous exchange, per step)
Every process the bench starts runs in its own session; all are killed (process groups) at the end.
"""
from __future__ import annotations

import argparse
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
import uuid
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_jobs import Job, bench_env, read_progress  # noqa: E402
from ft_launcher.agent.observation.live_recovery import per_rank  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "live_train.py")
CONTENDERS = ("live", "buddy1", "buddy10", "ckpt", "torchrun", "torchft")
LABELS = {"live": "ft_launcher --live", "buddy1": "--live + buddy copy K=1", "buddy10": "--live + buddy copy K=10",
          "ckpt": "ft_launcher ckpt restore", "torchrun": "torchrun ckpt restore", "torchft": "TorchFT 0.2.0"}
BUDDY = {"buddy1": 1, "buddy10": 10}   # contender -> buddy_every


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--kill-at", type=int, default=137, help="the step at which rank 1 is killed")
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--steps", type=int, default=None, help="steps in all (default: --kill-at + 30)")
    p.add_argument("--kill-rank", type=int, choices=(0, 1), default=1, help="the rank (replica) that is killed")
    p.add_argument("--width", type=int, default=1280, help="hidden width of the MLP (1280: ~47 MB of state)")
    p.add_argument("--only", default=None, help=f"comma-separated, of {', '.join(CONTENDERS)} (default: every one "
                   "this machine can run)")
    p.add_argument("--torchft-heartbeat-timeout-ms", type=int, default=5000,
                   help="torchft_lighthouse --heartbeat_timeout_ms (its default: 5000)")
    p.add_argument("--no-reference", action="store_true", help="skip the fault-free run (no checksum check)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a case may take before it counts as failed")
    p.add_argument("--keep", action="store_true", help="keep every case's scratch directory")
    p.add_argument("--json", default=None, help="also write every measurement to this file")
    p.add_argument("--dry-run", action="store_true",
                   help="one tiny case (ft_launcher ckpt restore, width 64, kill at step 8 of 12, ckpt every 5)")
    args = p.parse_args(argv)
    if args.dry_run:
        args.reps, args.kill_at, args.ckpt_every, args.steps, args.width = 1, 8, 5, 12, 64
        args.only, args.no_reference = "ckpt", True
    args.skipped = []
    if args.only is None:
        args.only = [c for c in CONTENDERS if not (c == "torchft" and not torchft_available())
                     and not (c in ("live", *BUDDY) and not live_available())]
        args.skipped = [c for c in CONTENDERS if c not in args.only]
    else:
        args.only = [c.strip() for c in args.only.split(",") if c.strip()]
    bad = [c for c in args.only if c not in CONTENDERS]
    if bad:
        p.error(f"--only: unknown contender(s) {', '.join(bad)}; choose from {', '.join(CONTENDERS)}")
    if args.steps is None:
        args.steps = args.kill_at + 30
    if not 1 < args.kill_at < args.steps:
        p.error(f"--kill-at must be between 2 and --steps - 1 (got {args.kill_at}, steps {args.steps})")
    if args.reps < 1:
        p.error("--reps must be at least 1")
    if "torchft" in args.only and not torchft_available():
        p.error("torchft is not installed (pip install torchft==0.2.0), or leave it out with --only")
    if any(c in args.only for c in ("live", *BUDDY)) and not live_available():
        p.error("this ft_launcher has no ft.LiveState (the live-state API): leave 'live' out with --only")
    return args


def torchft_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("torchft") is not None and shutil.which("torchft_lighthouse") is not None


def live_available() -> bool:
    out = subprocess.run([sys.executable, "-c", "import ft_launcher as ft; print(hasattr(ft, 'LiveState'))"],
                         env=bench_env(), capture_output=True, text=True, cwd=tempfile.gettempdir())
    return out.stdout.strip() == "True"


def script_args(args, kill: bool, live=False, restartable=False, buddy=0) -> List[str]:
    out = ["--steps", str(args.steps), "--width", str(args.width), "--ckpt-every", str(args.ckpt_every),
           "--progress-dir", "progress", "--ckpt-dir", "ckpt"]
    if kill:
        out += ["--kill-at-step", str(args.kill_at), "--kill-rank", str(args.kill_rank)]
    out += ["--buddy-every", str(buddy)] if buddy else []
    return out + (["--live"] if live else []) + (["--restartable"] if restartable and not live else [])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


class TorchFTJob:
    """torchft_lighthouse and one process per replica, each in its own session; a replica that
    exits before the job is done is relaunched at once with INCARNATION + 1."""

    def __init__(self, args, kill: bool):
        self.dir = tempfile.mkdtemp(prefix="ftbench_torchft_")
        self.progress_dir = os.path.join(self.dir, "progress")
        self.log = open(os.path.join(self.dir, "launcher.log"), "w")
        self.token = uuid.uuid4().hex
        self.args, self.kill = args, kill
        port = free_port()
        self.env = bench_env(FT_BENCH_TOKEN=self.token, TORCHFT_LIGHTHOUSE=f"http://localhost:{port}",
                             GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
        self.started = time.time()
        self.lighthouse = subprocess.Popen(
            [shutil.which("torchft_lighthouse"), "--min_replicas", "1", "--bind", f"[::]:{port}",
             "--join_timeout_ms", "10000", "--heartbeat_timeout_ms", str(args.torchft_heartbeat_timeout_ms)],
            cwd=self.dir, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.replicas: Dict[int, subprocess.Popen] = {}
        self.incarnation = {0: 0, 1: 0}
        self.relaunched: Dict[int, float] = {}
        for r in (0, 1):
            self._launch(r)

    def _launch(self, r: int) -> None:
        env = dict(self.env, REPLICA_ID=str(r), INCARNATION=str(self.incarnation[r]))
        log = open(os.path.join(self.dir, f"replica_{r}_{self.incarnation[r]}.log"), "w")
        self.replicas[r] = subprocess.Popen(
            [sys.executable, SCRIPT, "--mode", "torchft", *script_args(self.args, self.kill)],
            cwd=self.dir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def poll(self) -> None:
        """Relaunch a replica that died (any exit before its final.json counts as a failure)."""
        for r, proc in list(self.replicas.items()):
            if proc.poll() is None:
                continue
            if os.path.exists(os.path.join(self.dir, "ckpt", f"final_rank_{r}.json")):
                continue
            if self.incarnation[r] >= 3:
                raise RuntimeError(f"torchft replica {r} failed {self.incarnation[r] + 1} times; see {self.dir}")
            self.incarnation[r] += 1
            self.relaunched[r] = time.time()
            self._launch(r)

    def done(self) -> bool:
        return all(p.poll() == 0 for p in self.replicas.values())

    def stop(self, keep_dir: bool = False) -> None:
        for proc in [*self.replicas.values(), self.lighthouse]:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        kill_token(self.token)
        self.log.close()
        if not keep_dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def kill_token(token: str) -> None:
    import psutil
    for p in psutil.process_iter():
        try:
            if p.environ().get("FT_BENCH_TOKEN") == token:
                p.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue


def read_json(path: str) -> Optional[dict]:
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def read_fault(progress_dir: str):
    try:
        with open(os.path.join(progress_dir, "fault.txt")) as fh:
            t, step, rank = fh.read().split()
        return float(t), int(step), int(rank)
    except (OSError, ValueError):
        return None


def after_fault(rows, t0: float, k: int):
    """The first progress line after the fault: a later time, and a new cycle or a step >= K
    (a healthy rank may still write step K-1 of the old cycle just after the fault)."""
    for cycle, step, t in rows:
        if t > t0 and (cycle > 0 or step >= k):
            return cycle, step, t
    return None


def events(job_dir: str) -> List[dict]:
    path = os.path.join(job_dir, "logs", "events.jsonl")
    out = []
    if os.path.exists(path):
        with open(path) as fh:
            for line in fh:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    return out


def replaced_warm(evs: List[dict], victim: int) -> Optional[bool]:
    """Whether cycle 1's new process for `victim` was a warm reserve (ranks_started), else None."""
    for e in evs:
        if e.get("kind") == "ranks_started" and e.get("cycle") == 1:
            for r in e["detail"]["ranks"]:
                if r["rank"] == victim:
                    return bool(r.get("warm"))
    return None


def measure(args, contender: str, kill: bool = True) -> dict:
    """Run one case to the end; -> its figures (or {'failed': why})."""
    if contender == "torchft":
        job = TorchFTJob(args, kill)
    else:
        kind = "torchrun" if contender == "torchrun" else "ft_launcher"
        extra = ["--max-restarts", "3"] + (["--log-dir", "logs"] if kind == "ft_launcher" else [])
        job = Job(kind, 2, extra, script_args(args, kill, live=contender in ("live", *BUDDY),
                                              restartable=contender == "ckpt", buddy=BUDDY.get(contender, 0)),
                  script=SCRIPT)
    ok = False
    try:
        deadline = time.monotonic() + args.timeout
        while True:
            if contender == "torchft":
                job.poll()
                if job.done():
                    break
            elif job.proc.poll() is not None:
                if job.proc.returncode != 0:
                    return {"failed": f"launcher exit {job.proc.returncode}; see {job.dir}"}
                break
            if time.monotonic() > deadline:
                return {"failed": f"not done after {args.timeout:.0f} s; see {job.dir}"}
            time.sleep(0.02)
        out = result(args, contender, job, kill)
        ok = "failed" not in out
        return out
    finally:
        job.stop(keep_dir=args.keep or not ok)


def result(args, contender: str, job, kill: bool) -> dict:
    progress = read_progress(job.progress_dir)
    ckpt = os.path.join(job.dir, "ckpt")
    final = read_json(os.path.join(ckpt, "final.json" if contender != "torchft" else "final_rank_0.json")) or {}
    out = {"checksum": final.get("checksum"), "state_mb": (final.get("state_bytes") or 0) / 1e6}
    if final.get("commits", 0) > 1:   # ft_launcher --live: the committed-state snapshots, per step
        out["snapshot_us"] = final["snapshot_s"] / (final["commits"] - 1) * 1e6
    if not kill:
        steps = [[t for c, st, t in rows if c == 0 and st >= 20] for rows in progress.values()]
        gaps = [b - a for ts in steps for a, b in zip(ts, ts[1:])]
        if gaps:
            out["mean_step_s"] = sum(gaps) / len(gaps)
        out["buddy"] = [read_json(os.path.join(job.progress_dir, f"buddy_rank_{r}_cycle_0.json")) for r in (0, 1)]
        return out
    fault = read_fault(job.progress_dir)
    if fault is None:
        return {"failed": f"no fault recorded; see {job.dir}"}
    t0, k, victim = fault
    firsts = {r: after_fault(rows, t0, k) for r, rows in progress.items()}
    if len(firsts) != 2 or any(v is None for v in firsts.values()):
        return {"failed": f"a rank never stepped after the fault ({firsts}); see {job.dir}"}
    healthy = 1 - victim
    out.update(
        all_stepping=max(t for _, _, t in firsts.values()) - t0,
        stall=firsts[healthy][2] - t0,
        redone=max(max(0, k - step + 1) for _, step, _ in firsts.values()),
        first_steps={r: v[1] for r, v in firsts.items()})
    # back where it was: every rank has completed step K (or a later one) after the fault
    caught = [min((t for c, st, t in rows if t > t0 and (c > 0 or st >= k) and st >= k), default=None)
              for rows in progress.values()]
    if all(t is not None for t in caught):
        out["caught_up"] = max(caught) - t0
    before = [t for c, st, t in progress.get(healthy, []) if c == 0 and t < t0]
    gaps = [b - a for a, b in zip(before[-31:], before[-30:])]
    if gaps:
        out["step_s"] = statistics.median(gaps)
    # where the recovering rank's state came from, from its restore record of the next incarnation
    cycle = firsts[victim][0]
    rec = read_json(os.path.join(job.progress_dir, f"restore_rank_{victim}_cycle_{cycle}.json")) or {}
    healthy_rec = read_json(os.path.join(job.progress_dir, f"restore_rank_{healthy}_cycle_{cycle}.json")) or {}
    for who, r in (("victim", rec), ("healthy", healthy_rec)):   # restore(): RSS before and its peak
        if r.get("rss_peak"):
            out[f"peak_{who}_mb"] = (r["rss_peak"] - r["rss_before"]) / 1e6
    out["source"] = rec.get("source", "?")
    out["healthy_source"] = healthy_rec.get("source", "kept (never left)" if contender == "torchft" else "?")
    summary = rec.get("live") or {}
    if summary.get("resume_step") is not None:   # LiveState.restore's own account (every rank has it)
        out["source"] = per_rank(summary["sources"]).get(str(victim), out["source"])
        out["healthy_source"] = per_rank(summary["sources"]).get(str(healthy), out["healthy_source"])
        out["restore_s"] = summary.get("restore_s")
        if summary.get("mb_per_s"):
            out["transfer_s"], out["transfer_mbs"] = summary["transfer_s"], summary["mb_per_s"]
    elif rec.get("seconds"):
        out["transfer_s"] = rec["seconds"]
        out["transfer_mbs"] = rec["bytes"] / 1e6 / rec["seconds"]
    evs = events(job.dir) if contender != "torchft" else []
    told = [e["detail"] for e in evs if e.get("kind") == "live_recovery"]
    if told:   # the launcher's own account of the incident (agent/observation/live_recovery.py) wins
        d = told[-1]
        out["event"] = {k: d.get(k) for k in ("resume_step", "steps_redone", "sources", "bytes", "transfer_s",
                                               "mb_per_s", "restore_s", "check", "reason")}
        if d.get("check"):
            out["check_s"], out["check_ms_per_gb"] = d["check"]["s"], d["check"]["ms_per_gb"]
        if d.get("resume_step") is not None:
            out["source"] = per_rank(d["sources"]).get(str(victim), out["source"])
            out["healthy_source"] = per_rank(d["sources"]).get(str(healthy), out["healthy_source"])
            if d.get("mb_per_s"):
                out["transfer_s"], out["transfer_mbs"] = d["transfer_s"], d["mb_per_s"]
        else:
            out["source"] = f"disk ({d.get('reason')})"
    if contender in ("live", "ckpt", *BUDDY):
        out["replaced_warm"] = replaced_warm(evs, victim)
    return out


def med(values: List[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def spread(values: List[float], fmt="{:.2f}") -> str:
    if not values:
        return "n/a"
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def table(args, runs: Dict[str, List[dict]], reference: Optional[float]) -> str:
    ok = {c: [r for r in rs if "failed" not in r] for c, rs in runs.items()}

    def median_of(c, key):
        return med([r[key] for r in ok.get(c, []) if key in r])

    lines = ["| contender | fault -> all stepping (s) | healthy-rank stall (s) | steps redone | fault -> step K "
             "done again (s) | state source (recovering rank) | transfer MB/s | step (ms) | vs torchrun | "
             "vs TorchFT | final checksum | recovered |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in args.only:
        rs = ok.get(c, [])
        ratios = []
        for b in ("torchrun", "torchft"):
            pair = []
            for key in ("all_stepping", "caught_up"):
                mine, theirs = median_of(c, key), median_of(b, key)
                pair.append(f"{mine / theirs:.2f}x" if mine is not None and theirs else "n/a")
            ratios.append(" / ".join(pair))
        sources = sorted({r["source"] for r in rs}) or ["n/a"]
        if c == "torchft":
            check = "n/a (other numerics)"
        elif reference is None:
            check = "not checked"
        else:
            same = [r["checksum"] == reference for r in rs]
            check = f"exact {sum(same)}/{len(same)}"
        lines.append(
            f"| {LABELS[c]} | {spread([r['all_stepping'] for r in rs])} | {spread([r['stall'] for r in rs])} | "
            f"{spread([r['redone'] for r in rs], '{:.0f}')} | "
            f"{spread([r['caught_up'] for r in rs if 'caught_up' in r])} | "
            f"{', '.join(sources)} | "
            f"{spread([r['transfer_mbs'] for r in rs if 'transfer_mbs' in r], '{:.0f}')} | "
            f"{spread([r['step_s'] * 1000 for r in rs if 'step_s' in r], '{:.0f}')} | {ratios[0]} | {ratios[1]} | "
            f"{check} | {len(rs)}/{len(runs.get(c, []))} |")
    lines.append("(median (min-max) over the recovered runs; ratios: fault -> all stepping / fault -> step K done "
                 "again, medians)")
    return "\n".join(lines)


def costs(runs: Dict[str, List[dict]]) -> str:
    """ft_launcher --live's own costs: the committed-state snapshot per step (vs the step), the
    replicas' digest check per recovery, and the extra memory restore() took (RSS peak over before)."""
    rs = [r for r in runs.get("live", []) if "failed" not in r]
    if not rs:
        return ""
    lines = ["ft_launcher --live costs (median (min-max) over the recovered runs):"]
    snap = [r["snapshot_us"] for r in rs if "snapshot_us" in r]
    step = med([r["step_s"] * 1e6 for r in rs if "step_s" in r])
    if snap:
        share = f" = {med(snap) / step * 100:.3f} % of the {step / 1e3:.0f} ms step" if step else ""
        lines.append(f"  snapshot of the committed state, per step: {spread(snap, '{:.0f}')} us{share}")
    check = [r["check_s"] * 1e3 for r in rs if "check_s" in r]
    if check:
        per_gb = spread([r["check_ms_per_gb"] for r in rs if "check_ms_per_gb" in r], "{:.0f}")
        share = f" = {med(check) * 1e3 / step:.2f} steps" if step else ""
        lines.append(f"  replicas' digest check, per recovery: {spread(check, '{:.1f}')} ms ({per_gb} ms/GB){share}")
    for who in ("victim", "healthy"):
        peak = [r[f"peak_{who}_mb"] for r in rs if f"peak_{who}_mb" in r]
        if peak:
            lines.append(f"  restore() peak RSS over before, {'receiving' if who == 'victim' else 'kept'} rank: "
                         f"{spread(peak, '{:.1f}')} MB (state {med([r['state_mb'] for r in rs]):.1f} MB; staging "
                         f"buffer at most 16.8 MB)")
    return "\n".join(lines)


def buddy_cost(args) -> str:
    """Fault-free runs of --live without and with buddy copies, alternated --reps times: the mean
    step time against --live's, and each rank's own account of the copies (per step)."""
    kinds = ["live"] + [c for c in BUDDY if c in args.only]
    seen: Dict[str, List[dict]] = {c: [] for c in kinds}
    for rep in range(args.reps):
        for c in kinds:
            r = measure(args, c, kill=False)
            seen[c].append(r)
            if "failed" in r or "mean_step_s" not in r:
                print(f"  cost rep {rep}: {LABELS[c]:26s} FAILED: {r.get('failed', 'no steps')}", flush=True)
                continue
            print(f"  cost rep {rep}: {LABELS[c]:26s} mean step {r['mean_step_s'] * 1000:.2f} ms"
                  + "".join(f"; rank {i}: {b}" for i, b in enumerate(r.get("buddy") or []) if b), flush=True)
    base = med([r["mean_step_s"] for r in seen["live"] if "mean_step_s" in r])
    lines = ["| fault-free, same job | mean step (ms) | vs --live | copy into host memory per snapshot (ms) | "
             "wait for the previous exchange per snapshot (ms) | exchange per snapshot (ms, background) | "
             "rank's own cost per step (% of the step) | host memory per rank (MB) |",
             "|---|---|---|---|---|---|---|---|"]
    for c in kinds:
        rs = [r for r in seen[c] if "mean_step_s" in r]
        step = [r["mean_step_s"] * 1000 for r in rs]
        vs = f"{(med(step) / 1000 / base - 1) * 100:+.1f} %" if c != "live" and base and step else "1.00"
        stats = [b for r in rs for b in (r.get("buddy") or []) if b and b.get("snapshots")]
        per = lambda key: [b[key] / b["snapshots"] * 1000 for b in stats]   # noqa: E731
        own = [(b["copy_s"] + b["wait_s"]) / b["steps"] / (r["mean_step_s"]) * 100
               for r in rs for b in (r.get("buddy") or []) if b and b.get("snapshots")]
        mem = [4 * b["bytes"] / 1e6 for b in stats]
        lines.append(f"| {LABELS[c]} | {spread(step)} | {vs} | {spread(per('copy_s')) if stats else 'n/a'} | "
                     f"{spread(per('wait_s')) if stats else 'n/a'} | {spread(per('exchange_s')) if stats else 'n/a'} | "
                     f"{spread(own) if own else 'n/a'} | {spread(mem, '{:.0f}') if mem else 'n/a'} |")
    lines.append(f"(median (min-max) over {args.reps} runs each, both ranks; steps 20..{args.steps})")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    print(f"kill rank {args.kill_rank} at step {args.kill_at} of {args.steps}, checkpoint every {args.ckpt_every}, "
          f"MLP width {args.width}, 2 replicas x 1 rank (gloo), {args.reps} reps, {os.cpu_count()} cores", flush=True)
    for c in args.skipped:
        print(f"  left out: {LABELS[c]} ({'torchft is not installed' if c == 'torchft' else 'no ft.LiveState here'})",
              flush=True)
    reference = None
    if not args.no_reference:
        ref = measure(args, "ckpt", kill=False)
        reference = ref.get("checksum")
        print(f"  fault-free run: checksum {reference}, state {ref.get('state_mb', 0):.1f} MB", flush=True)
    if any(c in BUDDY for c in args.only):
        print(buddy_cost(args), flush=True)
    runs: Dict[str, List[dict]] = {c: [] for c in args.only}
    for rep in range(args.reps):
        for c in args.only:
            r = measure(args, c)
            runs[c].append(r)
            if "failed" in r:
                print(f"  rep {rep}: {LABELS[c]:26s} FAILED: {r['failed']}", flush=True)
                continue
            extra = f", transfer {r['transfer_s']:.3f} s ({r['transfer_mbs']:.0f} MB/s)" if "transfer_s" in r else ""
            extra += f", restore() {r['restore_s']:.3f} s" if r.get("restore_s") else ""
            extra += f", replaced by a {'warm reserve' if r['replaced_warm'] else 'cold process'}" \
                if r.get("replaced_warm") is not None else ""
            print(f"  rep {rep}: {LABELS[c]:26s} all stepping {r['all_stepping']:6.3f} s, healthy stall "
                  f"{r['stall']:6.3f} s, redone {r['redone']}, step K again {r.get('caught_up', float('nan')):.2f} s, "
                  f"step {r.get('step_s', float('nan')) * 1000:.0f} ms, first steps {r['first_steps']}, source "
                  f"{r['source']} (healthy: {r['healthy_source']}){extra}, state {r['state_mb']:.1f} MB"
                  + (f"; live_recovery event {r['event']}" if r.get("event") else ""), flush=True)
    print()
    print(table(args, runs, reference))
    print(costs(runs))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "reference": reference, "runs": runs}, fh,
                      indent=1)


if __name__ == "__main__":
    main()
