"""A rank that hangs in its teardown: the job's work is done, this rank never exits.

Seen (issue 39): every rank trained to the last step, the result was written, every other rank
exited 0, and one rank sat in torch's teardown for ever (a gloo worker and the main thread each
waiting for the other: rank_side.call_groups closes the known cause). No section timeout watches a
rank outside its sections, so nothing ended the job.

The watch (`tick`, on every pass of the agent's loop; it costs nothing until this node's ranks
that are left are all that is left of the job):
- the job's work is done when every other rank of the job has ended 0: this node's others exited
  0, and every other node has reported all of its ranks done (the round's done count; read at
  most once per LOOK s, only while a rank lingers here); a one-node job needs one rank ended 0;
- a lingering rank is one still running then, with no section open; its CPU time (all its
  threads, /proc) is sampled when it starts lingering;
- after `grace` seconds (teardown_hang_grace, 60 by default; 0: off) a rank that used less than
  IDLE_SHARE of them in CPU is hung in its teardown (a rank still working alone, rank 0 writing a
  final checkpoint, uses CPU: its window starts again); its monitor dumps its stack and stops it
  (monitor_side.server's end_rank), with one line: the work is done, the rank hung in its
  teardown, where its stack is;
- the supervisor then counts its exit as finished (`ended`), and the job ends as finished (exit 0):
  its work was done and counted before it hung, and a restart would redo nothing.
A rank that opens a section or ends meanwhile is left alone.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Dict, Optional, Set, Tuple

LOOK = 1.0          # seconds between looks at the other nodes' done count
IDLE_SHARE = 0.05   # a lingering rank that used less CPU than this share of the grace is hung


def cpu_seconds(pid: int) -> Optional[float]:
    """User + system CPU seconds of process `pid` (every thread), None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


class TeardownWatch:
    """One node's watch (see the module docstring); `events` is the agent's EventLog."""

    def __init__(self, grace: float, events):
        self.grace = grace
        self.events = events
        self.begin_cycle(0, 1, lambda: 0)

    def begin_cycle(self, cycle: int, nnodes: int, others_done: Callable[[], int]) -> None:
        """`others_done()`: how many nodes have reported all their ranks done in this cycle."""
        self.cycle, self.nnodes, self.others_done = cycle, nnodes, others_done
        self.lingering: Dict[int, Tuple[float, float]] = {}   # local rank -> (since, CPU seconds then)
        self.ended_ranks: Set[int] = set()                    # local ranks ended as hung in teardown
        self._done_seen = 0
        self._looked = 0.0

    def ended(self, rank) -> bool:
        return rank.local_rank in self.ended_ranks

    def tick(self, ranks, monitors) -> None:
        if self.grace <= 0:
            return
        running = [r for r in ranks if r.exitcode is None and r.proc.poll() is None]
        ended = [r for r in ranks if r not in running]
        if not running or any(r.exitcode not in (0, None) for r in ended) or not self._work_done(ended):
            self.lingering.clear()
            return
        now = time.monotonic()
        for rank in running:
            if rank.local_rank in self.ended_ranks:
                continue
            live = monitors[rank.local_rank].live()
            cpu = cpu_seconds(rank.pid)
            if (live and live.get("open")) or cpu is None:
                self.lingering.pop(rank.local_rank, None)
                continue
            since, cpu0 = self.lingering.setdefault(rank.local_rank, (now, cpu))
            if now - since < self.grace:
                continue
            if cpu - cpu0 >= IDLE_SHARE * self.grace:   # still working (alone): a new window
                self.lingering[rank.local_rank] = (now, cpu)
                continue
            self._end(rank, monitors[rank.local_rank], now - since)

    def _work_done(self, ended) -> bool:
        if self.nnodes == 1:
            return any(r.exitcode == 0 for r in ended)
        now = time.monotonic()
        if self._done_seen < self.nnodes - 1 and now - self._looked >= LOOK:
            self._looked = now
            try:
                self._done_seen = self.others_done()
            except Exception:  # noqa: BLE001 - a lost store is the watcher's news, not ours
                return False
        return self._done_seen >= self.nnodes - 1

    def _end(self, rank, monitor, idle: float) -> None:
        self.ended_ranks.add(rank.local_rank)
        self.lingering.pop(rank.local_rank, None)
        record = monitor.record()
        stack = None
        if record is not None:
            from ft_launcher.rank_monitor import shm_layout as L

            handler = record[1][L.H_HANDLER_PID]
            if handler and record[1][L.H_HANDLER_SIG]:
                stack = monitor.stack_template.replace("{pid}", str(handler))
        self.events.event(
            "teardown_hang",
            f"warning: the job's work is done (every other rank finished 0) but rank {rank.rank} (pid {rank.pid}) "
            f"hung in its teardown: idle outside any section for {idle:.0f}s (teardown_hang_grace "
            f"{self.grace:g}s); " + (f"stack dump: {stack}; " if stack else "no stack dump (it does not run "
                                     "ft_launcher's client); ") + "ending it, the job counts it as finished",
            rank=rank.rank, pid=rank.pid, idle=round(idle, 3), grace=self.grace, stack_file=stack)
        monitor.end_rank(rank.pid, "teardown")
