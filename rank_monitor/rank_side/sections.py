"""The hot path: sections and heartbeats as a few integer writes into the rank's record.

Entering or leaving a section and sending a heartbeat write a few integers
(time.monotonic_ns(), counters) into the shared-memory record the rank's monitor created
(see shm_layout): no syscall, no socket, no lock, nothing that waits on the monitor.
Everything else (attaching, registering a section name, warnings) is the slow path
(rank_side.shm_attachment) and happens once per name. Without the monitor's environment variable
(plain python, torchrun) every call is a cheap no-op after one warning. Misuse (ending a section
that is not open, nesting a section in itself, a name with no configured timeout) warns once per
name and never raises.

`section(name)` and `heartbeat()` are the process's own (ft_launcher.section / heartbeat);
`bound_section` and `_beat` make the same writes for a writer that is not the rank's attachment
(the monitor, for NVRx's client on its socket: monitor_side.nvrx_peers).
"""
from __future__ import annotations

import functools
import time
from typing import Dict, Optional

from ft_launcher.rank_monitor import shm_layout as L
from ft_launcher.rank_monitor.rank_side.shm_attachment import _ATT, _Attachment
from ft_launcher.rank_monitor.rank_side.warn_once import _warn

_mono = time.monotonic_ns

_HB_WORDS: Optional[memoryview] = None   # set once the default path is attached: the fast heartbeat
_HB_NOOP = False


class _Section:
    """A named section: context manager and decorator. One object per name per process."""

    __slots__ = ("name", "_w", "_b", "_depth", "__weakref__")

    def __init__(self, name: str) -> None:
        self.name = name
        self._w = None
        self._b = 0
        self._depth = 0

    def _bind(self, att: _Attachment) -> None:
        if att.mode != "attached":
            self._w = None
            return
        idx = att.slot(self.name)
        if idx is None:
            self._w = None
            return
        self._b = L.slot_base(idx)
        self._w = att.words

    def __enter__(self):
        w = self._w
        if w is None:
            return self
        b = self._b
        if w[b]:
            self._depth += 1
            _warn(("reopen", self.name), f"ft_launcher: section {self.name!r} started while already open; "
                                         "the inner start/end pair is ignored")
            return self
        now = _mono()
        w[b + 1] = now             # S_ENTER_NS
        w[b + 2] += 1              # S_ENTERS
        w[b] = 1                   # S_OPEN
        n = w[8]                   # H_OPEN
        if n <= 0:
            last = w[9] or w[6]    # H_LAST_CLOSE_NS, else H_START_NS: start-up counts as out of section
            if last:
                d = now - last
                w[12] = d          # H_OOS_LAST_NS
                w[10] += 1         # H_OOS_COUNT
                if d > w[11]:      # H_OOS_MAX_NS
                    w[11] = d
            n = 0
        w[8] = n + 1
        return self

    def __exit__(self, exc_type=None, exc=None, tb=None):
        w = self._w
        if w is None:
            return False
        if self._depth:
            self._depth -= 1
            return False
        b = self._b
        if not w[b]:
            _warn(("notopen", self.name), f"ft_launcher: section {self.name!r} ended but it is not open; ignored")
            return False
        now = _mono()
        w[b] = 0                   # S_OPEN
        d = now - w[b + 1]
        w[b + 5] = d               # S_LAST_NS
        w[b + 6] += d              # S_TOTAL_NS
        if d > w[b + 4]:           # S_MAX_NS
            w[b + 4] = d
        w[b + 3] += 1              # S_CLOSES
        n = w[8] - 1
        if n <= 0:
            w[9] = now             # H_LAST_CLOSE_NS before the open count drops to 0
            n = 0
        w[8] = n
        return False

    def __call__(self, fn):
        sec = self

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with sec:
                return fn(*args, **kwargs)
        return wrapper

    def __repr__(self) -> str:
        return f"<ft_launcher section {self.name!r}>"


