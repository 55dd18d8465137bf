"""Is the job still making progress? Measured one of two ways, decided per cycle.

- By default, completed `step` sections, counted by the monitors: no file and no cost to the
  ranks. The agent reads the `step` completion counts its monitors already keep in shared memory,
  and the first time one of its ranks has completed `min_progress_iterations` steps (default 1)
  in cycle N it sets `r<N>/progress` in the store (one key per node per cycle, then nothing
  more). Only once the job has made progress at least once do cycles without it count (a script
  that never uses `step` is never stopped).
- With `checkpoint_iteration_file` (NVRx 0.7's key: the file a checkpoint writes its iteration
  to, e.g. Megatron's latest_checkpointed_iteration.txt, on a filesystem every node sees), NVRx's
  rule: each node reads the iteration when a cycle starts, and when the cycle fails the deciding
  node reads it again; the cycle made progress when it rose by at least
  `min_progress_iterations` (`r<N>/progress`). A file that cannot be read, or reads 0 at both
  ends (no checkpoint yet), leaves the cycle out of the count (`r<N>/progress_unknown`); cycle 0
  counts like any other.

When a cycle fails, the node that decides the verdict judges it (`judge`: the file's rule) and
reads the cycles' progress back from this one (`history`); the restart policy counts those that
ended without progress, and `max_no_progress_cycles` of them in a row stop the job instead of
restarting it (every agent exits with the no-restart code, 93).
"""
from __future__ import annotations

from typing import List, Optional

from ft_launcher.agent.rounds import store_keys

STEP = "step"


def completed_steps(monitors: list, section: str = STEP) -> int:
    """Completed `section` sections of this node's running ranks (this incarnation)."""
    return sum(_counts(monitors, section))


def _counts(monitors: list, section: str = STEP) -> list:
    out = []
    for monitor in monitors:
        entry = (monitor.section_stats().get("sections") or {}).get(section)
        out.append(int(entry.get("count", 0)) if entry else 0)
    return out


def read_iteration(path: str) -> Optional[int]:
    """The iteration the checkpoint iteration file holds, or None (missing, empty, not a number)."""
    try:
        with open(path) as fh:
            text = fh.read().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


class ProgressTracker:
    def __init__(self, limit: int, min_iterations: int = 1, iteration_file: Optional[str] = None):
        self.limit = limit
        self.min_iterations = max(1, int(min_iterations))
        self.iteration_file = iteration_file
        self._flagged: Optional[int] = None   # the cycle whose progress this node has reported
        self._base: Optional[int] = None      # the checkpoint iteration when this node's cycle began
        self._base_cycle: Optional[int] = None
        self.last: Optional[int] = None       # the iteration read when the last cycle failed

    def begin_cycle(self, cycle: int) -> None:
        """Before the cycle's ranks start: the checkpoint iteration it starts from."""
        if self.iteration_file and self.limit > 0:
            self._base_cycle, self._base = cycle, read_iteration(self.iteration_file)

    def poll(self, proto, cycle: int, monitors: list) -> None:
        """Report this cycle's progress (step mode: a few word reads until then, nothing after)."""
        if self._flagged == cycle or self.iteration_file:
            return
        counts = _counts(monitors)
        if counts and max(counts) >= self.min_iterations:
            self._flagged = cycle
            proto.put(store_keys.progress(cycle), "1")

    def reported(self, cycle: int) -> bool:
        """Has this node reported progress in cycle `cycle` (steps mode)?"""
        return self._flagged == cycle

    def judge(self, proto, cycle: int) -> None:
        """The deciding node, when cycle `cycle` failed: with checkpoint_iteration_file, NVRx's rule
        (reads the file, writes `r<cycle>/progress` or `r<cycle>/progress_unknown`)."""
        if not (self.iteration_file and self.limit > 0):
            return
        now = read_iteration(self.iteration_file)
        base = (self._base or 0) if self._base_cycle == cycle else None
        if now is None or base is None or (base == 0 and now == 0):
            proto.put(store_keys.progress_unknown(cycle), "1")
        elif now - base >= self.min_iterations:
            proto.put(store_keys.progress(cycle), str(now))
        self.last = now

    def history(self, proto, cycle: int) -> List[str]:
        """Cycle `cycle`'s progress, then each earlier cycle's, back to the last that made progress:
        "progress", "unknown" (only with the file: it could not tell) or "none" (the policy's input,
        agent.recovery.restart_policy.PolicyInputs.progress)."""
        out = []
        for k in range(cycle, -1, -1):
            if proto.exists(store_keys.progress(k)):
                out.append("progress")
                break
            unknown = self.iteration_file and proto.exists(store_keys.progress_unknown(k))
            out.append("unknown" if unknown else "none")
        return out
