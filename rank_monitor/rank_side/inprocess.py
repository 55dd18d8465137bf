"""In-process restart, the rank side: `ft_launcher.restartable(fn)`.

The wrapper runs the training function; when the launcher restarts the job in place, it leaves
the function, destroys the process group, waits at the agents' barrier, takes the new cycle's
environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_RESTART_COUNT, ...) and calls the
function again, in the same process: torch, the CUDA context and every import stay.

How it talks to the agent: the words H_IP_* of the rank's shared-memory record (shm_layout).
- On entry it sets IP_RUNNING: the agent counts a node whose ranks all did as restartable.
- The agent asks for a restart by writing H_IP_REQUEST (the next cycle's number) and sending
  IN_PLACE_SIGNAL; the handler raises RestartInPlace in the main thread, where the function is
  running. A main thread blocked in a collective leaves it when the collective fails (gloo: a peer's
  sockets close as it dies or tears its group down) and the handler runs then. The agent also
  wakes the rank's restart watcher thread (rank_monitor.rank_side.restart_watcher), which settles
  the GPU's committed steps and aborts NCCL's communicators at once, so a main thread blocked in a
  CUDA sync behind a collective returns without waiting for the handler.
- When the function raises by itself, the rank reports it (IP_FAILED, the exception's one-line
  summary, a byte on the agent's wake pipe) and waits, at most REPORT_WAIT, for the agent's request
  before tearing its process group down, so that its peers' errors (their collectives fail when its
  sockets close) reach the agents after the report that names the real cause. An exception that
  says a peer is gone (PEER_LOST) waits up to PEER_GRACE for the restart that peer's failure brings
  before it counts as this rank's own failure.
- At the restart point it first shuts down the connections the failed cycle opened to the job's
  nodes (rank_monitor.peer_sockets: a DDP reducer keeps a gloo group's sockets open, and a peer
  waiting for this rank's data learns that it is gone only when they close), then settles the
  GPU and aborts NCCL unless the watcher did (restart_watcher.act), destroys the process group,
  clears torch's DTensor caches that hold the group's DeviceMesh (rank_side.dtensor_cycle), frees what the failed call held (a full garbage collection, cheap because what existed before
  the first call was frozen out of the collector's view, gc.freeze, as in a warm reserve),
  empties the CUDA cache (empty_cuda_cache), sets IP_READY and waits for H_IP_GO; the
  agent kills a rank that does not get there within inprocess_timeout and replaces it.
- On H_IP_GO it reads the environment the agent wrote (shm_layout.env_file), updates os.environ,
  starts a new incarnation of its monitor record (new sections, heartbeats) and calls the function.

Live state (rank_monitor.rank_side.live.live_state): while a rank is inside `LiveState.commit` (its optimizer
step), the restart signal waits: the handler only notes it (and NCCL's abort waits with it), and
the commit's end acts on it, so a step is either wholly done or not begun. A rank whose function
raised by itself (IP_FAILED) is marked suspect for the next call's `LiveState.restore`.

A step re-run from memory (rank_side.live.step_guard): every rank raises StepRerun together when
the step guard finds a step not finite; the wrapper calls the function again at once, in the same
cycle and without the agent: no teardown, the process group kept (the call's first
init_process_group finds it and keeps it: `_keep_group_on_init`), and `LiveState.restore()` gives
each rank back its committed state. `_STATE.calls` counts the calls (a re-run is one), and
`_STATE.rerun` says that the running call is a re-run.

Each call's process groups are held by the wrapper (rank_side.call_groups) until the call has
ended and torch's threads have settled, then let go: a group whose last reference was a local of
the function (DDP's Reducer) is never destroyed while a gloo worker of it waits for the GIL (a
deadlock that left ranks restarted in place hanging at the job's end). Each call also marks its
start for the flight recorder (rank_monitor.flight_recorder.mark_call): a dump holds the current
call's collectives only, never an earlier call's unfinished ones.

At the rank's end (the function returned, the script goes on to exit) rank_side.exit_settle lets
torch's threads finish what still needs Python before the interpreter finalizes: a gloo worker that
frees a finished collective's tensors then would abort a rank whose training completed.

Outside ft_launcher, or when the launcher's restart granularity is `job`, it only calls the function.
SystemExit and KeyboardInterrupt pass through; so does an exception when no in-process restart can
follow (the agent then ends the rank and restarts it the usual way).
"""
from __future__ import annotations

