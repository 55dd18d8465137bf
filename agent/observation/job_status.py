"""What this node is doing now, for people and tools outside the job: the agent's status file, the
per-cycle `stepping` and `cycle_summary` events, and the snapshot the Prometheus endpoint serves.

Everything here is read by the agent from its monitors' shared-memory records (the words the rank
already writes on every section and heartbeat), between the agent's own waits: the rank's hot
path does nothing more for it.

- Status file: `<log dir>/status/<host>-<agent pid>.json`, rewritten (temp file + rename) about
  once a second while ranks run, and a last time with the agent's exit code. `ft_launcher status
  LOGDIR` reads these; under SLURM the log dir on a shared filesystem holds one per node. No log
  dir: the status file lives in the runtime dir below instead.
- Runtime dir: `<temp dir>/ft_launcher-jobs-<uid>/<host>-<agent pid>.json` (mode 0700), one entry
  per running agent of this user on this machine: a link to the log dir's status file, or the
  status file itself without a log dir. `ft_launcher status` with no argument reads it. The agent
  removes its entry when it exits; an entry whose agent is gone (SIGKILL) is removed by the reader.
- `stepping` (once per node and cycle): when every local rank has entered `step` for the first
  time in the cycle: each rank's first-step time, and `after_failure`, the seconds since this node
  first heard of the failure (a hang, failure or restart event) that ended the latest earlier cycle.
  Until then the agent samples every 20 ms (for the first 30 s of a cycle; then at its own
  `--monitor-interval`), so a first-step time is exact or late by at most one sample.
- `cycle_summary` (once per node and cycle, when it ends): per rank, the cycle's completed
  sections (count, total and max seconds), the first-step time, `at_checkpoint` (the `step`
  count and seconds as the rank's last `checkpointing` section closed normally, and how long that
  one took) and `checkpoint_unfinished` (the same for a `checkpointing` still open at the end, or
  left by an exception, and how long it lasted); the cycle's wall seconds. `ft_launcher report`
  computes goodput from these.

Goodput (here, in the status file and the Prometheus gauge; the report uses the same rule, see
kept_work): seconds in completed `step` sections that survived, over ranks x wall time. A cycle
that ends the job complete, or is still running, keeps all its steps; a cycle followed by a
restart (or ending a failed or stopped job) keeps only the steps done before the checkpoint it
resumes from (resume_point: the last `checkpointing` section a rank completed, or one a rank other
than the failure's had done its part of and was waiting in for its peers), since the job redoes
the rest; unless the
next cycle resumed from live state (agent.observation.live_recovery): then it keeps every step up to the resume
step (`live_step` in `cycle_summary`: each rank's last completed step under ft.LiveState). Hung
time, restarts and start-up never count (no `step` closes then).
"""
from __future__ import annotations

import json
import os
import socket
import time
from typing import Dict, Optional, Tuple

from ft_launcher.rank_monitor import atomic_file
from ft_launcher.rank_monitor.shm_layout import CHECKPOINT_SECTION as CHECKPOINT

STATUS_DIR = "status"
STEP = "step"
WRITE_EVERY = 1.0          # seconds between status-file rewrites while ranks run
FIRST_STEP_POLL = 0.02     # seconds between samples until every local rank has stepped ...
FIRST_STEP_FAST_FOR = 30.0  # ... within this long of the cycle's start (then at the agent's own pace)


def runtime_dir() -> str:
    """Where this user's running agents on this machine register (FT_LAUNCHER_RUNTIME_DIR overrides)."""
    import tempfile

    return os.environ.get("FT_LAUNCHER_RUNTIME_DIR") or os.path.join(
        tempfile.gettempdir(), f"ft_launcher-jobs-{os.getuid()}")


def mono_to_wall(ns: int, now_wall: float, now_ns: int) -> float:
    return now_wall - (now_ns - ns) / 1e9


