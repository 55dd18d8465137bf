"""Live recovery, the agent side: what a cycle's `LiveState.restore()` did (rank_monitor.rank_side.live.live_state),
read from the ranks' records (shm_layout H_LIVE_*), told once per incident.

Every rank writes its resume step and source; global rank 0 also writes the whole job's summary
(rank_monitor.live_summary: the LiveState's name, resume step, completed steps redone, each
source's ranks as ranges, counts, bytes moved, transfer seconds and MB/s, the replicas' digest
check, or why there was no live state). The agent of the
node holding global rank 0 says it as one `live_recovery` event and one console line, readable at
any world size (at most LINE_SOURCES sources named, each with at most RANGES_SHOWN rank ranges);
every agent gives its ranks' resume step to goodput (agent.observation.job_status: the steps up to
it survived the restart).
"""
from __future__ import annotations

from typing import Dict, List, Optional

from ft_launcher.rank_monitor import live_summary as S
from ft_launcher.rank_monitor import shm_layout as L

LINE_SOURCES = 6   # sources a console line names; the rest are counted
RANGES_SHOWN = 4   # rank ranges shown per source; the rest are counted


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
    return S.decode(L.read_live_text(*rec).encode("utf-8", "replace"))


def per_rank(sources: Dict[str, str]) -> Dict[str, str]:
    """A summary's `sources` ({"kept": "0-2", "peer 1": "3"}) by rank: {"0": "kept", ..., "3": "peer 1"}."""
    return {str(r): name for name, text in (sources or {}).items() for r in S.parse_ranges(text)}


def _ranks_words(text: str) -> str:
    parts = [p for p in (text or "").split(",") if p]
    n = len(S.parse_ranges(text))
    shown = ", ".join(parts[:RANGES_SHOWN]) + (f", ... ({n} ranks)" if len(parts) > RANGES_SHOWN else "")
    return f"rank{'s' if n != 1 else ''} {shown}"


def source_words(sources: dict, kept: bool = True) -> str:
    """'ranks 0-2 kept, rank 3 from peer rank 1': who got its state from where (`kept`: False leaves
    out the ranks that kept theirs); past LINE_SOURCES sources the rest are counted."""
    items = [(name, text) for name, text in sorted((sources or {}).items(), key=S.source_order)
             if kept or name != S.KEPT]
    words: List[str] = []
    for name, text in items[:LINE_SOURCES]:
        kind, _, holder = name.partition(" ")
        how = ("kept" if name == S.KEPT else "from disk" if name == S.DISK
               else "from its host copy" if name == S.HOST_COPY
               else f"from {kind} rank {holder}" if holder else {S.BUDDY: "from buddies"}.get(kind, f"from {kind}s"))
        words.append(f"{_ranks_words(text)} {how}")
    rest = items[LINE_SOURCES:]
    if rest:
        n = sum(len(S.parse_ranges(text)) for _, text in rest)
        words.append(f"{n} more rank{'s' if n != 1 else ''} from {len(rest)} other source{'s' if len(rest) != 1 else ''}")
    return ", ".join(words)


def line(s: dict) -> str:
    """The console line of one summary."""
    if s.get("resume_step") is None:
        return f"live recovery: no live state ({s.get('reason')}): every rank loads its checkpoint"
    sources = source_words(s.get("sources"))
    if not sources:
        c = s.get("counts") or {}
        sources = f"{c.get('kept', 0)} ranks kept, {c.get('peer', 0)} from peers, {c.get('disk', 0)} from disk"
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
            rank0 = monitors[0] if monitors else None
            told = summary(rank0, self._cycle)
            if told is None:
                rec = rank0.record() if rank0 is not None else None
                if rec is None or rec[1][L.H_LIVE_CYCLE] != self._cycle:
                    return   # rank 0 writes its summary before its words: a moment later
                told = {"resume_step": None if resume < 0 else resume, "sources": {},
                        "reason": "global rank 0's summary could not be read"}
        self._told = True
        self.status.live_resumed(resume)
        if told is not None:
            self.events.say(line(told))
            told.pop("cycle", None)
            self.events.event("live_recovery", None, **told)