import functools
import gc
import json
import os
import signal
import sys
import threading
import time
import traceback
from typing import Callable, Optional

from ft_launcher.rank_monitor import rerun_env, shm_layout as L

ENV_WAKE_FD = "FT_LAUNCHER_WAKE_FD"            # the agent's wake pipe (write end), inherited
ENV_GRANULARITY = "FT_LAUNCHER_RESTART_GRANULARITY"
ENV_EMPTY_CUDA_CACHE = "FT_LAUNCHER_EMPTY_CUDA_CACHE"
IN_PLACE_SIGNAL = signal.SIGRTMIN + 3 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR1
REPORT_WAIT = 1.0     # seconds a rank whose function raised waits for the agent's request
PEER_GRACE = 2.0      # seconds a rank whose peer went away waits for the restart that peer's failure brings
# What a collective or the store raises when a peer is gone (its process died or left its group):
# torch's typed errors (DistNetworkError from a store or socket, DistBackendError from a backend such
# as NCCL) and Python's ConnectionError by type; gloo raises a bare RuntimeError, known only by its words.
PEER_LOST_TYPES = ("DistNetworkError", "DistBackendError")
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Read error",
             "Write error", "Connection refused", "failed to recv", "Socket Timeout")
POLL = 0.002          # seconds between looks at the record while waiting
TEARDOWN_SETTLE_S = 0.2   # at a restart point, at most this long for torch's threads before the groups go


class RestartInPlace(BaseException):
    """Raised in the main thread when the launcher restarts the job in place. A BaseException, so
    `except Exception` in training code does not swallow it; let it pass."""


class StepRerun(BaseException):
    """Raised on every rank together by LiveState's step guard (rank_side.live.step_guard) when a
    step must be re-run from memory: the wrapper calls the function again in this process with the
    same process group (no teardown, no agent), and `LiveState.restore()` gives each rank back its
    committed state. A BaseException, like RestartInPlace: let it pass."""


class _State:
    def __init__(self) -> None:
        self.active = False          # the function is running in the main thread
        self.calls = 0               # calls of the function in this process (a re-run is a call)
        self.rerun = False           # the running call re-runs a step from memory (StepRerun)
        self.keep_group = False      # the running call's init_process_group keeps the group it finds
        self.raised_for = 0          # the request a RestartInPlace was already raised for
        self.installed = False
        self.in_commit = False       # inside LiveState.commit: a restart signal waits for its end
        self.deferred = False        # a restart signal arrived inside a commit
        self.failed_last = False     # the previous call raised by itself (not a restart's consequence)


_STATE = _State()
_ON_TEARDOWN: list = []   # callables run at each restart point before the garbage collection (on_teardown)


def on_teardown(fn: Callable[[], None]) -> None:
    """Run `fn` at every restart point, after the process group is gone and before the failed
    call's garbage is collected (live_state drops the held modules' gradients there)."""
    if fn not in _ON_TEARDOWN:
        _ON_TEARDOWN.append(fn)


def _load_restart_parts() -> None:
    """The parts only a restartable call uses, loaded at its first call: the agent imports this
    module for its variables' names, and a rank without ft.restartable never needs them."""
    global flight_recorder, peer_sockets, call_groups, exit_settle, restart_watcher, dtensor_cycle
    from ft_launcher.rank_monitor import flight_recorder, peer_sockets
    from ft_launcher.rank_monitor.rank_side import call_groups, dtensor_cycle, exit_settle, restart_watcher


def _record():
    """(mm, words) of the rank's record, or None outside ft_launcher."""
    from ft_launcher.rank_monitor.rank_side.shm_attachment import _ATT

    if not _ATT.ensure():
        return None
    return _ATT.mm, _ATT.words


def _wake_agent() -> None:
    fd = os.environ.get(ENV_WAKE_FD)
    if fd:
        try:
            os.write(int(fd), b"i")
        except (OSError, ValueError):
            pass


def _on_restart_signal(signum, frame) -> None:
    rec = _record()
    if rec is None:
        return
    words = rec[1]
    if _STATE.in_commit:   # the optimizer step finishes first (commit_done acts on the signal)
        _STATE.deferred = True
        return
    request = words[L.H_IP_REQUEST]
    if request > words[L.H_IP_SEEN]:
        restart_watcher.kick()   # it settles the GPU's commits and aborts NCCL, unless it already did
    if _STATE.active and request > words[L.H_IP_SEEN] and request != _STATE.raised_for:
        _STATE.raised_for = request
        raise RestartInPlace(f"the launcher restarts the job in place (cycle {request})")