def resume_point(ranks: Dict[int, dict], culprits=()) -> Tuple[int, Optional[str]]:
    """(steps, why) of the checkpoint a cycle that ended in a restart resumes from: the latest one
    a rank completed, its `checkpointing` section closed normally ({"at_checkpoint": {"steps",
    "step_total", "took"}}), or one a rank had done its part of: a rank other than the failure's
    (`culprits`) that was still in `checkpointing` when the cycle ended, or left it by an exception
    ({"checkpoint_unfinished": {"steps", "step_total", "for"}}), after twice its last completed
    checkpoint's time and a second more: it was waiting on its peers (a barrier, a collective),
    not saving. `why` says so for the latter, else None."""
    best, why = max([(r["at_checkpoint"]["steps"], None) for r in ranks.values() if r.get("at_checkpoint")],
                    default=(0, None), key=lambda m: m[0])
    for rank, r in sorted(ranks.items()):
        unfinished, took = r.get("checkpoint_unfinished"), (r.get("at_checkpoint") or {}).get("took")
        if not unfinished or rank in culprits or took is None or unfinished["steps"] <= best:
            continue
        if unfinished["for"] >= max(2 * took, took + 1.0):
            best = unfinished["steps"]
            why = (f"rank {rank} had been in its checkpointing section for {unfinished['for']:.1f} s, waiting on its "
                   f"peers (its last completed one took {took:.2f} s)")
    return best, why


def kept_work(ranks: Dict[int, dict], live_resume: Optional[int] = None, culprits=()) -> Dict[int, tuple]:
    """{rank: (steps kept, step seconds kept)} of a cycle that ended in a restart, from each rank's
    {"steps", "step_total", "at_checkpoint", "checkpoint_unfinished", "live_step"}. The job resumes
    at the cycle's resume point (resume_point); a rank whose own `checkpointing` began there keeps
    exactly its step time up to it, another rank (one that does not enter the section) keeps the
    same share of its steps at its mean step time. `live_resume`: the next cycle resumed from live
    state at this step; a rank keeps its steps up to it (those it completed after it, by its
    `live_step`, are redone) at its mean step time."""
    if live_resume is not None and live_resume >= 0:
        out = {}
        for rank, r in ranks.items():
            count, total = int(r.get("steps") or 0), float(r.get("step_total") or 0.0)
            live_step = r.get("live_step")
            redone = max(0, live_step - live_resume) if live_step is not None and live_step >= 0 else 0
            kept = max(0, count - redone)
            out[rank] = (kept, total * kept / count if count else 0.0)
        return out
    resume, _ = resume_point(ranks, culprits)
    out = {}
    for rank, r in ranks.items():
        count, total = int(r.get("steps") or 0), float(r.get("step_total") or 0.0)
        own = next((m for m in (r.get("at_checkpoint"), r.get("checkpoint_unfinished")) if m and m["steps"] == resume),
                   None)
        if own:
            out[rank] = (resume, float(own["step_total"]))
        else:
            kept = min(resume, count)
            out[rank] = (kept, total * kept / count if count else 0.0)
    return out


