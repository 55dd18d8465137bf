"""Live recovery, the agent side: what a cycle's `LiveState.restore()` did (rank_monitor.rank_side.live_state),
read from the ranks' records (shm_layout H_LIVE_*), told once per incident.

Every rank writes its resume step and source; global rank 0 also writes the whole job's summary
(JSON: the LiveState's name, resume step, completed steps redone, each rank's source, bytes moved,
transfer seconds and MB/s, the replicas' digest check, or why there was no live state). The agent of the node holding global rank 0 says it as one
`live_recovery` event and one console line; every agent gives its ranks' resume step to goodput
(agent.observation.job_status: the steps up to it survived the restart).
"""
from __future__ import annotations

import json
from typing import Optional

from ft_launcher.rank_monitor import shm_layout as L


def resume_step(monitors: list, cycle: int) -> Optional[int]:
    """The step this cycle resumed at from live state (-1: the checkpoint), once a local rank's
    restore said so; None before (or when the ranks use no live state)."""
    for monitor in monitors:
        rec = monitor.record() if monitor is not None else None
        if rec is not None and cycle > 0 and rec[1][L.H_LIVE_CYCLE] == cycle:
            return rec[1][L.H_LIVE_RESUME] - 1
    return None


def summary(monitor, cycle: int) -> Optional[dict]:
    """Global rank 0's summary of this cycle's restore, or None before it wrote one."""
    rec = monitor.record() if monitor is not None else None
    if rec is None or cycle == 0 or rec[1][L.H_LIVE_CYCLE] != cycle:
        return None
    try:
        return json.loads(L.read_live_text(*rec))
    except ValueError:
        return None


def source_words(sources: dict, kept: bool = True) -> str:
    """'rank 0 kept, rank 3 from peer rank 0, rank 2 from buddy rank 1, rank 1 from its host copy':
    each rank's source by rank (`kept`: False leaves out the ranks that kept their state)."""
    def words(v: str) -> str:
        if v == "kept":
            return "kept"
        if v == "host copy":
            return "from its host copy"
        return "from " + v.replace("peer", "peer rank").replace("buddy", "buddy rank")

    return ", ".join(f"rank {r} {words(v)}" for r, v in sorted((sources or {}).items(), key=lambda kv: int(kv[0]))
                     if kept or v != "kept")


def line(s: dict) -> str:
    """The console line of one summary."""
    if s.get("resume_step") is None:
        return f"live recovery: no live state ({s.get('reason')}): every rank loads its checkpoint"
    sources = source_words(s.get("sources"))
    moved = ""
    if s.get("bytes"):
        moved = f"; {s['bytes'] / 1e6:.2f} MB in {s['transfer_s']:.3f} s"
        if s.get("mb_per_s"):
            moved += f" ({s['mb_per_s']:g} MB/s)"
    check = s.get("check") or {}
    checked = f"; replicas agree ({check['bytes'] / 1e6:.2f} MB compared in {check['s']:.3f} s)" if check else ""
    return (f"live recovery: resumed at step {s['resume_step']} ({s.get('steps_redone', 0)} completed step(s) "
            f"redone, plus the step in flight); {sources}{moved}; restore {s.get('restore_s', 0):.3f} s{checked}")


class News:
    """The agent's part: once per cycle, when the ranks' restore() has said where they resume,
    goodput keeps the steps up to there (`status.live_resumed`) and the node of global rank 0 says
    the job's recovery (its line and a `live_recovery` event)."""

    def __init__(self, status, events) -> None:
        self.status = status
        self.events = events
        self._cycle, self._rank_offset, self._told = 0, 0, True

    def begin_cycle(self, cycle: int, rank_offset: int) -> None:
        self._cycle, self._rank_offset, self._told = cycle, rank_offset, cycle == 0

    def poll(self, monitors: list) -> None:
        if self._told:
            return
        resume = resume_step(monitors, self._cycle)
        if resume is None:
            return
        told = None
        if self._rank_offset == 0:
            told = summary(monitors[0] if monitors else None, self._cycle)
            if told is None:
                return   # rank 0 writes its summary before its words: a moment later
        self._told = True
        self.status.live_resumed(resume)
        if told is not None:
            self.events.say(line(told))
            told.pop("cycle", None)
            self.events.event("live_recovery", None, **told)
