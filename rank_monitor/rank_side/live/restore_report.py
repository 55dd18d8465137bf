"""What a restore says (step 8 of `LiveState.restore`, rank_side.live.live_state): the job's summary
(rank_monitor.live_summary: compact at any world size), which global rank 0 writes for the agent
with the fallback's one line, and every rank's live words in its record (resume step, source), the
cycle last: the agent reads them once it sees it (agent.observation.live_recovery).
"""
from __future__ import annotations

import sys
from typing import List, Optional

from ft_launcher.rank_monitor import live_summary
from ft_launcher.rank_monitor import shm_layout as L
from ft_launcher.rank_monitor.rank_side import inprocess
from ft_launcher.rank_monitor.rank_side.live import buddy_copy
from ft_launcher.rank_monitor.rank_side.live.live_plan import Plan
from ft_launcher.rank_monitor.rank_side.live.step_exchange import Row


def summary(name: str, cycle: int, plan: Plan, rows: List[Row], stats: list, check: Optional[dict],
            reason: str) -> dict:
    """The job's summary of this restore of LiveState `name` (rows: the step exchange's; stats: the
    last all_gather's, per rank bytes received, transfer and restore nanoseconds)."""
    world = len(rows)
    raw = max(r.raw for r in rows)
    sources = [source_name(plan, r) for r in range(world)]
    return live_summary.build(cycle, plan.resume, None if plan.resume is None else max(0, raw - plan.resume),
                              sources, sum(int(s[0]) for s in stats), max(int(s[1]) for s in stats) / 1e9,
                              max(int(s[2]) for s in stats) / 1e9, reason, name=name, check=check)


def say(mm, words, cycle: int, plan: Plan, made: dict, reason: str, rank: int) -> None:
    """The restore said: rank 0 writes the summary `made` (and the fallback's line); every rank's
    live words in its record (resume step, source), the cycle last: the agent reads them once it
    sees it."""
    if rank == 0:
        if plan.resume is None:
            print(f"ft_launcher: no live state to resume from ({reason}): every rank loads its checkpoint",
                  file=sys.stderr, flush=True)
        live_summary.write(mm, words, made)
    words[L.H_LIVE_RESUME] = 0 if plan.resume is None else plan.resume + 1
    src = plan.sources[rank]
    words[L.H_LIVE_SOURCE] = (L.LIVE_DISK if src is None else L.LIVE_KEPT if plan.kept(rank)
                              else (L.LIVE_HOST_COPY if src.holder == rank else L.LIVE_BUDDY - src.holder)
                              if buddy_copy.is_copy(src) else L.LIVE_PEER + src.holder)
    words[L.H_LIVE_CYCLE] = cycle   # last: the agent reads the words above once it sees this
    if rank == 0:
        inprocess._wake_agent()


def source_name(plan: Plan, r: int) -> str:
    """Where rank `r` resumes from, in the summary's words."""
    src = plan.sources[r]
    if src is None:
        return "disk"
    if plan.kept(r):
        return "kept"
    return buddy_copy.source_name(r, src) if buddy_copy.is_copy(src) else f"peer {src.holder}"
