"""The NCCL paths of live recovery on one GPU (issue 30), with a CPU fallback.

    python bench/gpu_live_checks.py [--no-recovery] [--block 3]

On a GPU (NCCL, world size 1: one GPU, so no collective can wait on a peer) it measures:
  watcher     the rank's restart watcher (rank_monitor/rank_side/restart_watcher.py) while its
              main thread is blocked in torch.cuda.synchronize() behind a ~BLOCK s kernel
              (torch.cuda._sleep): request -> watcher acting, -> NCCL communicators aborted, -> the
              main thread leaving its sync, and whether the rank then restarts in place (cycle 1);
              for init_process_group("nccl") and ("cpu:gloo,cuda:nccl"). Before the watcher the
              abort began only in the signal's handler, i.e. when the sync returned.
  backends    what each init_process_group form really uses (rank_side/comm_backend.py):
              no backend, "nccl", "cpu:gloo,cuda:nccl", device_id=cuda:0 (with and without "nccl"),
              against `dist.get_backend()`, and where LiveState's transfers go
  commit      the GPU-complete commit (rank_side/gpu_commit.py): the cost of a commit's CUDA event
              per step against the same loop without it and with a host sync per step; how far the
              counted step lags; a restart whose pending step's work does not complete within the
              settle time leaves the state suspect
  recovery    (unless --no-recovery) ft_launcher with one NCCL rank: an exception in place
              (examples/ddp_train.py --restartable --raise-on USR1) and a 2 s CUDA-kernel hang
              (bench/gpu_recovery.py's), fault -> stepping again (prior H100: 0.84 s and 2.92 s;
              goals <= 1.0 s and <= T + 1 s)
Without a usable CUDA GPU it runs the CPU side of the same paths (a watcher behind a blocked
sleep, the gloo init forms, the commit logic with torch.cuda absent) and says so; exit 0 either way.
Leaves no process and no /dev/shm file behind.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
BLOCKED = os.path.join(ROOT, "tests", "scripts", "blocked_rank.py")


def env(**extra):
    out = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out.update(extra)
    return out


# ---- the watcher -----------------------------------------------------------------------------
class RankRecord:
    """A rank's shared-memory record made here as its monitor would, seen as the agent's handle sees
    it (record(), shm_path): this script, and tests/monitor/unit/test_restart_watcher.py, play the agent."""

    def __init__(self, shm_path):
        from ft_launcher.rank_monitor import shm_layout as L

        self.L = L
        self.shm_path = str(shm_path)
        self.mm, self.words = L.create(self.shm_path)

    def record(self):
        return self.mm, self.words

    def close(self):
        self.words.release()
        self.mm.close()
        for path in (self.shm_path, self.L.env_file(self.shm_path), self.L.wake_pipe(self.shm_path)):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def _mark(out, name):
    try:
        with open(os.path.join(out, name)) as fh:
            return fh.read().split(" ", 1)
    except OSError:
        return None


def _wait(predicate, timeout, interval=0.001):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return None


def watcher(how, init, block):
    """One rank blocked in `how`; the request 0.5 s into the block -> a dict of figures (ms)."""
    from ft_launcher.agent.ranks import inprocess_ranks
    from ft_launcher.rank_monitor import shm_layout as L

    directory = tempfile.mkdtemp(prefix="ft_gpu_live_", dir=L.default_shm_dir())
    out = os.path.join(directory, "out")
    os.mkdir(out)
    rec = RankRecord(os.path.join(directory, "rank.shm"))
    args = [sys.executable, BLOCKED, out, how, str(block)] + (["--nccl", "--init", init] if init else [])
    proc = subprocess.Popen(args, env=env(**{L.ENV_SHM: rec.shm_path, "FT_LAUNCHER_RESTART_GRANULARITY": "rank",
                                             "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                                             "TORCHELASTIC_RESTART_COUNT": "0"}),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    figures = {"how": how, "init": init or "-"}
    try:
        if not _wait(lambda: _mark(out, "blocked_0") or proc.poll() is not None, 120, 0.01) or proc.poll() is not None:
            figures["error"] = f"the rank did not block: {proc.communicate()[1][-800:]}"
            return figures
        time.sleep(0.5)
        rank = types.SimpleNamespace(exitcode=None, proc=proc, pid=proc.pid, local_rank=0)
        asked = time.monotonic_ns()
        inprocess_ranks.request(rec, rank, 1)
        reacted = _wait(lambda: _mark(out, "reacted_1"), block + 30)
        act = _wait(lambda: _mark(out, "act_0"), block + 60, 0.005)
        if not reacted or not act:
            figures["error"] = "no reaction"
            return figures
        last = json.loads(act[1])
        handler = _mark(out, "handler_0")
        unblocked = _mark(out, "unblocked_0")
        figures.update(
            watcher_ms=(int(reacted[0]) - asked) / 1e6,
            groups_before_abort=int(reacted[1].split()[1]),
            aborted_ms=(last["aborted"] - asked) / 1e6 if last.get("aborted") else None,
            main_left_ms=(int(handler[0]) - asked) / 1e6, main_left_by=handler[1],
            sync_returned_ms=(int(unblocked[0]) - asked) / 1e6 if unblocked else None,
            acted_by=last.get("by"), gpu_clean=last.get("clean"))
        ok = _wait(lambda: rec.words[L.H_IP_STATE] == L.IP_READY and rec.words[L.H_IP_SEEN] == 1, 60, 0.005)
        if ok:
            inprocess_ranks.go(rec, {"TORCHELASTIC_RESTART_COUNT": "1"}, 1)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        figures["restarted_in_place"] = bool(ok) and proc.returncode == 0 and os.path.exists(
            os.path.join(out, "done_cycle_1"))
        return figures
    finally:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate()
        if figures.get("error") or not figures.get("restarted_in_place"):
            figures["stderr_tail"] = err[-600:]
        rec.close()
        subprocess.run(["rm", "-rf", directory])


def show_watcher(f):
    if f.get("error"):
        print(f"  {f['how']:6} init={f['init']:20} ERROR {f['error']}")
        return
    aborted = f"{f['aborted_ms']:.1f} ms" if f["aborted_ms"] is not None else "nothing to abort"
    sync = f"{f['sync_returned_ms']:.0f} ms" if f["sync_returned_ms"] is not None else "never (aborted)"
    print(f"  {f['how']:6} init={f['init']:20} watcher acted {f['watcher_ms']:.2f} ms after the request; "
          f"communicators aborted {aborted} ({f['groups_before_abort']} group(s)); blocked call returned {sync}; "
          f"main thread left it at {f['main_left_ms']:.0f} ms ({f['main_left_by']}); GPU commits clean: "
          f"{f['gpu_clean']}; restarted in place: {f['restarted_in_place']}")
    if f.get("stderr_tail"):
        print("    rank stderr: " + f["stderr_tail"].replace("\n", "\n    "))


# ---- backends --------------------------------------------------------------------------------
_FORMS = r"""
import json, os, socket, sys
import torch, torch.distributed as dist
from ft_launcher.rank_monitor.rank_side import comm_backend
os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1")
gpu = torch.cuda.is_available()
if gpu:
    torch.cuda.set_device(0)
