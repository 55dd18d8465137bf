"""The agent's voice: one operator-readable log line per event, and the same event as a JSON
object appended to `events.jsonl` in the log directory (time, node, rank, cycle, kind, detail).

Lines look like
    [ft_launcher node=1 cycle=2] rank 3 exited with code 1 -> restarting all ranks (restart 2/3)
Errors and warnings start like the command line's own, so one pattern finds them all:
    ft_launcher: error: rank 1 on node 0 ... restart budget spent (1/1 restarts used) [node=0 cycle=1]
Each JSONL record is written with one `write` on an O_APPEND descriptor, so several agents
sharing a log directory never interleave within a line.

The log directory's disk can fail (full, read-only, removed) while the job runs: a write there
that fails, here or in another part of the agent (rank logs, the status file), costs what it
wrote, never the job. `disk_warning` says so in one warning line for the whole run.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any, Optional


class EventLog:
    def __init__(self, events_path: Optional[str] = None, stream=None):
        self.node: Any = "?"
        self.cycle: Optional[int] = None
        self._stream = stream if stream is not None else sys.stderr
        self._fd = None
        self._lock = threading.Lock()        # the console stream
        self._fd_lock = threading.Lock()     # events.jsonl (never held while taking _lock)
        self._disk_warned = False
        self.path = events_path
        self.listeners: list = []  # callables given each record (metrics, status), log dir or not
        if events_path:
            os.makedirs(os.path.dirname(os.path.abspath(events_path)), exist_ok=True)
            self._fd = os.open(events_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def say(self, message: str) -> None:
        """An operator line with no structured record (progress, hints)."""
        cycle = "" if self.cycle is None else f" cycle={self.cycle}"
        level = next((w for w in ("error: ", "warning: ") if message.startswith(w)), None)
        if level:
            line = f"ft_launcher: {message} [node={self.node}{cycle}]\n"
        else:
            line = f"[ft_launcher node={self.node}{cycle}] {message}\n"
        with self._lock:
            try:
                self._stream.write(line)
                self._stream.flush()
            except (OSError, ValueError):
                pass

    def event(self, kind: str, message: Optional[str] = None, /, rank: Optional[int] = None,
              cycle: Optional[int] = None, **detail: Any) -> None:
        """Record one event; `message`, when given, is also logged as the operator's line.
        `cycle`: the cycle the event belongs to, when not the current one (a late report)."""
        if message:
            self.say(message)
        if self._fd is None and not self.listeners:
            return
        record = {"time": round(time.time(), 6), "node": self.node, "rank": rank,
                  "cycle": self.cycle if cycle is None else cycle, "kind": kind, "detail": detail}
        for listener in self.listeners:
            try:
                listener(record)
            except Exception as exc:  # a listener's bug must not end the job
                self.say(f"warning: event listener failed on {kind}: {exc!r}")
        if self._fd is None:
            return
        data = (json.dumps(record, default=str) + "\n").encode()
        failure = None
        with self._fd_lock:
            try:
                if self._fd is not None:
                    os.write(self._fd, data)
            except OSError as exc:
                failure = exc
        if failure is not None:   # said outside the lock: say() takes the stream's
            self.disk_warning(f"cannot append to {self.path}", failure)

    def disk_warning(self, what: str, exc: OSError) -> None:
        """A write to the log directory failed: one warning line for the whole run."""
        with self._fd_lock:
            first, self._disk_warned = not self._disk_warned, True
        if first:
            self.say(f"warning: {what} ({exc.strerror or exc}): output and events that cannot be "
                     f"written to the log directory are lost; the job goes on")

    def close(self) -> None:
        with self._fd_lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