class JobStatus:
    def __init__(self, cfg, events):
        self.cfg = cfg
        self.events = events
        self.host = socket.gethostname()
        self.path = (os.path.join(cfg.log_dir, STATUS_DIR, f"{self.host}-{os.getpid()}.json")
                     if cfg.log_dir else None)
        self.registry = os.path.join(runtime_dir(), f"{self.host}-{os.getpid()}.json")
        self._registered = False
        self.started = time.time()
        self.state = "starting"
        self.cycle: Optional[int] = None
        self.node = None
        self.world_size = None
        self.nodes: list = []
        self.restarts_used = 0
        self.group = None
        self.monitors: list = []
        self.cycle_started = None
        self._first_step: Dict[int, float] = {}       # global rank -> wall time of its first step
        self._stepping_sent = False
        self._incidents: Dict[int, float] = {}         # cycle -> when this node first heard of its failure
        self._last_write = 0.0
        self._last_sample = 0.0
        self._ranks: list = []                        # last sampled rank rows
        self.past_sections: Dict[tuple, list] = {}    # (rank, section) -> [count, total] of ended cycles
        self.kept: Dict[int, float] = {}              # rank -> step seconds of ended cycles that survived
        self.redone: Dict[int, list] = {}             # rank -> [steps, seconds] redone after a restart
        self._tail: Dict[int, tuple] = {}             # the last ended cycle's steps after its checkpoint
        self._work: Dict[int, dict] = {}              # the last ended cycle's work (kept_work's input)
        self._work_cycle: Optional[int] = None
        self._culprits: Dict[Optional[int], set] = {}   # cycle -> ranks where its failure began (kept_work)
        self._live_pending = False                    # its tail waits for the next cycle's live restore
        self.snapshot: dict = {}                      # read by the metrics thread (replaced, never mutated)
        events.listeners.append(self._on_event)
        self._write()

    # ---- what the agent tells ---------------------------------------------------------------
    def _on_event(self, record: dict) -> None:
        if record["kind"] in ("failure", "restart", "hang") and record.get("cycle") is not None:
            self._incidents.setdefault(record["cycle"], record["time"])
        if record["kind"] == "failure" and record.get("rank") is not None:   # where a failure began
            self._culprits.setdefault(record.get("cycle"), set()).add(record["rank"])
        elif record["kind"] == "hang_blame":
            self._culprits.setdefault(record.get("cycle"), set()).update(record["detail"].get("culprits") or [])

    def on_state(self, state) -> None:
        """The node's state changed (agent.node_state): what `ft_launcher status` shows."""
        self.state = state.value
        self._write()

    def spare(self, cycle: int) -> None:
        self.cycle, self.group = cycle, None
        self._write()

    def cycle_start(self, rnd, restarts_used: int, group, monitors) -> None:
        self.cycle, self.node = rnd.number, rnd.group_rank
        self.world_size = rnd.world_size
        self.nodes = [n.label() for n in rnd.active] if rnd.members <= 256 else [f"{rnd.nnodes} nodes"]
        self.restarts_used, self.group, self.monitors = restarts_used, group, monitors
        self.cycle_started = time.time()
        self._first_step, self._stepping_sent = {}, False
        if not self._live_pending:   # live state: the ranks' restore says what survived (live_resumed)
            self._settle_tail(kept=False)  # a new cycle: the last one's steps after its checkpoint are redone
        self.sample(force=True)

    def poll_interval(self) -> Optional[float]:
        """How soon the agent should sample again: often until every local rank has stepped."""
        if self.group is None or self._stepping_sent or time.time() - self.cycle_started > FIRST_STEP_FAST_FOR:
            return None
        return FIRST_STEP_POLL

    def sample(self, force: bool = False) -> None:
        """Read every local rank's live record; emit `stepping` when due; rewrite the status file
        and the metrics snapshot about once a second."""
        group = self.group
        if group is None:
            return
        now = time.time()
        if not force and self._stepping_sent and now - self._last_sample < WRITE_EVERY:
            return
        now_ns = time.monotonic_ns()
        rows = []
        for rank in group.ranks:
            monitor = self.monitors[rank.local_rank] if rank.local_rank < len(self.monitors) else None
            live = monitor.live() if monitor is not None else None
            row = {"rank": rank.rank, "local_rank": rank.local_rank, "pid": rank.pid, "warm": rank.warm,
                   "in_place": rank.in_place,
                   "exitcode": rank.exitcode, "section": None, "in_section": None, "heartbeat_age": None,
                   "steps": 0, "sections": {}}
            if live:
                if live["open"]:
                    name, enter_ns = live["open"][-1]
                    row["section"], row["in_section"] = name, round(max(0, now_ns - enter_ns) / 1e9, 3)
                if live["hb_last_ns"]:
                    row["heartbeat_age"] = round(max(0, now_ns - live["hb_last_ns"]) / 1e9, 3)
                row["sections"] = {k: {"count": v["closes"], "total": round(v["total"], 6), "max": round(v["max"], 6)}
                                   for k, v in live["sections"].items()}
                ckpt = live["sections"].get(CHECKPOINT) or {}
                at = ckpt.get("at_close")
                if at and ckpt["closes"]:
                    row["at_checkpoint"] = {"steps": at["steps"], "step_total": round(at["step_total"], 6),
                                            "took": round(at["took"], 6)}
                unfinished = self._unfinished_checkpoint(live, ckpt, now_ns)
                if unfinished:
                    row["checkpoint_unfinished"] = unfinished
                if live.get("live_step", -1) >= 0:
                    row["live_step"] = live["live_step"]
                step = live["sections"].get(STEP)
                if step:
                    row["steps"] = step["closes"]
                    if step["enters"] and rank.rank not in self._first_step:
                        # exact when this is its only step so far; else it began after the last sample
                        at = (mono_to_wall(step["enter_ns"], now, now_ns) if step["enters"] == 1
                              else self._last_sample or now)
                        self._first_step[rank.rank] = at
            rows.append(row)
        self._last_sample = now
        self._ranks = rows
        if not self._stepping_sent and group.ranks and len(self._first_step) == len(group.ranks):
            self._stepping_sent = True
            last = max(self._first_step.values())
            detail = {"first_step": {str(r): round(t, 6) for r, t in sorted(self._first_step.items())},
                      "last_first_step": round(last, 6),
                      "after_start": round(last - self.cycle_started, 3)}
            before = [c for c in self._incidents if self.cycle is not None and c < self.cycle]
            if before:  # the failure that ended the cycle before this one
                detail["after_failure"] = round(last - self._incidents[max(before)], 3)
                self._incidents.clear()
            self.events.event("stepping", None, **detail)
        if force or now - self._last_write >= WRITE_EVERY:
            self._write()

    @staticmethod
    def _unfinished_checkpoint(live: dict, ckpt: dict, now_ns: int) -> Optional[dict]:
        """The rank's latest `checkpointing` occurrence when it is still open or ended in an
        exception: the `step` work before it and how long it lasted (resume_point weighs it)."""
        step = live["sections"].get(STEP) or {"closes": 0, "total": 0.0}
        if ckpt.get("open"):
            return {"steps": step["closes"], "step_total": round(step["total"], 6),
                    "for": round(max(0, now_ns - ckpt["enter_ns"]) / 1e9, 3), "ended": "open"}
        raised = ckpt.get("raised")
        if raised:
            return {"steps": raised["steps"], "step_total": round(raised["step_total"], 6),
                    "for": round(raised["took"], 3), "ended": "raised"}
        return None

    def cycle_end(self) -> None:
        """Before the monitors forget the cycle: its per-rank section totals as one event."""
        if self.group is None:
            return
        self.sample(force=True)
        if self._live_pending:   # no live restore was told in this cycle: the checkpoint's rule
            self._settle_tail(kept=False)
        ranks = {}
        for row in self._ranks:
            entry = {"sections": row["sections"]}
            if row["rank"] in self._first_step:
                entry["first_step"] = round(self._first_step[row["rank"]], 6)
            if row.get("at_checkpoint"):
                entry["at_checkpoint"] = row["at_checkpoint"]
            if row.get("checkpoint_unfinished"):
                entry["checkpoint_unfinished"] = row["checkpoint_unfinished"]
            if row.get("live_step") is not None:
                entry["live_step"] = row["live_step"]
            ranks[str(row["rank"])] = entry
            for name, stats in row["sections"].items():
                acc = self.past_sections.setdefault((row["rank"], name), [0, 0.0])
                acc[0] += stats["count"]
                acc[1] += stats["total"]
        self._end_cycle_work()
        self.events.event("cycle_summary", None, wall=round(time.time() - self.cycle_started, 3),
                          started=round(self.cycle_started, 6), ranks=ranks)
        self.group, self._ranks = None, []
        self._write()

    def _end_cycle_work(self) -> None:
        """Split the ending cycle's step time: up to the checkpoint it survives; the rest waits in
        _tail until the job completes (kept) or restarts (redone)."""
        work = {}
        for row in self._ranks:
            step = row["sections"].get(STEP) or {}
            work[row["rank"]] = {"steps": step.get("count", 0), "step_total": step.get("total", 0.0),
                                 "at_checkpoint": row.get("at_checkpoint"),
                                 "checkpoint_unfinished": row.get("checkpoint_unfinished"),
                                 "live_step": row.get("live_step")}
        self._work, self._work_cycle = work, self.cycle
        self._live_pending = any(w["live_step"] is not None for w in work.values())
        culprits = self._culprits.get(self.cycle, set())
        for rank, (steps, seconds) in kept_work(work, culprits=culprits).items():
            self.kept[rank] = self.kept.get(rank, 0.0) + seconds
            self._tail[rank] = (work[rank]["steps"] - steps, max(0.0, work[rank]["step_total"] - seconds))

    def live_resumed(self, resume: int) -> None:
        """This cycle's ranks resumed from live state at step `resume` (-1: from the checkpoint):
        the last ended cycle keeps its steps up to there (kept_work); the rest is redone."""
        if not self._live_pending:
            return
        if resume >= 0:
            ckpt = kept_work(self._work, culprits=self._culprits.get(self._work_cycle, set()))
            for rank, (steps, seconds) in kept_work(self._work, resume).items():
                extra_steps, extra = steps - ckpt[rank][0], max(0.0, seconds - ckpt[rank][1])
                self.kept[rank] = self.kept.get(rank, 0.0) + extra
                tail_steps, tail_seconds = self._tail.get(rank, (0, 0.0))
                self._tail[rank] = (max(0, tail_steps - extra_steps), max(0.0, tail_seconds - extra))
        self._settle_tail(kept=False)

    def _settle_tail(self, kept: bool) -> None:
        self._live_pending = False
        for rank, (steps, seconds) in self._tail.items():
            if kept:
                self.kept[rank] = self.kept.get(rank, 0.0) + seconds
            else:
                acc = self.redone.setdefault(rank, [0, 0.0])
                acc[0] += steps
                acc[1] += seconds
        self._tail = {}

    def finish(self, code: int) -> None:
        self._settle_tail(kept=code == 0)  # a complete job keeps its last cycle's every step
        self.state, self.group = "finished", None
        self._write(exit_code=code)
        try:   # a finished job is read from its log dir; the runtime dir lists running agents only
            os.unlink(self.registry)
            os.rmdir(os.path.dirname(self.registry))   # the last agent leaves no empty dir behind
        except OSError:
            pass

    def _register(self) -> None:
        """Link this agent's status file into the runtime dir (once)."""
        self._registered = True
        for _ in range(3):   # another agent may remove the dir as it leaves, between our two calls
            try:
                os.makedirs(os.path.dirname(self.registry), mode=0o700, exist_ok=True)
                if self.path:
                    os.symlink(self.path, self.registry)
                return
            except FileNotFoundError:
                continue
            except OSError:
                return

    # ---- views ----------------------------------------------------------------------------
    def step_seconds(self) -> Dict[int, float]:
        """Per local rank of this node: seconds in completed `step` sections over the job so far."""
        out = {rank: acc[1] for (rank, name), acc in self.past_sections.items() if name == STEP}
        for row in self._ranks:
            step = row["sections"].get(STEP)
            if step:
                out[row["rank"]] = out.get(row["rank"], 0.0) + step["total"]
        return out

    def useful_step_seconds(self) -> Dict[int, float]:
        """Per local rank: seconds in `step` that survived (the goodput rule in the docstring):
        kept steps of ended cycles, the last ended cycle's steps after its checkpoint until a
        restart says they are redone, and every completed step of the running cycle."""
        out = dict(self.kept)
        for rank, (_, seconds) in self._tail.items():
            out[rank] = out.get(rank, 0.0) + seconds
        for row in self._ranks:
            step = row["sections"].get(STEP)
            if step:
                out[row["rank"]] = out.get(row["rank"], 0.0) + step["total"]
        return out

    def section_totals(self) -> list:
        """[{rank, section, count, total}] over the job so far: ended cycles plus the running one."""
        acc = {key: list(value) for key, value in self.past_sections.items()}
        for row in self._ranks:
            for name, stats in row["sections"].items():
                entry = acc.setdefault((row["rank"], name), [0, 0.0])
                entry[0] += stats["count"]
                entry[1] += stats["total"]
        return [{"rank": r, "section": n, "count": c, "total": round(t, 6)} for (r, n), (c, t) in sorted(acc.items())]

    def _timeouts(self) -> dict:
        ft = self.cfg.ft
        return {"sections": dict(ft.rank_section_timeouts), "out_of_section": ft.rank_out_of_section_timeout,
                "heartbeat_initial": ft.initial_rank_heartbeat_timeout, "heartbeat": ft.rank_heartbeat_timeout}

    def _write(self, exit_code: Optional[int] = None) -> None:
        now = time.time()
        self._last_write = now
        steps = self.useful_step_seconds()
        wall = max(1e-9, now - self.started)
        data = {
            "format": 1, "time": round(now, 3), "host": self.host, "pid": os.getpid(),
            "rdzv_id": self.cfg.rdzv_id, "started": round(self.started, 3), "state": self.state,
            "exit_code": exit_code, "node": self.node, "nodes": self.nodes, "world_size": self.world_size,
            "nproc_per_node": self.cfg.nproc_per_node, "cycle": self.cycle,
            "cycle_started": self.cycle_started, "restarts_used": self.restarts_used,
            "max_restarts": self.cfg.max_restarts, "timeouts": self._timeouts(), "ranks": self._ranks,
            "goodput": round(sum(steps.values()) / (len(steps) * wall), 4) if steps else 0.0,
            "useful_step_seconds": {str(r): round(v, 6) for r, v in sorted(steps.items())},
            "redone_steps": {str(r): {"steps": v[0], "seconds": round(v[1], 6)} for r, v in sorted(self.redone.items())},
            "metrics_port": getattr(self.cfg, "metrics_port", None),
            "section_totals": self.section_totals(),
        }
        self.snapshot = data
        if not self._registered and self.state != "finished":
            self._register()
        path = self.path or (self.registry if self.state != "finished" else None)
        if not path:
            return
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            atomic_file.write(path, json.dumps(data))
        except OSError as exc:
            self.events.disk_warning(f"cannot write the status file {path}", exc)
