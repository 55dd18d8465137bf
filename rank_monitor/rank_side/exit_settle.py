"""A rank's end: before the interpreter finalizes, the process's other threads finish what still
needs Python, so a rank whose training completed does not then die of SIGABRT.

Why: while CPython (3.11 to 3.13) finalizes, a thread other than the main thread that takes the GIL
is ended with pthread_exit, whose forced unwind calls std::terminate when it meets a C++ noexcept
frame: the process aborts with "terminate called without an active exception" after its work is
done (pytorch/pytorch#38228, python/cpython#87135; 3.14 parks such a thread instead). torch's gloo
workers do exactly that at the end of most FSDP/DTensor scripts: a worker thread releases its
reference to a finished collective only after the waiting caller has moved on, and when the caller
has already dropped a tensor the collective holds (`DTensor.full_tensor()`'s all-gather output),
torch keeps that tensor's Python object alive from C++, so the worker takes the GIL to free it
(`~AsyncAllgatherCoalescedWork` -> `TensorImpl::decref_pyobject`). When the script's last
collective completes a few milliseconds (CPython's switch interval) before the interpreter's end,
the worker asks for the GIL as the main thread starts to finalize. On this 2-core host that was
3 of 160 gloo FSDP rank exits (bench/exit_race.py; none of 160 with the settle), and a kept rank of
an in-place restart was lost so in 1 run of 3 of tests/live/jobs/test_buddy_copy.py's two-node case: the job
then ended with exit 1.

What it does (`install()`, once per process; rank_side.inprocess and the client's attach call it):
an atexit handler, which runs after the script's own code and before finalization, first runs the
`before_exit` hooks (rank_side.live.live_teardown joins a buddy exchange still in flight: its thread is
blocked inside torch), then releases the GIL in short sleeps until no other thread of the process
has been runnable for QUIET_LOOKS looks in a row (/proc/self/task/*/stat), at most SETTLE_S. A
thread that waits for the GIL gets it while the main thread sleeps; one that still runs native code
is runnable. What it cannot see: a thread blocked in a call that returns into Python only later
(a collective still waiting for a peer at exit), which is why the hooks end our own first.
Linux only (/proc); elsewhere it sleeps one step.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from typing import Callable, List, Optional

STEP_S = 0.002      # each sleep with the GIL released
QUIET_LOOKS = 3     # looks in a row that find no other thread runnable
SETTLE_S = 3.0      # at most this long (a thread that never stops running: a user's spinning daemon thread)

_HOOKS: List[Callable[[], None]] = []
_installed: Optional[int] = None   # the pid that registered the handler (a fork's child has none)


def before_exit(fn: Callable[[], None]) -> None:
    """Run `fn` at the rank's end, before the threads settle (an exception is said in one line)."""
    if fn not in _HOOKS:
        _HOOKS.append(fn)


def install() -> None:
    """Register the atexit handler in this process (once)."""
    global _installed
    if _installed == os.getpid():
        return
    _installed = os.getpid()
    atexit.register(_at_exit)


def _at_exit() -> None:
    if _installed != os.getpid():   # a forked child inherits the registration, not the rank's threads
        return
    for fn in list(_HOOKS):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the rank's end goes on
            sys.stderr.write(f"ft_launcher: at the rank's end: {exc!r}\n")
    settle()


def busy_threads() -> Optional[List[int]]:
    """The ids of this process's threads, other than the caller, that are running, runnable or in
    an uninterruptible sleep; None where /proc/self/task cannot be read."""
    me = threading.get_native_id()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    busy = []
    for tid in tids:
        if not tid.isdigit() or int(tid) == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue   # it ended meanwhile
        state = stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3]   # after "pid (comm) "
        if state in (b"R", b"D"):
            busy.append(int(tid))
    return busy


def settle(bound: float = SETTLE_S) -> float:
    """Sleep (the GIL released) until no other thread has been busy for QUIET_LOOKS looks in a row,
    at most `bound` seconds; -> the seconds it took."""
    t0 = time.monotonic()
    quiet = 0
    while quiet < QUIET_LOOKS and time.monotonic() - t0 < bound:
        time.sleep(STEP_S)
        busy = busy_threads()
        if busy is None:
            break
        quiet = 0 if busy else quiet + 1
    return time.monotonic() - t0
