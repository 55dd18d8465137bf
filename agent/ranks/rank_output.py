"""Rank output: where each rank's stdout/stderr go (console, per-cycle log file, or both).

Captured streams come through pipes that one reader thread serves for all ranks: each complete
line is written to the rank's file `<log_dir>/cycle_<c>/rank_<r>.log` and, when teed, to the
agent's stdout as `[rank N] line`. A stdout that is neither captured nor filtered out is
inherited directly (no thread, no copy); a stderr bound for the console always comes through the
agent, so that it can tell a failure's culprit before its victims:

- A Python traceback (agent.ranks.tracebacks) reaches the console whole, once complete. One
  whose exception is only a collective's error from peers that went away (gloo's "Connection
  closed by peer", NCCL's abort, ...) is held back (at most HOLD seconds) until the agent names
  the failure's culprit (`culprit`, after its own line): for a rank other than the culprit it then
  becomes one line, its exception and whom it was waiting on (the whole traceback stays in the
  rank's log file); with no culprit named in time, or for the culprit itself, it is printed whole.
  Nothing else is held back: a real error prints as soon as its traceback is complete.
- A traceback the console has already shown (the same text, from another rank or an earlier
  cycle) is one line: its exception and "the same error as rank R in cycle C".
- The last traceback of each rank and cycle is kept (`error`): the agent feeds it to the restart
  policy, which stops a job that fails the same way again before any progress.

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
import select
import selectors
import subprocess
import sys
import threading
import time
from typing import Callable, Collection, Dict, List, Optional, Tuple

from ft_launcher.agent.ranks import tracebacks
from ft_launcher.agent.ranks.tracebacks import Block

HOLD = 5.0   # seconds a victim's traceback waits for the failure's culprit to be named
RECYCLE_WAIT = 2.0   # seconds `recycle` waits for the reader thread to read what the old call wrote


class RankOutput:
    def __init__(self, warn: Optional[Callable[[str, OSError], None]] = None) -> None:
        self.warn = warn or (lambda what, exc: None)
        self._sel = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._open: Dict[int, dict] = {}
        self._out_lock = threading.RLock()      # tracebacks: what reaches the console, and in which order
        self._reading: List[dict] = []           # stderr sinks with a traceback being read
        self._held: List[Tuple[dict, Block, float]] = []   # victims' tracebacks: (sink, block, deadline)
        self._culprits: Dict[int, Tuple[Optional[frozenset], str]] = {}   # cycle -> (ranks or None, words)
        self._shown: Dict[str, Tuple[int, int]] = {}   # traceback signature -> (rank, cycle) that showed it
        self._errors: Dict[Tuple[int, int], Block] = {}   # (cycle, rank) -> its last traceback
        self._recycling: List[tuple] = []        # (handle, rank, cycle, done): for the reader thread
        self._thread = threading.Thread(target=self._serve, name="ft-rank-output", daemon=True)
        self._thread.start()

    def plan(self, rank: int, capture: int, tee: int, show: bool, log_file: Optional[str],
             applog: Optional[tuple] = None, cycle: int = 0):
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
            elif not to_file and not tee & bit and app is None and bit == 1:
                args.append(None)  # plain console stdout: inherit, no copy
            else:
                r, w = os.pipe()
                args.append(w)
                sinks.append((r, dict(file=fh if to_file else None,
                                      console=console if to_console else None,
                                      prefix=f"[rank {rank}] ".encode() if tee & bit else b"", rest=b"",
                                      app=app, app_prefix=applog[1].encode() if app else b"",
                                      errors=bit == 2, rank=rank, cycle=cycle, log_path=log_file if to_file else None,
                                      block=None)))
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
            waiting = self._reading or self._held
            for key, _ in self._sel.select(timeout=0.1 if waiting else None):
                if key.data is None:
                    os.read(self._wake_r, 4096)
                    self._recycle_due()
                    continue
                self._pump(key.fd, key.data)
            if waiting:
                self._due(time.monotonic())

    def _pump(self, fd: int, sink: dict) -> None:
        try:
            data = os.read(fd, 65536)
        except OSError:
            data = b""
        if not data:
            self._emit(sink, sink["rest"], final=True)
            if sink.get("block") is not None:   # the stream ended: its traceback is complete
                self._complete(sink)
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

    def _emit(self, sink: dict, data: bytes, final: bool = False) -> None:
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
        if sink.get("errors"):
            self._read_errors(sink, data.split(b"\n")[:-1])
        elif sink["console"] is not None:
            self._write(sink, data.split(b"\n")[:-1])

    @staticmethod
    def _write(sink: dict, lines: List[bytes]) -> None:
        if sink["console"] is None or not lines:
            return
        prefix = sink["prefix"]
        try:
            sink["console"].buffer.write(b"".join(prefix + line + b"\n" for line in lines))
            sink["console"].flush()
        except (OSError, ValueError):
            pass

    @staticmethod
    def _say(sink: dict, text: str) -> None:
        """A line of ours about the rank's output, teed or not: `[rank N] text`."""
        if sink["console"] is None:
            return
        try:
            sink["console"].buffer.write(f"[rank {sink['rank']}] {text}\n".encode("utf-8", errors="replace"))
            sink["console"].flush()
        except (OSError, ValueError):
            pass

    # ---- tracebacks on stderr (see the module docstring) --------------------------------------
    def _read_errors(self, sink: dict, lines: List[bytes]) -> None:
        now = time.monotonic()
        with self._out_lock:
            passing: List[bytes] = []
            for line in lines:
                block = sink["block"]
                if block is not None and block.complete(now):
                    self._complete(sink)
                    block = None
                if block is None:
                    if tracebacks.starts(line):
                        self._write(sink, passing)
                        passing = []
                        sink["block"] = Block(line, now)
                        self._reading.append(sink)
                    else:
                        passing.append(line)
                else:
                    block.add(line, now)
            self._write(sink, passing)

    def _complete(self, sink: dict) -> None:
        """The traceback being read on `sink` is whole: show it, fold it, or hold it."""
        with self._out_lock:
            block, sink["block"] = sink["block"], None
            if sink in self._reading:
                self._reading.remove(sink)
            if block is None:
                return
            self._errors[(sink["cycle"], sink["rank"])] = block
            if sink["console"] is None:
                return
            if block.victim():
                culprit = self._culprits.get(sink["cycle"])
                if culprit is None:
                    self._held.append((sink, block, time.monotonic() + HOLD))
                else:
                    self._release(sink, block, culprit)
                return
            self._show(sink, block)

    def _show(self, sink: dict, block: Block) -> None:
        """The whole traceback, or one line when the console has shown the same one before."""
        signature = block.signature()
        seen = self._shown.get(signature)
        if seen is None:
            self._shown[signature] = (sink["rank"], sink["cycle"])
            self._write(sink, block.lines)
            return
        rank, cycle = seen
        where = f"rank {rank}" + (f" in cycle {cycle}" if cycle != sink["cycle"] else "")
        self._say(sink, f"{tracebacks.short(block.exception())} (the same error as {where}: traceback not repeated"
                        + (f"; whole in {sink['log_path']})" if sink["log_path"] else ")"))

    def _release(self, sink: dict, block: Block, culprit: Tuple[Optional[frozenset], str]) -> None:
        ranks, words = culprit
        if ranks is not None and sink["rank"] in ranks:   # its own failure: the real error
            self._show(sink, block)
            return
        kept = (f"whole in {sink['log_path']}" if sink["log_path"]
                else "--log-dir keeps every rank's output")
        self._say(sink, f"{tracebacks.short(block.exception())} (it was waiting on {words}: "
                        f"its {len(block.lines)}-line traceback folded; {kept})")

    def _due(self, now: float) -> None:
        """Tracebacks whose time has come: complete ones, and held ones no culprit claimed."""
        with self._out_lock:
            for sink in [s for s in self._reading if s["block"] is not None and s["block"].complete(now)]:
                self._complete(sink)
            for entry in [e for e in self._held if e[2] <= now]:
                self._held.remove(entry)
                self._show(entry[0], entry[1])

    def culprit(self, cycle: int, ranks: Optional[Collection[int]], words: str) -> None:
        """The agent has said which rank(s) failed in `cycle` (None: on another node), in `words`
        (`rank 1`, ...): the victims' tracebacks held for it are folded into one line each."""
        with self._out_lock:
            culprit = (frozenset(ranks) if ranks is not None else None, words)
            self._culprits.setdefault(cycle, culprit)
            for entry in [e for e in self._held if e[0]["cycle"] == cycle]:
                self._held.remove(entry)
                self._release(entry[0], entry[1], self._culprits[cycle])

    def error(self, cycle: int, rank: int) -> Optional[Tuple[str, str]]:
        """(signature, exception line) of the last traceback rank `rank` printed in `cycle`, or None."""
        block = self._errors.get((cycle, rank))
        return None if block is None else (block.signature(), block.exception())

    def flush(self) -> None:
        """The agent is ending: every traceback still being read or held goes out whole."""
        with self._out_lock:
            for sink in list(self._reading):
                self._complete(sink)
            held, self._held = self._held, []
            for sink, block, _ in held:
                self._show(sink, block)

    def recycle(self, handle, rank: int, cycle: int) -> None:
        """A rank restarted in place is rank `rank` of `cycle` from now on. What it wrote in its
        previous call is all in its pipes by now (it is adopted only once that call has ended): the
        reader thread reads it first, as the old cycle's, and a traceback it was reading is complete
        there, so an earlier cycle's exception is never this cycle's `error` (nor in its log file)."""
        if handle is None:
            return
        done = threading.Event()
        with self._lock:
            self._recycling.append((handle, rank, cycle, done))
        os.write(self._wake_w, b"x")
        if not done.wait(RECYCLE_WAIT):   # the reader thread is stuck: what is unread goes to the new cycle
            for _, sink in handle[0]:
                sink["rank"], sink["cycle"] = rank, cycle

    def _recycle_due(self) -> None:
        """On the reader thread: drain the recycled ranks' pipes, then give them their new cycle."""
        with self._lock:
            due, self._recycling = self._recycling, []
        for handle, rank, cycle, done in due:
            for fd, sink in handle[0]:
                for _ in range(64):   # a rank at its restart point writes nothing more: a bound all the same
                    if sink.get("closed") or not select.select([fd], [], [], 0)[0]:
                        break
                    self._pump(fd, sink)
                if sink.get("block") is not None:
                    self._complete(sink)
                sink["rank"], sink["cycle"] = rank, cycle
            done.set()

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
                    sink["log_path"] = log_file
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
