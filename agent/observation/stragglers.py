"""Stragglers from section timings: no profiler, no cost to the ranks, works on CPU.

The monitors already keep, per rank, the count and total time of every section in shared memory.
Every `straggler_window` seconds each agent turns the change since its last look into each of its
ranks' mean time in `straggler_section` (default `step`) over the window, and publishes them as
one small key per node (`r<N>/strag/<group rank>`). The agent of node 0 compares every rank's
mean with the median of the other ranks' means; a rank above `straggler_threshold` x that median
for `straggler_windows` windows in a row is reported once per cycle: a `straggler` event and one
line naming the rank, its node and the ratio. With `straggler_exclude`, the report is also kept in
the store (`slow/<node_id>`): the next restart leaves that node out when a hot spare can take its
place (agent.agent reads it when it decides the verdict; agent.recovery.no_restart does the leaving).

A job that synchronises every step (DDP's all-reduce) spends a slow rank's delay waiting in its
peers' own steps, so every rank's `step` looks alike there: time a section that holds only the
rank's own work (data loading, forward) and name it in `straggler_section`.
"""
from __future__ import annotations

import json
import time
from typing import Dict, Optional, Tuple

from ft_launcher.agent.rounds import store_keys


def mean_over_window(prev: Optional[Tuple[int, float]], now: Tuple[int, float]) -> Optional[float]:
    """Mean section time between two (count, total seconds) snapshots of one rank."""
    if prev is None or now[0] < prev[0]:   # no earlier look, or a new incarnation
        return None
    done = now[0] - prev[0]
    return (now[1] - prev[1]) / done if done > 0 else None


def slow_ranks(means: Dict[int, float], threshold: float) -> Dict[int, Tuple[float, float]]:
    """{rank: (ratio, median of the others)} for the ranks slower than threshold x that median."""
    out: Dict[int, Tuple[float, float]] = {}
    if len(means) < 2:
        return out
    import statistics   # here: a job without stragglers to judge never loads it (fractions, decimal)

    for rank, mean in means.items():
        others = [m for r, m in means.items() if r != rank]
        median = statistics.median(others)
        if median > 0 and mean / median > threshold:
            out[rank] = (mean / median, median)
    return out


class StragglerWatch:
    def __init__(self, ft, events):
        self.ft = ft
        self.events = events
        self.enabled = ft.straggler_window > 0
        self._cycle: Optional[int] = None
        self._next = 0.0
        self._snap: Dict[int, Tuple[int, float]] = {}
        self._streak: Dict[int, int] = {}
        self._reported: set = set()

    def tick(self, proto, rnd, ranks, monitors, now: Optional[float] = None) -> None:
        """Called from the agent's loop; does something once per window."""
        if not self.enabled:
            return
        now = time.monotonic() if now is None else now
        if self._cycle != rnd.number:   # a new cycle: the first look only takes snapshots
            self._cycle, self._snap, self._streak, self._reported = rnd.number, {}, {}, set()
            self._next = now
        if now < self._next:
            return
        self._next = now + self.ft.straggler_window
        section = self.ft.straggler_section
        means: Dict[str, float] = {}
        for rank, monitor in zip(ranks, monitors):
            entry = (monitor.section_stats().get("sections") or {}).get(section)
            if not entry:
                continue
            snap = (int(entry["count"]), float(entry["total"]))
            mean = mean_over_window(self._snap.get(rank.rank), snap)
            self._snap[rank.rank] = snap
            if mean is not None:
                means[str(rank.rank)] = round(mean, 6)
        proto.put(store_keys.straggler_window(rnd.number, rnd.group_rank), json.dumps(
            {"time": time.time(), "node": rnd.me.host, "means": means}))
        if rnd.group_rank == 0:
            self._judge(proto, rnd)

    def _judge(self, proto, rnd) -> None:
        fresh = time.time() - 2 * self.ft.straggler_window
        means: Dict[int, float] = {}
        node_of: Dict[int, Tuple[int, str]] = {}
        for g in range(rnd.nnodes):
            key = store_keys.straggler_window(rnd.number, g)
            if not proto.exists(key):
                continue
            record = json.loads(proto.get(key))
            if record.get("time", 0) < fresh:
                continue
            for rank, mean in record.get("means", {}).items():
                means[int(rank)] = float(mean)
                node_of[int(rank)] = (g, record.get("node", "?"))
        slow = slow_ranks(means, self.ft.straggler_threshold)
        for rank in means:
            self._streak[rank] = self._streak.get(rank, 0) + 1 if rank in slow else 0
        need = self.ft.straggler_windows
        for rank, (ratio, median) in sorted(slow.items()):
            if self._streak[rank] < need or rank in self._reported:
                continue
            self._reported.add(rank)
            group_rank, host = node_of[rank]
            what = (f"rank {rank} on node {group_rank} ({host}) is {ratio:.2f}x slower than the median of the "
                    f"other ranks in section '{self.ft.straggler_section}'")
            if self.ft.straggler_exclude:
                proto.put(store_keys.slow(rnd.active[group_rank].node_id), what)
            self.events.event(
                "straggler",
                f"warning: straggler: rank {rank} on node {group_rank} ({host}) is {ratio:.2f}x slower than the "
                f"median of the other ranks in section '{self.ft.straggler_section}' ({means[rank]:.3f}s vs "
                f"{median:.3f}s) for {self._streak[rank]} windows of {self.ft.straggler_window:g}s",
                rank=rank, node_rank=group_rank, host=host, ratio=round(ratio, 3), mean=means[rank],
                median=median, section=self.ft.straggler_section, windows=self._streak[rank])
