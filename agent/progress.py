"""Is the job still making progress? Completed `step` sections per cycle, counted by the monitors.

No file and no cost to the ranks: the agent reads the `step` completion count its monitors already
keep in shared memory, and the first time one of its ranks completes a step in cycle N it sets
`r<N>/progress` in the store (one key per node per cycle, then nothing more). When a cycle fails,
the node that decides the verdict counts the cycles, back from this one, that ended without that
key; once the job has made progress at least once, `max_no_progress_cycles` such cycles in a row
stop the job instead of restarting it (every agent exits with the no-restart code, 93).
"""
from __future__ import annotations

from typing import Optional

STEP = "step"


def completed_steps(monitors: list, section: str = STEP) -> int:
    """Completed `section` sections of this node's running ranks (this incarnation)."""
    total = 0
    for monitor in monitors:
        entry = (monitor.section_stats().get("sections") or {}).get(section)
        if entry:
            total += int(entry.get("count", 0))
    return total


class ProgressTracker:
    def __init__(self, limit: int):
        self.limit = limit
        self._flagged: Optional[int] = None   # the cycle whose progress this node has reported

    def poll(self, proto, cycle: int, monitors: list) -> None:
        """Report this cycle's first completed step (a few word reads until then, nothing after)."""
        if self._flagged == cycle:
            return
        if completed_steps(monitors) > 0:
            self._flagged = cycle
            proto.put(f"r{cycle}/progress", "1")

    def stop_reason(self, proto, cycle: int) -> Optional[str]:
        """Why the job must stop instead of restarting after cycle `cycle` failed, or None."""
        if self.limit <= 0:
            return None
        streak, k = 0, cycle
        while k >= 0 and not proto.exists(f"r{k}/progress"):
            streak += 1
            k -= 1
        if k < 0 or streak < self.limit:   # never made progress: the job does not use `step`
            return None
        return (f"no progress: {streak} cycle{'s' if streak != 1 else ''} in a row ended without a completed "
                f"'step' section on any rank (max_no_progress_cycles={self.limit}); restarting is pointless")
