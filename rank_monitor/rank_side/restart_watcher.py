"""The rank's restart watcher: a thread that acts on an in-place restart request at once, even
while the main thread is blocked in a call that does not return to Python (a CUDA synchronize
behind a collective that waits on a dead peer).

The restart signal's Python handler (rank_monitor.rank_side.inprocess) runs only in the main
thread, and only when the main thread is back in the interpreter: a main thread blocked in
`torch.cuda.synchronize()` or `loss.item()` behind an NCCL collective that never completes runs it
only when that call returns (2 s late on an H100, or never). NCCL's communicators can be aborted
from another thread, and then the blocked call returns. So each rank under `ft.restartable` keeps
this thread, blocked (no polling, no GIL) on a named pipe beside its shared-memory record
(shm_layout.wake_pipe); the agent writes a byte into it after it writes the request word
(agent.ranks.inprocess_ranks.request), and the signal handler does too (`kick`). On a request the
thread (`act`, once per request):
1. waits for a commit in progress to end (at most COMMIT_WAIT_S: a step is wholly done or not begun);
2. settles the GPU-complete commits (rank_monitor.rank_side.gpu_commit: a step counts only if its
   GPU work completed before the abort; else the state is suspect);
3. calls the functions in `ON_REQUEST` (tests and the GPU bench time the reaction there);
4. aborts the NCCL communicators of every process group with torch's own abort
   (`torch.distributed.distributed_c10d._abort_process_group()`: every group's `abort()` inside
   one NCCL group call, then the groups forgotten; the restart point then has nothing to destroy),
   when some device of the default group uses NCCL (rank_monitor.rank_side.comm_backend: also
   `init_process_group()` with no backend, "cpu:gloo,cuda:nccl" or `device_id=`).
The main thread's restart point calls `act` too (a function that raised by itself gets no
request first; a watcher that could not start): whoever comes first acts, the other waits for it.
gloo's collectives cannot be aborted: a gloo group ends when its peers' sockets close, as before.
Nothing here imports torch.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Callable, List, Optional

from ft_launcher.rank_monitor import atomic_file
from ft_launcher.rank_monitor import shm_layout as L
from ft_launcher.rank_monitor.rank_side import comm_backend
from ft_launcher.rank_monitor.rank_side import gpu_commit

COMMIT_WAIT_S = 2.0   # seconds a request waits for a commit in progress to end before aborting regardless
# Called in the acting thread with the request's cycle (0: a restart point without a request), after
# the GPU settled and before the abort; an exception there is said in one line and ignored.
ON_REQUEST: List[Callable[[int], None]] = []


class _Watcher:
    def __init__(self) -> None:
        self.pid: Optional[int] = None    # the process that started the thread (a fork's child has none)
        self.fd: Optional[int] = None     # the wake pipe, open for reading and writing
        self.lock = threading.Lock()      # one act at a time
        self.done = 0                     # the last request acted on
        # The last act (monotonic ns), for tests and the GPU bench: request, by (thread name),
        # started, settled (GPU commits), aborted (0: nothing to abort), clean (settle's answer).
        self.last: dict = {}
        self.inprocess = None             # rank_side.inprocess, resolved at start: no import on the act path


_W = _Watcher()


def start() -> bool:
    """Start this process's watcher (once) when it runs under ft_launcher; True if it runs."""
    if _W.pid == os.getpid():
        return True
    from ft_launcher.rank_monitor.rank_side import inprocess

    _W.inprocess = inprocess
    shm = os.environ.get(L.ENV_SHM)
    if not shm:
        return False
    path = L.wake_pipe(shm)
    try:
        atomic_file.discard(path)   # the previous incarnation's pipe: its reader is gone
        os.mkfifo(path, 0o600)
        fd = os.open(path, os.O_RDWR)   # read and write: opening it never blocks, a writer never finds no reader
    except OSError as exc:
        sys.stderr.write(f"ft_launcher: warning: no restart watcher in this rank (cannot make {path}: "
                         f"{exc.strerror or exc}); a restart acts when the main thread takes its signal\n")
        return False
    _W.fd, _W.pid, _W.done = fd, os.getpid(), 0
    threading.Thread(target=_serve, args=(fd,), name="ft-restart-watcher", daemon=True).start()
    return True


def running() -> bool:
    return _W.pid == os.getpid() and _W.fd is not None


def last_act() -> dict:
    """The last act's times (see _Watcher.last); {} before any."""
    return dict(_W.last)


def _serve(fd: int) -> None:
    from ft_launcher.rank_monitor.rank_side.shm_attachment import DUMP_SIGNAL
    from ft_launcher.rank_monitor.rank_side.inprocess import IN_PLACE_SIGNAL

    # The main thread must take these: the restart signal interrupts its blocked system calls, and
    # faulthandler's stack dump walks the frames of the thread that takes its signal.
    signal.pthread_sigmask(signal.SIG_BLOCK, {DUMP_SIGNAL, IN_PLACE_SIGNAL})
    while True:
        try:
            data = os.read(fd, 64)
        except OSError:
            return
        if not data:
            return
        act_on_request()


def kick() -> None:
    """The restart signal's handler (main thread): wake the watcher, or act from a new thread."""
    if running():
        try:
            os.write(_W.fd, b"k")
            return
        except OSError:
            pass
    threading.Thread(target=act_on_request, name="ft-restart-act", daemon=True).start()


def _inprocess():
    if _W.inprocess is None:
        from ft_launcher.rank_monitor.rank_side import inprocess

        _W.inprocess = inprocess
    return _W.inprocess


def act_on_request() -> None:
    """Act on the request in the rank's record, if there is one not yet acted on."""
    rec = _inprocess()._record()
    if rec is None:
        return
    words = rec[1]
    request = words[L.H_IP_REQUEST]
    if request > words[L.H_IP_SEEN]:
        act(request)


def act(request: int) -> None:
    """Steps 1-4 of the module docstring, once per request (`request` 0: the restart point of a
    function that raised by itself, which always acts)."""
    inprocess = _inprocess()
    with _W.lock:
        if request and request <= _W.done:
            return
        last = {"request": request, "by": threading.current_thread().name, "started": time.monotonic_ns()}
        deadline = time.monotonic() + COMMIT_WAIT_S
        while inprocess._STATE.in_commit and time.monotonic() < deadline:
            time.sleep(0.0005)
        last["clean"] = gpu_commit.COMMITS.settle()
        last["settled"] = time.monotonic_ns()
        for fn in list(ON_REQUEST):
            try:
                fn(request)
            except Exception as exc:  # noqa: BLE001 - a hook never stops the restart
                sys.stderr.write(f"ft_launcher: restart watcher hook {fn!r}: {exc!r}\n")
        last["aborted"] = time.monotonic_ns() if abort_communicators() else 0
        _W.last = last
        if request:
            _W.done = max(_W.done, request)


def abort_communicators() -> bool:
    """Abort every process group's NCCL communicators (torch's abort); True if it did."""
    if not comm_backend.has_nccl():
        return False
    try:
        sys.modules["torch.distributed.distributed_c10d"]._abort_process_group()
    except Exception as exc:  # noqa: BLE001 - best effort: the agent's inprocess timeout is the bound
        sys.stderr.write(f"ft_launcher: aborting the NCCL communicators for the restart: {exc!r}\n")
    return True