def commit_done() -> None:
    """The end of a LiveState.commit: act on a restart signal that arrived inside it."""
    _STATE.in_commit = False
    if _STATE.deferred:
        _STATE.deferred = False
        _on_restart_signal(IN_PLACE_SIGNAL, None)


def _install() -> bool:
    if _STATE.installed:
        return True
    try:
        signal.signal(IN_PLACE_SIGNAL, _on_restart_signal)
    except ValueError:   # not the main thread
        return False
    _STATE.installed = True
    return True


def _keep_group_on_init() -> None:
    """A re-run's call (StepRerun) finds the process group of the call before it: its first
    init_process_group keeps that group instead of failing ("initialize the default process group
    twice"); a group it asks for later is made as usual (the wrap is rank_side.dist_patch's)."""
    from ft_launcher.rank_monitor.rank_side import dist_patch

    dist_patch.on_init("inprocess.rerun", _keep_group)


def _keep_group() -> bool:
    """dist_patch's question at an init_process_group: keep the group? Asked once per re-run."""
    keep, _STATE.keep_group = _STATE.keep_group, False
    return keep


def _teardown() -> None:
    """Leave nothing of the failed cycle that holds the process group or memory."""
    live_teardown = sys.modules.get("ft_launcher.rank_monitor.rank_side.live.live_teardown")
    if live_teardown is not None:   # a buddy exchange in flight fails with its peers' connections: let it end
        live_teardown.teardown_buddy(join_for=2.0)
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        try:   # NCCL's communicators were aborted (restart_watcher.act): gloo's group is destroyed here
            if dist.is_initialized():   # torch's own: the script's end (the replicas' last comparison) is not here
                getattr(dist.destroy_process_group, "__wrapped__", dist.destroy_process_group)()
        except Exception as exc:  # noqa: BLE001 - an aborted group may complain; it is gone either way
            sys.stderr.write(f"ft_launcher: destroying the process group at the restart: {exc!r}\n")
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is not None and not c10d.is_initialized():
        # An init_process_group that failed half-way (a peer died while it waited) took a group
        # name; the next one must take the same name as its peers' ("0"), as after a destroy.
        c10d._world.group_count = 0
    dtensor_cycle.forget_meshes()   # torch's DTensor caches would hand the next call this call's DeviceMesh
    sys.last_type = sys.last_value = sys.last_traceback = None
    for fn in _ON_TEARDOWN:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a hook must not stop the restart
            sys.stderr.write(f"ft_launcher: at the restart point: {exc!r}\n")
    gc.collect()
    call_groups.release(TEARDOWN_SETTLE_S)   # the failed call's groups go once torch's threads are done with Python
    torch = sys.modules.get("torch")
    if (torch is not None and os.environ.get(ENV_EMPTY_CUDA_CACHE, "1") == "1"
            and torch.cuda.is_available() and torch.cuda.is_initialized()):
        torch.cuda.empty_cache()


def _peer_lost(exc: BaseException) -> bool:
    dist = sys.modules.get("torch.distributed")
    types = tuple(getattr(dist, name) for name in PEER_LOST_TYPES if hasattr(dist, name))
    if isinstance(exc, ConnectionError) or (types and isinstance(exc, types)):
        return True
    return isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in PEER_LOST)


def _summary(exc: BaseException) -> str:
    where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    at = f" at {os.path.basename(where[0].filename)}:{where[0].lineno}" if where else ""
    return f"{type(exc).__name__}: {exc}{at}".replace("\n", " ")[:400]


def _wait(words, word: int, target: int, limit: Optional[float]) -> bool:
    """Wait until words[word] >= target (at most `limit` s; None: as long as it takes)."""
    deadline = None if limit is None else time.monotonic() + limit
    while words[word] < target:
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(POLL)
    return True


def _next_environment(path: str) -> None:
    with open(path) as fh:
        env = json.load(fh)
    os.environ.update({k: str(v) for k, v in env.items()})
    for name in rerun_env.ALL:   # a re-run's variables hold for the cycle after a 16 only
        if name not in env:
            os.environ.pop(name, None)


