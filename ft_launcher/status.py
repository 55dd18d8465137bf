"""`ft_launcher status [LOGDIR...]`: what a job is doing now, from the status files its agents keep
in their log dirs (`<log dir>/status/<host>-<pid>.json`, rewritten about once a second; see
agent.observation.job_status). Under SLURM the log dir is on a shared filesystem, so any login node can read
every node's file; with one log dir per node, name them all.

With no LOGDIR it shows every job this user runs on this machine: each running agent registers in
a per-user runtime dir (agent.observation.job_status.runtime_dir: a link to its log dir's status file, or the
file itself when the job has no --log-dir); entries of agents that are gone are removed. With none
running, it reads the current dir as a log dir.

Prints the job (nodes, ranks, cycle, restarts used of the budget, timeouts in effect) and one line
per rank: node, host, pid, its innermost open section and the time in it, the time since its last
heartbeat, steps completed in this cycle. An agent that did not finish but whose process is gone
(its host is this one and its pid runs no more, or runs a process started after the agent: the
pid was reused) is shown as gone, with when it was last heard from, in its rows and in one line
each; a job whose unfinished agents are all gone is not called running. An agent on another
host cannot be checked: past STALE_AFTER seconds without an update it is marked as silent, and a
job whose unfinished agents are all silent says it was not heard from. Exit 0 when a job was
shown (running, finished or gone), 1 when the dirs hold no status file (no job with a --log-dir
there), 2 for a missing dir.
"""
from __future__ import annotations

import glob
import json
import os
import socket
import sys
import time
from typing import List, Optional, Sequence

PROG = "ft_launcher status"
STALE_AFTER = 10.0  # seconds without an update before a running agent is marked as silent


class StatusError(Exception):
    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def read_status_files(dirs: Sequence[str]) -> List[dict]:
    """Every agent's latest status in `dirs`, newest job only (older runs in the same dir left out)."""
    found = []
    for d in dirs:
        if not os.path.isdir(d):
            raise StatusError(f"log dir not found: {d}")
        for path in sorted(glob.glob(os.path.join(d, "status", "*.json"))):
            try:
                with open(path) as fh:
                    data = json.load(fh)
                if isinstance(data, dict) and "time" in data:
                    data["_path"] = path
                    found.append(data)
            except (OSError, ValueError):
                continue  # mid-rename or not ours: the next read sees it
    if not found:
        raise StatusError(f"no job found in {', '.join(dirs)} (no status/*.json: was the job started with "
                          f"--log-dir there?)", code=1)
    newest = max(d.get("started", 0) for d in found)
    return [d for d in found if d["time"] >= newest - 1.0]