class _CheckpointSection(_Section):
    """The checkpoint section (`checkpointing`): as it closes, it also notes how many `step`
    sections had closed and their total time, the work a restart from this checkpoint keeps (the
    launcher's goodput), and how long it took; a close by an exception is noted apart (that
    checkpoint may not exist). Only this section pays for it; every other section is a plain
    _Section."""

    __slots__ = ("_slots",)

    def _bind(self, att: _Attachment) -> None:
        self._slots = att.slots
        _Section._bind(self, att)

    def __exit__(self, exc_type=None, exc=None, tb=None):
        w = self._w
        if w is None or self._depth:
            return _Section.__exit__(self, exc_type, exc, tb)
        b = self._b
        closes = w[b + 3]
        _Section.__exit__(self, exc_type, exc, tb)
        step = self._slots.get(L.STEP_SECTION)
        if w[b + 3] != closes:
            s = L.slot_base(step) if step is not None else None
            if exc_type is None:
                w[b + L.S_AT_STEP_TOTAL_NS] = w[s + 6] if s is not None else 0   # the step slot's S_TOTAL_NS
                w[b + L.S_AT_STEP_CLOSES] = w[s + 3] if s is not None else 0     # ... and S_CLOSES
                w[b + L.S_AT_CLOSE_NS] = w[b + 5]                              # this one's S_LAST_NS
            else:
                w[b + L.S_RAISED_STEP_TOTAL_NS] = w[s + 6] if s is not None else 0
                w[b + L.S_RAISED_STEP_CLOSES] = w[s + 3] if s is not None else 0
                w[b + L.S_RAISED_NS] = w[b + 5]
                w[b + L.S_RAISED_ENTERS] = w[b + 2]                            # S_ENTERS: this occurrence
        return False


def bound_section(name: str, words: memoryview, index: int, slots: Dict[str, int]) -> _Section:
    """A section object writing into `words` at slot `index` (`slots`: that record's name ->
    slot): the same writes as the rank's own, for a writer that is not the rank's attachment
    (the monitor, for NVRx's client on its socket: monitor_side.nvrx_peers)."""
    sec = (_CheckpointSection if name == L.CHECKPOINT_SECTION else _Section)(name)
    sec._w, sec._b = words, L.slot_base(index)
    if isinstance(sec, _CheckpointSection):
        sec._slots = slots
    return sec


assert (L.S_OPEN, L.S_ENTER_NS, L.S_ENTERS, L.S_CLOSES, L.S_MAX_NS, L.S_LAST_NS, L.S_TOTAL_NS) == (0, 1, 2, 3, 4, 5, 6)
assert (L.H_OPEN, L.H_LAST_CLOSE_NS, L.H_OOS_COUNT, L.H_OOS_MAX_NS, L.H_OOS_LAST_NS) == (8, 9, 10, 11, 12)
assert (L.H_HB_COUNT, L.H_HB_FIRST_NS, L.H_HB_LAST_NS, L.H_HB_MAX_NS, L.H_HB_LAST_IV_NS) == (13, 14, 15, 16, 17)


def _beat(w: memoryview) -> None:
    now = _mono()
    last = w[15]                   # H_HB_LAST_NS
    if last:
        iv = now - last
        w[17] = iv                 # H_HB_LAST_IV_NS
        if iv > w[16]:             # H_HB_MAX_NS
            w[16] = iv
    else:
        w[14] = now                # H_HB_FIRST_NS
    w[15] = now
    w[13] += 1                     # H_HB_COUNT, after the time it publishes


def heartbeat() -> None:
    """Tell the monitor this rank is alive (module-level form, default client)."""
    w = _HB_WORDS
    if w is None:
        if _HB_NOOP:
            return
        _slow_heartbeat()
        return
    now = _mono()
    last = w[15]
    if last:
        iv = now - last
        w[17] = iv
        if iv > w[16]:
            w[16] = iv
    else:
        w[14] = now
    w[15] = now
    w[13] += 1


def _slow_heartbeat() -> None:
    global _HB_WORDS, _HB_NOOP
    if _ATT.ensure():
        _HB_WORDS = _ATT.words
        _beat(_HB_WORDS)
    elif _ATT.mode in ("noop", "shutdown"):
        _HB_NOOP = True


_sections = _ATT.sections


def section(name: str) -> _Section:
    """`with ft_launcher.section("step"): ...` or `@ft_launcher.section("step")`."""
    sec = _sections.get(name)
    if sec is None:
        sec = _ATT.section(name)
    return sec


_section_of = section   # for the methods whose parameter (NVRx's name) hides it


__all__ = ["section", "heartbeat", "bound_section"]