class _Run:
    def __init__(self, fn: Callable, args, kwargs) -> None:
        self.fn, self.args, self.kwargs = fn, args, kwargs

    def __call__(self):
        rec = _record() if os.environ.get(ENV_GRANULARITY, "job") != "job" else None
        if rec is not None:
            _load_restart_parts()   # before the restart signal's handler is installed: it kicks the watcher
        if rec is None or threading.current_thread() is not threading.main_thread() or not _install():
            return self.fn(*self.args, **self.kwargs)
        mm, words = rec
        from ft_launcher.rank_monitor.rank_side.shm_attachment import _ATT

        restart_watcher.start()
        exit_settle.install()   # the rank's end: torch's threads finish with Python before it finalizes

        # What exists before the first call (torch, every import) leaves the garbage collector's
        # view, as in a warm reserve: the full collection at each restart then costs ~1 ms instead
        # of ~135 ms with torch loaded, and so do the training loop's own old-generation collections.
        gc.freeze()
        rerun = False
        while True:
            _STATE.calls += 1
            _STATE.rerun = _STATE.keep_group = rerun
            if rerun:
                _keep_group_on_init()
            rerun = False
            sockets_before = set(peer_sockets.socket_inodes())
            words[L.H_IP_FAIL_NS] = 0
            words[L.H_IP_STATE] = L.IP_RUNNING
            failed = False
            _STATE.in_commit = _STATE.deferred = False
            flight_recorder.mark_call()   # dumps from now on hold this call's collectives only
            call_groups.hold()            # its process groups outlive its frame until torch's threads settle
            try:
                _STATE.active = True
                try:
                    result = self.fn(*self.args, **self.kwargs)
                finally:
                    _STATE.active = False
                words[L.H_IP_STATE] = L.IP_DONE
                call_groups.release()
                return result
            except RestartInPlace:
                _STATE.active = False
            except StepRerun:   # the step guard: the same step again, same process, same group
                _STATE.active = False
                _STATE.failed_last = False
                rerun = True
                gc.collect()
                call_groups.release(0.0)
                continue
            except (SystemExit, KeyboardInterrupt, GeneratorExit):
                raise
            except BaseException as exc:  # noqa: BLE001 - the failure this wrapper exists for
                _STATE.active = False
                seen = words[L.H_IP_SEEN]
                if _peer_lost(exc):   # most likely a consequence: the peer's failure brings the restart
                    _wait(words, L.H_IP_REQUEST, seen + 1, PEER_GRACE)
                if words[L.H_IP_REQUEST] <= seen:   # not a consequence of a restart
                    failed = True
                    traceback.print_exc()
                    L.write_ip_text(mm, words, _summary(exc))
                    words[L.H_IP_FAIL_NS] = time.monotonic_ns()
                    words[L.H_IP_STATE] = L.IP_FAILED
                    _wake_agent()
                del exc
            _STATE.failed_last = failed
            seen = words[L.H_IP_SEEN]
            if failed:
                if not _wait(words, L.H_IP_REQUEST, seen + 1, REPORT_WAIT):
                    sys.stderr.write("ft_launcher: no restart request yet for the exception above; tearing "
                                     "down the process group and waiting for the launcher\n")
            peer_sockets.shut_down_new_peer_connections(sockets_before)   # first: peers blocked on us go on
            pending = words[L.H_IP_REQUEST]
            restart_watcher.act(pending if pending > seen else 0)   # unless the watcher did: GPU settled, NCCL aborted
            _teardown()
            _wait(words, L.H_IP_REQUEST, seen + 1, None)   # the agent ends a rank it does not restart
            request = words[L.H_IP_REQUEST]
            words[L.H_IP_SEEN] = request
            words[L.H_IP_STATE] = L.IP_READY
            _wake_agent()
            _wait(words, L.H_IP_GO, request, None)          # the agent kills a rank it gives up on
            _next_environment(L.env_file(os.environ[L.ENV_SHM]))
            _ATT.new_cycle()


def restartable(fn: Optional[Callable] = None):
    """Run `fn` so that the launcher can restart it in this process (see the module docstring):
    `@ft_launcher.restartable` over the training function, or `ft_launcher.restartable(train)(...)`.
    The function must build everything that holds the process group (the group itself, DDP,
    optimizers over DDP's parameters) and reload the last checkpoint on every call."""
    if fn is None:
        return restartable

    @functools.wraps(fn)
    def run(*args, **kwargs):
        return _Run(fn, args, kwargs)()

    return run