def running_jobs() -> List[List[dict]]:
    """This user's running agents on this machine, grouped by job (newest first)."""
    from ft_launcher.agent.observation.job_status import runtime_dir

    jobs: dict = {}
    for path in sorted(glob.glob(os.path.join(runtime_dir(), "*.json"))):
        pid = os.path.basename(path)[:-len(".json")].rpartition("-")[2]
        if pid.isdigit() and not _alive(int(pid)):
            try:   # the agent was killed before it could remove its entry
                os.unlink(path)
            except OSError:
                pass
            continue
        try:
            with open(path) as fh:
                data = json.load(fh)
        except (OSError, ValueError):
            continue   # mid-rename, or the log dir is gone
        if isinstance(data, dict) and "time" in data:
            data["_path"] = os.path.realpath(path)
            jobs.setdefault(data.get("rdzv_id"), []).append(data)
    return sorted(jobs.values(), key=lambda agents: -max(a.get("started", 0) for a in agents))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _started_at(pid: int) -> Optional[float]:
    """When process `pid` started (epoch seconds, from /proc), or None where that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            ticks = int(fh.read().rpartition(")")[2].split()[19])   # field 22, starttime
        with open("/proc/stat") as fh:
            boot = next(int(line.split()[1]) for line in fh if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def agent_gone(a: dict, here: str) -> bool:
    """The agent of status `a` did not finish and its process is known to be gone: it ran on this
    host (`here`) and its pid runs no more, or runs a process started after the agent (reused)."""
    pid = a.get("pid")
    if a.get("state") == "finished" or a.get("host") != here or not isinstance(pid, int):
        return False
    if not _alive(pid):
        return True
    started = _started_at(pid)
    return started is not None and started > float(a.get("started") or 0) + 1.0


def _heard(a: dict, now: float) -> str:
    return f"last heard from {now - a['time']:.0f}s ago, at {time.strftime('%H:%M:%S', time.localtime(a['time']))}"


def _secs(value) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}s" if value < 100 else f"{value:.0f}s"


def _timeout(value) -> str:
    return "none" if value is None else f"{value:g}s"


def render(agents: List[dict], now: Optional[float] = None) -> str:
    now = time.time() if now is None else now
    agents = sorted(agents, key=lambda a: (a.get("node") is None, a.get("node") or 0, a.get("host", "")))
    here = socket.gethostname()
    gone = [a for a in agents if agent_gone(a, here)]
    lead = next((a for a in agents if a.get("state") == "running" and a not in gone), agents[0])
    ranks = sum(len(a.get("ranks") or []) for a in agents)
    running = [a for a in agents if a.get("state") not in ("finished",) and a not in gone]
    if running and all(now - a["time"] > STALE_AFTER for a in running):
        state = f"not heard from for {min(now - a['time'] for a in running):.0f}s (its agents may be gone)"
    elif running:
        state = "running"
    elif gone:
        state = (f"gone: its agent{'s' if len(gone) > 1 else ''} ended without finishing; "
                 f"{_heard(max(gone, key=lambda a: a['time']), now)}")
        running = gone   # the header of a job that was running: its cycle, goodput so far
    else:
        codes = sorted({a.get("exit_code") for a in agents}, key=str)
        state = "finished (exit code " + ", ".join(str(c) for c in codes) + ")"
    cycles = sorted({a["cycle"] for a in agents if a.get("cycle") is not None})
    out = [f"job {lead.get('rdzv_id')!r}: {state}; {len(agents)} agent(s), "
           f"{lead.get('world_size') or ranks} rank(s); cycle {', '.join(map(str, cycles)) or '-'}; "
           f"restarts used {max(a.get('restarts_used', 0) for a in agents)}/{lead.get('max_restarts')}; "
           f"goodput so far {min(a.get('goodput', 0) for a in agents) * 100:.0f}%"
           if running else
           f"job {lead.get('rdzv_id')!r}: {state}; {len(agents)} agent(s); last cycle "
           f"{', '.join(map(str, cycles)) or '-'}; restarts used {max(a.get('restarts_used', 0) for a in agents)}/"
           f"{lead.get('max_restarts')}"]
    for a in gone:
        out.append(f"agent gone: node {a.get('node', '-')} on {a.get('host')} (pid {a.get('pid')} no longer runs); "
                   f"{_heard(a, now)}")
    t = lead.get("timeouts") or {}
    sections = ", ".join(f"{k} {_timeout(v)}" for k, v in (t.get("sections") or {}).items()) or "none"
    out.append(f"timeouts: sections {sections}; out of section {_timeout(t.get('out_of_section'))}; "
               f"heartbeat {_timeout(t.get('heartbeat'))} (first {_timeout(t.get('heartbeat_initial'))})")
    out.append(f"{'node':<5} {'host (agent pid)':<28} {'state':<10} {'rank':>4} {'pid':>8}  {'section':<16} "
               f"{'in it':>8} {'heartbeat':>10} {'steps':>6}")
    for a in agents:
        node = "spare" if a.get("state") == "spare" else ("-" if a.get("node") is None else str(a["node"]))
        who = f"{a.get('host')} ({a.get('pid')})"
        age = now - a["time"]
        agent_state = (f"gone, last heard {age:.0f}s ago" if a in gone else a.get("state", "?")
                       + (f", silent {age:.0f}s" if age > STALE_AFTER and a.get("state") != "finished" else ""))
        rows = a.get("ranks") or []
        if not rows:
            out.append(f"{node:<5} {who:<28} {agent_state:<10}")
        for r in rows:
            section = r.get("section") or ("(exited)" if r.get("exitcode") is not None else "(none)")
            out.append(f"{node:<5} {who:<28} {agent_state:<10} {r['rank']:>4} {r['pid']:>8}  {section:<16} "
                       f"{_secs(r.get('in_section')):>8} {_secs(r.get('heartbeat_age')):>10} {r.get('steps', 0):>6}")
    oldest = max(now - a["time"] for a in agents)
    out.append(f"(status files updated {oldest:.1f}s ago at most; {', '.join(sorted({os.path.dirname(a['_path']) for a in agents}))})")
    return "\n".join(out)


def main(argv: Sequence[str]) -> int:
    from ft_launcher.flags import UsageError, _Parser

    parser = _Parser(prog=PROG, description="What a job is doing, from its agents' status files: with no "
                     "LOGDIR, every job this user runs on this machine (with or without --log-dir); with LOGDIR, "
                     "the job run with that --log-dir (<log dir>/status/*.json), running or finished.")
    parser.add_argument("log_dirs", nargs="*", metavar="LOGDIR",
                        help="the job's --log-dir (several: one per node); default: every job this user "
                             "runs on this machine, else the current dir")
    try:
        args = parser.parse_args(list(argv))
        if not args.log_dirs:
            jobs = running_jobs()
            if jobs:
                print("\n\n".join(render(agents) for agents in jobs))
                return 0
            if not glob.glob(os.path.join("status", "*.json")):
                raise StatusError("no running job of this user on this machine, and no status/*.json in the "
                                  "current dir (ft_launcher status LOGDIR reads a job's --log-dir)", code=1)
            args.log_dirs = ["."]
        print(render(read_status_files(args.log_dirs)))
        return 0
    except UsageError as exc:
        print(f"ft_launcher: error: {exc}", file=sys.stderr)
        return 2
    except StatusError as exc:
        print(f"ft_launcher: error: {exc}", file=sys.stderr)
        return exc.code