forms = ["none", "nccl", "cpu:gloo,cuda:nccl", "device_id", "nccl+device_id"] if gpu else ["none", "gloo", "cpu:gloo"]
for form in forms:
    s = socket.socket(); s.bind(("127.0.0.1", 0)); os.environ["MASTER_PORT"] = str(s.getsockname()[1]); s.close()
    try:
        if form == "none":
            dist.init_process_group()
        elif form == "device_id":
            dist.init_process_group(device_id=torch.device("cuda", 0))
        elif form == "nccl+device_id":
            dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
        else:
            dist.init_process_group(form)
        t = torch.ones(1, device="cuda" if gpu else "cpu")
        dist.all_reduce(t)
        row = {"form": form, "get_backend": str(dist.get_backend()), "backends": comm_backend.device_backends(),
               "nccl": comm_backend.has_nccl(), "transfer": str(comm_backend.transfer_device()),
               "old_check_said_nccl": str(dist.get_backend()) == "nccl"}
        dist.destroy_process_group()
    except Exception as exc:
        row = {"form": form, "error": repr(exc)[:300]}
    print(json.dumps(row), flush=True)
"""


def backends():
    res = subprocess.run([sys.executable, "-c", _FORMS], env=env(), cwd=ROOT, capture_output=True, text=True,
                         timeout=240)
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    if res.returncode != 0 and not rows:
        print(f"  ERROR: {res.stderr[-800:]}")
    for r in rows:
        if "error" in r:
            print(f"  {r['form']:20} ERROR {r['error']}")
        else:
            print(f"  {r['form']:20} get_backend()={r['get_backend']!r:24} real={r['backends']} nccl={r['nccl']} "
                  f"transfers on {r['transfer']}  (get_backend()=='nccl': {r['old_check_said_nccl']})")
    return rows


# ---- the GPU-complete commit -----------------------------------------------------------------
def commit_cost(steps):
    import torch

    from ft_launcher.rank_monitor.rank_side.gpu_commit import GpuCommits

    gpu = torch.cuda.is_available()
    if not gpu:
        class Fake:   # the logic's own cost, torch.cuda absent
            def ready(self):
                return True

            def new(self):
                return [False]

            def record(self, e):
                e[0] = True

            def done(self, e):
                return e[0]
        events = Fake()
    else:
        events = None
        torch.cuda.init()
    dev = "cuda" if gpu else "cpu"
    n = 4096 if gpu else 64   # a GPU step of a few ms; on the CPU a tiny one, so the logic's cost shows
    a = torch.randn(n, n, device=dev)
    b = torch.randn(n, n, device=dev)

    def loop(mode):
        commits = GpuCommits(events)
        counted = []
        if gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for step in range(1, steps + 1):
            c = a @ b
            c.add_(1.0)
            if mode == "event":
                commits.committed(step, counted.append)
            elif mode == "sync":
                if gpu:
                    torch.cuda.synchronize()
                counted.append(step)
            else:
                counted.append(step)
        issued = time.perf_counter() - t0
        lag = steps - (counted[-1] if counted else 0)
        if gpu:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / steps * 1e6, issued / steps * 1e6, lag

    loop("none")   # warm up
    rows = {}
    for rep in range(3):
        for mode in ("none", "event", "sync"):
            rows.setdefault(mode, []).append(loop(mode))
    med = {m: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v), max(r[2] for r in v))
           for m, v in rows.items()}
    print(f"  {'(CPU: fake events, the logic alone) ' if not gpu else ''}per step, {steps} steps of a {n}^2 matmul:")
    for mode, label in (("none", "no commit tracking"), ("event", "a CUDA event per commit (ours)"),
                        ("sync", "a host sync per commit")):
        wall, issue, lag = med[mode]
        print(f"    {label:34} {wall:9.1f} us/step wall, {issue:9.1f} us/step on the CPU; counted step lags by {lag}")
    extra = med["event"][1] - med["none"][1]
    print(f"    the event costs {extra:.2f} us of CPU per commit ({extra / med['none'][0] * 100:.3f} % of the step)")
    if gpu:   # a restart while the pending step's work cannot complete in the settle time
        commits = GpuCommits(None, settle_s=0.2)
        counted = []
        torch.cuda._sleep(int(2e9))
        commits.committed(1, counted.append)
        t0 = time.perf_counter()
        clean = commits.settle()
        took = time.perf_counter() - t0
        torch.cuda.synchronize()
        print(f"    a step queued behind ~1-2 s of GPU work at a restart: counted {counted or 'nothing'}, "
              f"settle said clean={clean} after {took:.3f} s (settle time 0.2 s), next restore suspect: "
              f"{not commits.finish()}")


# ---- recovery figures ------------------------------------------------------------------------
def exception_in_place(reps):
    from bench_jobs import Job

    out = []
    for _ in range(reps):
        job = Job("ft_launcher", 1, ["--max-restarts", "3", "--log-dir", "logs"],
                  ["--device", "cuda", "--steps", "100000", "--step-time", "0.05", "--ckpt-every", "5",
                   "--progress-dir", "progress", "--ckpt-dir", "ckpt", "--raise-on", "USR1", "--restartable"])
        ok = False
        try:
            job.wait_for(lambda: job.all_stepping(1, 0), 300, "the first step")
            job.wait_for(lambda: len(job.progress().get(0, [])) >= 12, 120, "12 steps")
            os.kill(job.rank_pid(0), signal.SIGUSR1)
            raised = os.path.join(job.dir, "progress", "raised_rank_0.txt")

            def read():
                try:
                    with open(raised) as fh:
                        return float(fh.read().strip())
                except (OSError, ValueError):
                    return None
            t0 = job.wait_for(read, 30, "the exception")
            back = job.wait_for(lambda: job.all_stepping(1, 1, after=t0), 120, "stepping again")
            out.append(back - t0)
            ok = True
        except RuntimeError as exc:
            print(f"    exception in place: did not recover: {exc}")
        finally:
            job.stop(keep_dir=not ok)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--no-recovery", action="store_true", help="skip the launcher recovery figures (GPU only)")
    p.add_argument("--block", type=float, default=3.0, help="seconds the main thread stays blocked (default 3)")
    p.add_argument("--reps", type=int, default=2, help="repetitions of each recovery figure (default 2)")
    args = p.parse_args()
    import torch

    gpu = torch.cuda.is_available()
    started = time.monotonic()
    if gpu:
        print(f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; NCCL "
              f"{'.'.join(map(str, torch.cuda.nccl.version()))}", flush=True)
    else:
        print(f"gpu_live_checks: no usable CUDA GPU here (torch {torch.__version__}): the CPU side of each path only",
              flush=True)
    print("\nwatcher: request -> acting while the main thread is blocked", flush=True)
    if gpu:
        for init in ("nccl", "cpu:gloo,cuda:nccl"):
            show_watcher(watcher("cuda", init, args.block))
    else:
        show_watcher(watcher("sleep", None, args.block))
    print("\nbackends: each init_process_group form", flush=True)
    backends()
    print("\ncommit: GPU-complete commit", flush=True)
    commit_cost(500 if gpu else 2000)
    if gpu and not args.no_recovery:
        print("\nrecovery: ft_launcher, 1 NCCL rank", flush=True)
        raised = exception_in_place(args.reps)
        if raised:
            print(f"  exception in place -> stepping: {', '.join(f'{x:.2f}' for x in raised)} s "
                  f"(median {statistics.median(raised):.2f} s; prior H100 0.84 s; goal <= 1.0 s)", flush=True)
        import gpu_recovery

        hangs = []
        for _ in range(args.reps):
            _, rec = gpu_recovery.run("ft_launcher", 1, "hang", {})
            if rec is not None:
                hangs.append(rec)
        if hangs:
            t = gpu_recovery.STEP_TIMEOUT
            print(f"  CUDA hang T={t:g} s -> stepping: {', '.join(f'{x:.2f}' for x in hangs)} s (median "
                  f"{statistics.median(hangs):.2f} s = T + {statistics.median(hangs) - t:.2f} s; prior H100 T + 0.92 s; "
                  f"goal <= T + 1 s)", flush=True)
    print(f"\ndone in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
