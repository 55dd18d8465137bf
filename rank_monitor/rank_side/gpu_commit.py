"""A LiveState commit counts its step only once the step's GPU work is done.

On a GPU the CPU returns from `opt.step()` when its kernels are queued, not run: the step is done
only when they have run, and they run after everything queued before them, such as the gradients'
all-reduce. A survivor of a dead peer may have queued step N's optimizer kernels behind an
all-reduce that never completes; when the in-place restart aborts the communicators, the all-reduce
ends with partial sums and the queued kernels then apply them: step N's state is neither N nor N-1.

So at the end of a clean commit (`committed`) a CUDA event is recorded on the current stream (one
of a few reused: no allocation, no host sync) and the step counts when the event has completed:
looked at, without waiting, at each later commit (`poll`), so the count lags the GPU by at most a
commit. At a restart request (`settle`, before the communicators are aborted) the pending steps get
at most SETTLE_S seconds to complete; a step whose work did not complete by then leaves the state
suspect (its kernels will run after the abort on what the abort left): the rank heals from a peer
or the job falls back to the checkpoint, never resuming from a half-applied step. Without CUDA in
use (torch not imported, no CUDA context) a step counts at the commit's end, as before.

`Events` is what makes and queries events: torch.cuda's, or a fake one in tests (CPU-only machines).
"""
from __future__ import annotations

import collections
import sys
import threading
import time
from typing import Callable, Deque, Optional, Tuple

SETTLE_S = 1.0      # seconds a restart gives queued GPU work to complete before the state counts as suspect
POOL = 4            # events kept for reuse (a commit's event is free again once its step counted)


class Events:
    """torch.cuda's events: `ready()` (CUDA in use here), `record()` -> event, `done(event)`."""

    def ready(self) -> bool:
        torch = sys.modules.get("torch")
        return torch is not None and torch.cuda.is_initialized()   # a CUDA context: CUDA work may be queued

    def new(self):
        import torch

        return torch.cuda.Event()

    def record(self, event) -> None:
        event.record()

    def done(self, event) -> bool:
        return event.query()


class GpuCommits:
    """The steps committed but not yet done on the GPU (see the module docstring)."""

    def __init__(self, events: Optional[Events] = None, settle_s: float = SETTLE_S) -> None:
        self.events = events or Events()
        self.settle_s = settle_s
        # (step, event, count): each LiveState counts its own steps (a GAN's G and D commit apart)
        self.pending: Deque[Tuple[int, object, Callable[[int], None]]] = collections.deque()
        self.free: list = []
        self.suspect = False   # a restart found a committed step whose GPU work had not completed
        self.lock = threading.Lock()   # the restart watcher settles from its thread

    def committed(self, step: int, count: Callable[[int], None]) -> None:
        """A commit of `step` ended cleanly: count it now (no CUDA) or once its GPU work is done."""
        with self.lock:
            if not self.events.ready():
                self.pending.clear()
                count(step)
                return
            event = self.free.pop() if self.free else self.events.new()
            self.events.record(event)
            self.pending.append((step, event, count))
            self._poll()

    def poll(self) -> None:
        """Count, in order, the pending steps whose GPU work is done (never waits)."""
        with self.lock:
            self._poll()

    def _poll(self) -> None:
        while self.pending and self.events.done(self.pending[0][1]):
            step, event, count = self.pending.popleft()
            if len(self.free) < POOL:
                self.free.append(event)
            count(step)

    def settle(self, timeout: Optional[float] = None) -> bool:
        """A restart, before the communicators are aborted: wait at most `timeout` (SETTLE_S) for
        the pending steps and count those done. False when some step's work did not complete: the
        state is suspect (`finish` says so to the next restore) and the rest are dropped."""
        deadline = time.monotonic() + (self.settle_s if timeout is None else timeout)
        while True:
            with self.lock:
                self._poll()
                if not self.pending:
                    return True
                if time.monotonic() >= deadline:
                    self.pending.clear()
                    self.suspect = True
                    return False
            time.sleep(0.0005)

    def discard(self) -> None:
        """A commit raised: what is pending no longer says anything about the state."""
        with self.lock:
            self.pending.clear()

    def finish(self) -> bool:
        """The next call's restore: True when every counted step's GPU work was done before the
        restart; False (the state is suspect) when a settle timed out or a step is still pending
        (nobody settled before the abort: its completion now says nothing). Starts afresh."""
        with self.lock:
            clean = not self.suspect and not self.pending
            self.suspect = False
            self.pending.clear()
            return clean


COMMITS = GpuCommits()
