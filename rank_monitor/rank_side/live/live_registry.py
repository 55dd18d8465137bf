"""The registry of live state in this process: what survives between calls of the restartable
function. Per LiveState name, the LiveState whose committed state this process holds (`Held`), and
at which step; the running call's LiveStates; why a state was refused; this cycle's buddy copies.
Only a commit or a completed restore makes a LiveState held (rank_side.live.live_state). One
registry per process, `REG`.
"""
from __future__ import annotations

from typing import Dict, Optional


class Held:
    """What this process holds for one LiveState name."""

    __slots__ = ("live", "step", "dirty", "ready")

    def __init__(self, live, step: int, ready: Optional[dict] = None) -> None:
        self.live, self.step, self.dirty = live, step, False
        self.ready = ready   # committed state dicts not yet loaded into live's objects (during a restore)

    def committed(self) -> Dict[str, dict]:
        if self.ready is not None:
            return self.ready
        return {name: t.committed() for name, t in self.live.tracked.items()}


class Registry:
    """What survives between calls of the restartable function (this process only)."""

    def __init__(self) -> None:
        self.cycle: Optional[int] = None              # the cycle of the running call's LiveStates
        self.call: Optional[int] = None               # the call (inprocess._STATE.calls) they belong to
        self.current: Dict[str, object] = {}          # the running call's LiveStates, by name
        self.held: Dict[str, Held] = {}               # by name: the LiveState whose committed state is held
        self.refused: Dict[str, str] = {}             # by name: why its state was refused
        self.calls = 0                                # calls of this process that made a LiveState
        self.trained = False                          # a commit completed in the running call
        self.suspect = False                          # the previous call raised by itself after a commit
        self.depth = 0                                # nested commits (the restart signal waits for all)
        self.said_job = False                         # the granularity-job line was said
        self.buddy = None                             # this cycle's buddy copies (rank_side.live.buddy_copy), if on


REG = Registry()
