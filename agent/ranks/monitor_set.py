"""The node's rank monitors, one per local rank (rank_monitor.monitor_side.server through MonitorHandle): started
beside the ranks before the store is reached, their reports read as they arrive, one that stops
ticking killed, one that dies replaced (its rank restarts under the new one, never unprotected),
all stopped on the way out, also those whose start finished after the agent had already failed.

What the reports mean for the job (a hang, a stack dump) is the agent's to decide: `reports()`
hands them over; only a monitor's own death is handled here.
"""
from __future__ import annotations

import os
import selectors
import signal
import time
from concurrent.futures import wait as futures_wait
from typing import Callable, Dict, List, Optional

from ft_launcher.rank_monitor.agent_side.monitor_handle import MonitorHandle

STALL_LIMIT = 5.0  # seconds without a monitor tick (it ticks at least once a second)


class MonitorSet:
    def __init__(self, cfg, run_dir: str, watchdog, events) -> None:
        self.cfg = cfg
        self.run_dir = run_dir   # where stack dumps go: the log dir, else a per-agent temp dir
        self.watchdog = watchdog
        self.events = events
        self.handles: List[MonitorHandle] = []   # by local rank; replaced in place (JobStatus holds it)
        # local rank -> reports that explain the rank's coming end (a hang, its monitor's death)
        self.pending: Dict[int, List[dict]] = {}
        self._starts: list = []
        self._stalled: set = set()
        self._last_check = self._resumed = time.monotonic()   # check_ticks: when this agent last ran, resumed

    # ---- start and stop -------------------------------------------------------------------
    def start(self, pool) -> None:
        """Start every monitor on `pool`; `ready()` waits for them."""
        self._starts = [pool.submit(self._start_one, i) for i in range(self.cfg.nproc_per_node)]

    def ready(self) -> None:
        """Wait for the starts; a monitor that fails to start raises MonitorStartError."""
        self.handles[:] = [f.result() for f in self._starts]

    def _start_one(self, local_rank: int) -> MonitorHandle:
        handle = MonitorHandle.start(local_rank, self.cfg.ft, self.run_dir)
        self.watchdog.watch(handle.pid)
        return handle

    def stop_all(self) -> None:
        """Stop every monitor, those started before the store or another monitor failed too."""
        futures_wait(self._starts)   # each start is bounded (MonitorHandle.start's ready timeout)
        started = [f.result() for f in self._starts if not f.cancelled() and f.exception() is None]
        for handle in self.handles + [h for h in started if h not in self.handles]:
            handle.stop()
            self.watchdog.forget(handle.pid)

    # ---- while ranks run ------------------------------------------------------------------
    def register(self, sel) -> None:
        for local_rank, monitor in enumerate(self.handles):
            sel.register(monitor.fileno(), selectors.EVENT_READ, ("monitor", local_rank))

    def reports(self, local_rank: int, sel, rank_of: Callable[[int], Optional[object]]) -> List[dict]:
        """The reports waiting on `local_rank`'s channel. A monitor that died is replaced here (and
        its rank, `rank_of(local_rank)`, killed so that it restarts under the new monitor); that
        report is kept in `pending` for the rank's failure line, not returned."""
        monitor = self.handles[local_rank]
        out = []
        for report in monitor.read_reports():
            if report.get("kind") == "monitor_died":
                sel.unregister(monitor.fileno())
                new = self.replace(local_rank, rank_of(local_rank))
                sel.register(new.fileno(), selectors.EVENT_READ, ("monitor", local_rank))
                return out
            out.append(report)
        return out

    def check_ticks(self) -> None:
        """A monitor that stopped ticking (SIGSTOPped, wedged) protects nothing: end it, so the
        death path replaces it and restarts its rank. Slow is not dead: when this agent did not
        run for a while either (the node was paused, or starved), its monitors get STALL_LIMIT
        of running time to tick again before they are judged."""
        now = time.monotonic()
        if now - self._last_check > STALL_LIMIT:   # this agent itself did not run: paused with its node
            self._resumed = now
        self._last_check = now
        if now - self._resumed < STALL_LIMIT:
            return
        for local_rank, monitor in enumerate(self.handles):
            stalled = monitor.stalled_for()
            if stalled > STALL_LIMIT and monitor.pid not in self._stalled:
                self._stalled.add(monitor.pid)
                self.events.event("monitor_stalled", f"rank monitor for local rank {local_rank} (pid {monitor.pid}) "
                                  f"has not ticked for {stalled:.1f}s -> killing it", local_rank=local_rank,
                                  pid=monitor.pid, stalled=round(stalled, 3))
                try:
                    os.kill(monitor.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def replace(self, local_rank: int, rank) -> MonitorHandle:
        """A new monitor for `local_rank`; its rank (if running) is killed and its failure pinned on
        the monitor's death, so the job restarts under the new monitor."""
        old = self.handles[local_rank]
        self.watchdog.forget(old.pid)
        old.stop()
        self.events.event("monitor_died", f"rank monitor for local rank {local_rank} (pid {old.pid}) died: "
                          f"rank {rank.rank if rank else '?'} is unprotected -> starting a new monitor and "
                          f"restarting the ranks", rank=rank.rank if rank else None, local_rank=local_rank)
        handle = self._start_one(local_rank)
        self.handles[local_rank] = handle
        if rank is not None and rank.exitcode is None:
            self.pending.setdefault(local_rank, []).append(
                {"kind": "monitor_died", "pid": old.pid, "cycle": self.events.cycle})
            os.killpg(rank.pid, signal.SIGKILL)
        return handle

    def mark_stopping(self, reason: int, grace: float, skip=()) -> None:
        """Tell the ranks (ft_launcher.preempted()) why they are about to be signalled, and when
        SIGKILL follows; not those of the local ranks in `skip` (they restart in place)."""
        deadline = time.monotonic_ns() + int(grace * 1e9)
        for local_rank, monitor in enumerate(self.handles):
            if local_rank not in skip:
                monitor.mark_stopping(reason, deadline)

    def hung(self, cycle: int) -> set:
        """Local ranks whose monitor found them hung in `cycle`."""
        found = {lr for lr, reports in self.pending.items()
                 if any(r.get("kind") == "hang" and r.get("cycle") == cycle for r in reports)}
        return found | {m.local_rank for m in self.handles if m.reported_hang(cycle)}

    def unread_hangs(self, cycle: int) -> List[tuple]:
        """(local rank, report) of the hang reports of `cycle` a monitor holds that were not read yet."""
        out = []
        for monitor in self.handles:
            report = monitor.pending_hang(cycle)
            if report is not None:
                out.append((monitor.local_rank, report))
        return out

    def take_pending(self, local_rank: int, cycle: int) -> List[dict]:
        """The reports that explain `local_rank`'s end in `cycle` (older ones are dropped)."""
        return [r for r in self.pending.pop(local_rank, []) if r.get("cycle") == cycle]
