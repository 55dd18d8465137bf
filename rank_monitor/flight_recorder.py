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

Each dump's `pg_config` names every process group the rank is a member of (name -> desc and the
global ranks, in group-rank order: NCCL's format): NCCL records only the groups whose communicator
it made, and gloo (torch 2.13) records none (one entry named '' with no ranks), while hang blame
must compare collective sequence numbers within one group and know who belongs to it.
`load_trace` reads a dump as plain data: a dump comes from a peer through the store, and a pickle
that names any class or function is refused, never run.

One call's evidence only: torch's recorder lives as long as the process and torch 2.13 offers
Python no way to reset it (FlightRecorder::reset_all is C++ only), so a rank restarted in place
(rank_side.inprocess) would dump its earlier calls' entries too: a collective the failed call never
finished, in a group of the same name ('0') and members as the new call's, reads as a wait of this
cycle on whoever failed then. The wrapper marks the start of each call (`mark_call`); a dump keeps
the entries created since (torch's `time_created_ns`, the same wall clock), and no `pg_status` of
a group id an earlier call's entries used: torch reuses ids across calls (seen in a 1 x 3 job: the
new group's status still counted cycle 0's 30 collectives, which hid the rank that hung).
"""
from __future__ import annotations

import json
import os
import pickle
import signal
import sys
import threading
import time
from typing import Dict, Optional, Tuple

from ft_launcher.rank_monitor import atomic_file, safe_pickle

ENV_FR_DIR = "FT_LAUNCHER_FR_DIR"
# A monitor holds a hung rank at most this long for the job's flight-recorder dump (the agent's
# own bounds, a second per rank and two for the whole job, fit well inside it).
HOLD_SECONDS = 3.0


FR_BUFFER_DEFAULT = 2000     # entries per rank; torch's docs suggest 2000


def buffer_size(env: Dict[str, str]) -> int:
    """The flight-recorder buffer the ranks get from `env` (the user's, or ours)."""
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                return FR_BUFFER_DEFAULT   # torch ignores a bad value too; ours then applies
    return FR_BUFFER_DEFAULT


def recorder_env(env: Dict[str, str]) -> Dict[str, str]:
    """What a rank gets for the recorder: our buffer size unless the user set one (either name)."""
    if env.get("TORCH_FR_BUFFER_SIZE") or env.get("TORCH_NCCL_TRACE_BUFFER_SIZE"):
        return {}
    return {"TORCH_FR_BUFFER_SIZE": str(FR_BUFFER_DEFAULT)}


def pipe_path(fr_dir: str, local_rank: int) -> str:
    return os.path.join(fr_dir, f"slot_{local_rank}.pipe")


def dump_path(fr_dir: str, local_rank: int, cycle: int) -> str:
    return os.path.join(fr_dir, f"slot_{local_rank}_cycle_{cycle}.pkl")


def error_path(fr_dir: str, local_rank: int, cycle: int) -> str:
    return os.path.join(fr_dir, f"slot_{local_rank}_cycle_{cycle}.err")


_started: Optional[int] = None   # the pid that started the thread (a fork's child has none)
_call_start_ns = 0               # time.time_ns() when the current call of ft.restartable began (0: none)


def mark_call(now_ns: Optional[int] = None) -> None:
    """A new call of the training function starts: dumps from now on leave out older entries."""
    global _call_start_ns
    _call_start_ns = time.time_ns() if now_ns is None else now_ns


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
        atomic_file.discard(path)    # the previous incarnation's pipe: its reader is gone
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
        _write(target, with_group_config(this_call(data, _call_start_ns)))
    except Exception as exc:  # noqa: BLE001 - the agent reports it as one line
        try:
            _write(error_path(fr_dir, local_rank, cycle), (str(exc).splitlines() or [repr(exc)])[0].encode())
        except OSError:
            pass


def _has_entries(data: bytes) -> bool:
    trace = load_trace(data)
    return True if trace is None else bool(trace.get("entries"))   # unreadable: not ours to judge


def read_trace(data: bytes) -> Tuple[Optional[dict], Optional[str]]:
    """A flight-recorder dump (torch's pickle of dicts, lists, strings and numbers) -> (trace, None),
    or (None, why) when it is not one. Dumps come from peers through the unauthenticated store: they
    are read with rank_monitor.safe_pickle, so one naming any class or function runs nothing."""
    try:
        trace = safe_pickle.loads_plain(data)
    except Exception as exc:  # noqa: BLE001 - UnsafePickle, truncated or foreign: nothing ran
        return None, safe_pickle.why_not(exc)
    if not isinstance(trace, dict):
        return None, f"it holds a {type(trace).__name__}, not a trace"
    return trace, None


def load_trace(data: bytes) -> Optional[dict]:
    """read_trace's trace alone (None: no evidence)."""
    return read_trace(data)[0]


def this_call(data: bytes, since_ns: int) -> bytes:
    """The dump without the entries created before `since_ns` (an earlier call's: see the module
    docstring) and without the `pg_status` of any group those entries named (a pg_id can come back
    in a later call, and its status then still counts the earlier group's collectives); as it was
    when nothing is older, it cannot be read, or `since_ns` is 0."""
    trace = load_trace(data) if since_ns else None
    if trace is None or not isinstance(trace.get("entries"), list):
        return data
    entries = [e for e in trace["entries"] if isinstance(e, dict)]
    kept = [e for e in entries if int(e.get("time_created_ns") or 0) >= since_ns]
    if len(kept) == len(trace["entries"]):
        return data
    old = {str(e.get("pg_id")) for e in entries if int(e.get("time_created_ns") or 0) < since_ns}
    trace["entries"] = kept
    if isinstance(trace.get("pg_status"), dict):
        trace["pg_status"] = {k: v for k, v in trace["pg_status"].items() if str(k) not in old}
    return pickle.dumps(trace)


def group_config() -> dict:
    """name -> {"name", "desc", "ranks": "[global ranks in group-rank order]"} of every process
    group this process is a member of (torch's own registry; {} without torch.distributed)."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    world = getattr(c10d, "_world", None)
    if world is None:
        return {}
    out = {}
    try:
        groups = list(world.pg_names.items())
        ranks_of = dict(world.pg_group_ranks)
    except RuntimeError:   # changed while copied (the main thread made a group): no config, no harm
        return {}
    for pg, name in groups:
        ranks = ranks_of.get(pg)
        if not ranks:
            continue
        members = [g for g, _ in sorted(ranks.items(), key=lambda item: item[1])]
        out[str(name)] = {"name": str(name), "desc": str(getattr(pg, "group_desc", "") or ""),
                          "ranks": json.dumps(members)}
    return out


def with_group_config(data: bytes) -> bytes:
    """The dump with every group of this process in its `pg_config` (see the module docstring);
    as it was when it cannot be read or nothing is missing."""
    trace = load_trace(data)
    mine = group_config()
    if trace is None or not mine:
        return data
    config = dict(trace.get("pg_config") or {})
    changed = False
    for name, entry in mine.items():
        known = config.get(name)
        if not isinstance(known, dict) or known.get("ranks") in (None, "", "[]"):
            config[name] = entry
            changed = True
    if "" in config and isinstance(config[""], dict) and config[""].get("ranks") in (None, "", "[]"):
        del config[""]   # gloo's placeholder for the default group, now named by its real name
        changed = True
    if not changed:
        return data
    trace["pg_config"] = config
    return pickle.dumps(trace)


def _write(path: str, data: bytes) -> None:
    atomic_file.write(path, data)
