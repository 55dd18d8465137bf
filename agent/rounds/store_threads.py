"""Threads that call into torch's store code, and the agent's way out past those that never return.

torch's TCPStore calls cannot be interrupted, and not all of them honour their timeout: measured
on torch 2.13, a client's `add` to a SIGSTOPped store host stays blocked well past a 3 s timeout,
and a client's construction against a listener that accepts but never answers stays blocked for
90 s with a 2 s timeout. A thread still inside such a call when the interpreter finalizes aborts
the process ("terminate called without an active exception", SIGABRT): exit 134 instead of 0,
1 or 93, and 93 exists so that schedulers do not requeue.

So every such thread is started (or registered) here; the agent joins them within a bound when
it ends (`join_all`), and `exit_past_stuck` is the last thing the command line does: when one is
still inside torch, the process leaves with `os._exit(code)` after flushing its streams, the
only way out that neither aborts nor waits forever. Nothing is lost by it: the agent has already
stopped its ranks, monitors and watchdog and closed its event log by then.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from typing import Callable

_THREADS: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()


def track(thread: threading.Thread) -> threading.Thread:
    _THREADS.add(thread)
    return thread


def start(target: Callable[[], None], name: str) -> threading.Thread:
    """A daemon thread running `target`, tracked."""
    thread = track(threading.Thread(target=target, name=name, daemon=True))
    thread.start()
    return thread


def stuck() -> list:
    return [t for t in list(_THREADS) if t.is_alive() and t is not threading.current_thread()]


def join_all(within: float) -> list:
    """Join every tracked thread, all within `within` s; returns those still alive."""
    deadline = time.monotonic() + within
    for thread in stuck():
        thread.join(max(0.0, deadline - time.monotonic()))
    return stuck()


def exit_past_stuck(code: int) -> int:
    """Return `code`, or, when a tracked thread is still inside torch's store code, flush the
    standard streams and leave the process at once with `code`."""
    if not stuck():
        return code
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
