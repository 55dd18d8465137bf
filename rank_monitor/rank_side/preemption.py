"""Preemption for the rank: preempted() / on_preemption(fn) install (on first call, never on the
hot path) a SIGTERM handler that records the signal and the grace the launcher announced (the
agent writes its SIGKILL deadline into the record before it signals). A SIGTERM that stops the
ranks for a restart is not a preemption: the handler then lets it end the rank as before.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Any, Optional

from ft_launcher.rank_monitor import shm_layout as L
from ft_launcher.rank_monitor.rank_side.shm_attachment import _ATT
from ft_launcher.rank_monitor.rank_side.warn_once import _warn

_mono = time.monotonic_ns


class Preemption:
    """What preempted() returns once SIGTERM has arrived: `signal`, `received` (time.monotonic()
    when it arrived) and `deadline` (time.monotonic() at which the launcher's SIGKILL follows, or
    None where the signal did not come through the launcher); `grace_left` is seconds until then."""

    __slots__ = ("signal", "received", "deadline")

    def __init__(self, signum: int, received: float, deadline: Optional[float]) -> None:
        self.signal, self.received, self.deadline = signum, received, deadline

    @property
    def grace_left(self) -> Optional[float]:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        left = self.grace_left
        return f"<Preemption {signal.Signals(self.signal).name}, " + (
            "grace unknown>" if left is None else f"{left:.1f}s of grace left>")


_PREEMPTION: Optional[Preemption] = None
_preempt_callbacks: list = []
_preempt_prev: Any = None
_preempt_installed = False


def _install_preemption_handler() -> bool:
    global _preempt_prev, _preempt_installed
    if _preempt_installed:
        return True
    try:
        prev = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:   # not the main thread
        _warn(("preempt_thread",), "ft_launcher: preempted()/on_preemption() must first be called from the "
                                   "main thread (it installs a SIGTERM handler); preemption is not reported")
        return False
    _ATT.ensure()
    _preempt_prev, _preempt_installed = prev, True
    return True


def _on_sigterm(signum, frame) -> None:
    global _PREEMPTION
    w = _ATT.words if _ATT.mode == "attached" else None
    reason = w[L.H_STOP_REASON] if w is not None else 0
    if reason == L.STOP_RESTART:   # a restart stops the ranks: end as the rank would have ended
        prev = _preempt_prev
        if callable(prev):
            prev(signum, frame)
            return
        if prev == signal.SIG_IGN:
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    if _PREEMPTION is not None:   # a repeated signal: already reported
        return
    deadline_ns = w[L.H_STOP_DEADLINE_NS] if (w is not None and reason == L.STOP_SHUTDOWN) else 0
    now_ns = _mono()
    _PREEMPTION = Preemption(signum, now_ns / 1e9, deadline_ns / 1e9 if deadline_ns else None)
    for fn in list(_preempt_callbacks):
        fn(_PREEMPTION)


def preempted() -> Optional[Preemption]:
    """None until SIGTERM reaches this rank, then a Preemption (truthy) saying how much grace is
    left before the launcher's SIGKILL. The first call installs the SIGTERM handler: from then on
    SIGTERM no longer ends the rank by itself; save what must be saved and exit."""
    if not _preempt_installed:
        _install_preemption_handler()
    return _PREEMPTION


def on_preemption(fn) -> Any:
    """Call `fn(preemption)` from the SIGTERM handler when the job is being stopped (also usable as
    a decorator). Like preempted(), SIGTERM then no longer ends the rank by itself."""
    _install_preemption_handler()
    _preempt_callbacks.append(fn)
    return fn



__all__ = ["preempted", "on_preemption", "Preemption"]
