"""Rank output: where each rank's stdout/stderr go (console, per-cycle log file, or both).

Captured streams come through pipes that one reader thread serves for all ranks: each complete
line is written to the rank's file `<log_dir>/cycle_<c>/rank_<r>.log` and, when teed, to the
agent's stdout as `[rank N] line`. Streams that are neither captured nor filtered out are
inherited directly (no thread, no copy).

With NVRx's per-cycle application log (--ft-per-cycle-applog-prefix, agent.observation.nvrx_logs) both
streams of every rank are also appended, line by line, to that cycle's one file for the whole job,
each line behind NVRx's rank prefix (`  3: ` as `srun -l` writes it); what goes to the console and
to our per-rank files stays as it is without it.

The log files live on a disk that can fail (full, read-only, removed): a file that cannot be
opened sends the rank's captured streams to the console instead, a write that fails drops the
data; either way the rank runs on, and `warn` (the event log's disk warning: one line for the
run) is told.
"""
from __future__ import annotations

import os
import selectors
import subprocess
import sys
import threading
from typing import Callable, Dict, Optional


class RankOutput:
    def __init__(self, warn: Optional[Callable[[str, OSError], None]] = None) -> None:
        self.warn = warn or (lambda what, exc: None)
        self._sel = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._open: Dict[int, dict] = {}
        self._thread = threading.Thread(target=self._serve, name="ft-rank-output", daemon=True)
        self._thread.start()

    def plan(self, rank: int, capture: int, tee: int, show: bool, log_file: Optional[str],
             applog: Optional[tuple] = None):
        """Return (stdout, stderr) for Popen and a handle for attach()/finish().

        capture and tee are stream masks (1 stdout, 2 stderr, 3 both): a captured stream goes to
        `log_file`; a teed one goes there too and to the console as `[rank N] line`. `show`
        False (--local-ranks-filter) keeps a rank off the console. `applog`: (path, prefix) of
        NVRx's per-cycle application log, which gets both streams.
        """
        fh = self.open_log(log_file) if log_file and (capture | tee) else None
        if log_file and (capture | tee) and fh is None:
            capture = 0   # the file cannot be had: the console gets what it would have got
        app = self.open_log(applog[0]) if applog else None
        args, sinks = [], []
        for bit, console in ((1, sys.stdout), (2, sys.stderr)):
            to_file = fh is not None and bool((capture | tee) & bit)
            to_console = show and (bool(tee & bit) or not capture & bit)
            if not to_file and not to_console and app is None:
                args.append(subprocess.DEVNULL)
            elif not to_file and not tee & bit and app is None:
                args.append(None)  # plain console: inherit, no copy
            else:
                r, w = os.pipe()
                args.append(w)
                sinks.append((r, dict(file=fh if to_file else None,
                                      console=console if to_console else None,
                                      prefix=f"[rank {rank}] ".encode() if tee & bit else b"", rest=b"",
                                      app=app, app_prefix=applog[1].encode() if app else b"")))
        return args[0], args[1], ((sinks, fh) if sinks or fh else None)

    def open_log(self, path: str):
        """`path` opened for appending (its directory made if missing), or None when the disk
        refuses (then the rank's output goes to the console)."""
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            return open(path, "ab", buffering=0)
        except OSError as exc:
            self.warn(f"cannot open the rank log {path} (the rank's output goes to the console)", exc)
            return None

    def attach(self, handle) -> None:
        """After Popen: start reading the pipes (and close our copies of the write ends)."""
        if handle is None:
            return
        sinks, _ = handle
        with self._lock:
            for r, sink in sinks:
                self._open[r] = sink
                self._sel.register(r, selectors.EVENT_READ, sink)
        os.write(self._wake_w, b"x")

    def _serve(self) -> None:
        while True:
            for key, _ in self._sel.select():
                if key.data is None:
                    os.read(self._wake_r, 4096)
                    continue
                self._pump(key.fd, key.data)

    def _pump(self, fd: int, sink: dict) -> None:
        try:
            data = os.read(fd, 65536)
        except OSError:
            data = b""
        if not data:
            self._emit(sink, sink["rest"], final=True)
            with self._lock:
                self._sel.unregister(fd)
                self._open.pop(fd, None)
            os.close(fd)
            sink["closed"] = True
            return
        data = sink["rest"] + data
        cut = data.rfind(b"\n") + 1
        sink["rest"] = data[cut:]
        self._emit(sink, data[:cut])

    @staticmethod
    def _emit(sink: dict, data: bytes, final: bool = False) -> None:
        if not data:
            return
        if final and not data.endswith(b"\n"):
            data += b"\n"
        if sink["file"] is not None:
            try:
                sink["file"].write(data)
            except (OSError, ValueError):
                pass
        if sink.get("app") is not None:   # one write per chunk of whole lines (O_APPEND: no interleaving)
            lines = data.split(b"\n")[:-1]
            try:
                sink["app"].write(b"".join(sink["app_prefix"] + line + b"\n" for line in lines))
            except (OSError, ValueError):
                pass
        if sink["console"] is not None:
            prefix = sink["prefix"]
            text = b"".join(prefix + line + b"\n" for line in data.split(b"\n")[:-1])
            try:
                sink["console"].buffer.write(text)
                sink["console"].flush()
            except (OSError, ValueError):
                pass

    def redirect(self, handle, log_file: Optional[str], applog: Optional[str] = None, rank: int = 0):
        """A rank restarted in place goes on in the next cycle's log file (and in `applog`, the
        next cycle's NVRx application log, as global rank `rank`): its captured streams are
        written there from now on. Returns the handle to use from now on."""
        if handle is None:
            return handle
        sinks, old = handle
        first = next((s for _, s in sinks if s.get("app") is not None), None)
        if applog and first is not None:
            app_old, app_new = first["app"], self.open_log(applog)
            if app_new is not None:
                width = len(first["app_prefix"]) - 2   # the job's size is the same in place
                prefix = f"{rank:>{width}}: ".encode()
                with self._lock:
                    for _, sink in sinks:
                        if sink.get("app") is app_old:
                            sink["app"], sink["app_prefix"] = app_new, prefix
                app_old.close()
        if old is None or not log_file:
            return handle
        new = self.open_log(log_file)
        if new is None:
            return handle   # it goes on in the old cycle's file
        with self._lock:
            for _, sink in sinks:
                if sink["file"] is old:
                    sink["file"] = new
        old.close()
        return sinks, new

    def finish(self, handle, timeout: float = 2.0) -> None:
        """After the rank (and its process group) is gone: drain and close its pipes."""
        if handle is None:
            return
        sinks, fh = handle
        deadline = threading.Event()
        for _ in range(int(timeout / 0.01)):
            if all(s.get("closed") for _, s in sinks):
                break
            deadline.wait(0.01)
        if fh is not None:
            fh.close()
        for app in {id(s["app"]): s["app"] for _, s in sinks if s.get("app") is not None}.values():
            app.close()
