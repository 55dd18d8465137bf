"""Killing a rank for good, within a bound.

A SIGKILLed process normally disappears within milliseconds (a large CUDA process in a second
or two, while the driver frees its memory). One in uninterruptible sleep (a wedged driver or
filesystem call: state D) does not die until that call returns, maybe never; an unbounded
`wait()` on it would freeze the agent's loop while its keep-alive thread went on telling the
other nodes that this node is fine. So every wait after SIGKILL here ends after KILL_WAIT
seconds, and a process still there then is reported as unkillable (`Unkillable`): the agent
says so in one line and this node leaves the job (agent.agent), since it cannot be trusted to
run ranks again.
"""
from __future__ import annotations

import os
import signal
import subprocess
from typing import List

KILL_WAIT = 10.0   # seconds a SIGKILLed rank may take to disappear


class Unkillable(Exception):
    """Ranks still alive KILL_WAIT s after SIGKILL: (global rank, pid) pairs."""

    def __init__(self, ranks: List[tuple]):
        self.ranks = ranks
        listed = ", ".join(f"rank {rank} (pid {pid}, state {_state(pid)})" for rank, pid in ranks)
        super().__init__(f"{listed} still alive {KILL_WAIT:g}s after SIGKILL (uninterruptible sleep: a "
                         f"wedged driver or filesystem call?): this node cannot be trusted to run ranks")


def kill_and_wait(proc: subprocess.Popen, timeout: float = KILL_WAIT) -> bool:
    """SIGKILL `proc`'s process group and `proc` itself; True once it is gone, False if it is
    still there after `timeout` s."""
    for kill, target in ((os.killpg, proc.pid), (os.kill, proc.pid)):
        try:
            kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        return False


def _state(pid: int) -> str:
    """The process's state letter from /proc (D: uninterruptible sleep), or '?'."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return "?"
