"""torch's flight recorder, dumped on request: the rank's side, and the names the agent, the
monitors and the ranks agree on.

The launcher turns torch's flight recorder on for the ranks (`TORCH_FR_BUFFER_SIZE`, see
agent.recovery.flight_recorder). torch dumps it by itself only from NCCL's watchdog; to have every rank of
the job dump at the moment a monitor finds a hang, whatever the backend (gloo records too), each
rank that runs our client keeps a daemon thread blocked on a named pipe of its slot:

    $FT_LAUNCHER_FR_DIR/slot_<local_rank>.pipe      the agent writes "<cycle>\\n" into it
    $FT_LAUNCHER_FR_DIR/slot_<local_rank>_cycle_<c>.pkl   the rank's dump (torch's pickle), or
    $FT_LAUNCHER_FR_DIR/slot_<local_rank>_cycle_<c>.err   one line: why there is none

The thread costs nothing while it waits (a blocking open of the pipe, no polling) and runs the
dump outside the main thread, so a rank blocked in a collective (which releases the GIL) or
sleeping still dumps; a rank stopped (SIGSTOP) or holding the GIL in native code does not, and the
agent skips it after its bound. A monitor that finds a hang waits (bounded, `HOLD_SECONDS`) for
the agent's word that the job's ranks have dumped (or been skipped: `flight_done` on its control
channel) before it dumps the Python stack and stops the rank, so no rank is killed before the
job's traces are taken. Nothing here imports torch: the dump uses the torch the rank has imported
(NCCL's recorder through `_dump_nccl_trace` where a CUDA build has one and it holds entries, else
`_dump_fr_trace`, which holds gloo's).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Optional

from ft_launcher.rank_monitor import atomic_file

ENV_FR_DIR = "FT_LAUNCHER_FR_DIR"
# A monitor holds a hung rank at most this long for the job's flight-recorder dump (the agent's
# own bounds, a second per rank and two for the whole job, fit well inside it).
HOLD_SECONDS = 3.0


def pipe_path(fr_dir: str, local_rank: int) -> str:
    return os.path.join(fr_dir, f"slot_{local_rank}.pipe")


def dump_path(fr_dir: str, local_rank: int, cycle: int) -> str:
    return os.path.join(fr_dir, f"slot_{local_rank}_cycle_{cycle}.pkl")


def error_path(fr_dir: str, local_rank: int, cycle: int) -> str:
    return os.path.join(fr_dir, f"slot_{local_rank}_cycle_{cycle}.err")


_started: Optional[int] = None   # the pid that started the thread (a fork's child has none)


def start_from_env(block=()) -> bool:
    """Start the dump thread of this rank when the launcher asked for one; True if it runs.
    `block`: signals the thread must never take (the stack-dump signal: see _serve)."""
    global _started
    fr_dir = os.environ.get(ENV_FR_DIR)
    local_rank = os.environ.get("LOCAL_RANK")
    if not fr_dir or local_rank is None or _started == os.getpid():
        return _started == os.getpid()
    path = pipe_path(fr_dir, int(local_rank))
    try:
        try:
            os.unlink(path)    # the previous incarnation's pipe: its reader is gone
        except FileNotFoundError:
            pass
        os.mkfifo(path, 0o600)
    except OSError as exc:
        sys.stderr.write(f"ft_launcher: warning: no flight-recorder dumps from this rank: cannot make "
                         f"{path} ({exc.strerror or exc})\n")
        return False
    threading.Thread(target=_serve, args=(fr_dir, int(local_rank), path, tuple(block)), name="ft-flight-recorder",
                     daemon=True).start()
    _started = os.getpid()
    return True


def _serve(fr_dir: str, local_rank: int, path: str, block: tuple = ()) -> None:
    # A stopped rank's pending stack-dump signal goes, on SIGCONT, to whichever thread runs first;
    # faulthandler would then walk the main thread's frames from this thread while the main thread
    # runs (a truncated, garbled stack). Blocked here, the signal waits for a thread that can take it.
    if block:
        signal.pthread_sigmask(signal.SIG_BLOCK, block)
    while True:
        try:
            with open(path, "rb") as pipe:        # blocks until the agent opens it to write
                requests = pipe.read().split()
        except OSError:
            return
        for request in requests:
            try:
                dump(fr_dir, local_rank, int(request))
            except ValueError:
                continue


def dump(fr_dir: str, local_rank: int, cycle: int) -> None:
    """Write this process's flight-recorder trace for `cycle` (atomically), or one line saying why not."""
    target = dump_path(fr_dir, local_rank, cycle)
    try:
        if "torch" not in sys.modules:
            raise RuntimeError("the rank has not imported torch")
        from torch._C import _distributed_c10d as c10d   # the rank's torch, already imported

        data = None
        # NCCL's recorder is its own (CUDA events) in a CUDA build; every other backend's (gloo)
        # is _dump_fr_trace's. A job on NCCL dumps the first, one without NCCL entries the second.
        for name in ("_dump_nccl_trace", "_dump_fr_trace"):
            dump_fn = getattr(c10d, name, None)
            if dump_fn is None:
                continue
            data = dump_fn(includeCollectives=True, includeStackTraces=False, onlyActive=False)
            if _has_entries(data):
                break
        if data is None:
            raise RuntimeError("this torch has no flight recorder (torch._C._distributed_c10d._dump_fr_trace)")
        _write(target, data)
    except Exception as exc:  # noqa: BLE001 - the agent reports it as one line
        try:
            _write(error_path(fr_dir, local_rank, cycle), (str(exc).splitlines() or [repr(exc)])[0].encode())
        except OSError:
            pass


def _has_entries(data: bytes) -> bool:
    import pickle

    try:
        return bool(pickle.loads(data).get("entries"))
    except Exception:  # noqa: BLE001 - not ours to judge: pass it on as it is
        return True


def _write(path: str, data: bytes) -> None:
    atomic_file.write(path, data)
