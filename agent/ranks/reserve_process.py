"""Inside a warm reserve: an interpreter that imports what its slot's rank will import (of it, by
`reserve_preimport`, only torch's and ft_launcher's modules by default:
rank_monitor.rank_side.import_record), waits, and on activation becomes that rank, running the training script as `__main__` exactly as a cold
`python -u script.py args` (or `-m module`, or `--run-path`) would.

Started by agent.ranks.reserve_pool as `python -u -c <bootstrap> CTRL_FD LOCAL_RANK IMPORTS_FILE
COVERED_FILE BUDGET PREIMPORT KIND TARGET [ARGS...]` with the slot's stable environment, in its own session, with a
parent-death signal. It talks to the agent over CTRL_FD, a SOCK_SEQPACKET socket:

    reserve -> agent   {"kind": "ready", "seconds", "imported", "failed", "rss", "low_priority", "taken",
                        "environ_conflict", ...}
                       (first writing COVERED_FILE: every module name it has loaded or tried, one a line)
    agent -> reserve   {"op": "activate", "env": {...}, "title": str} + two descriptors: stdout, stderr

On activation it puts the descriptors on 1 and 2, replaces os.environ with the round's, restores
its scheduling priority, and runs the script. Until then its output goes nowhere (warm-up
warnings are not the rank's), and end-of-file on CTRL_FD (the agent dismissed it) ends it quietly.

Warm-up runs at nice +10 when the priority can be restored at activation (CAP_SYS_NICE or a
permissive RLIMIT_NICE), so replenishing a reserve does not slow the running ranks; otherwise at
normal priority, and the ready message says so. The reserve runs in its own session, and where
the kernel groups tasks by session (sched_autogroup_enabled, the default on most distributions)
a task's nice only weighs it against the tasks of its own session: so the session's autogroup
nice (/proc/self/autogroup) is raised by as much, and restored at activation (the agent restores
both when it takes a reserve still warming).
"""
from __future__ import annotations

import errno
import gc
import importlib
import json
import os
import runpy
import socket
import sys
import threading
import time
from typing import List, Optional

from ft_launcher.rank_monitor.rank_side import import_record
from ft_launcher.rank_monitor.rank_side.import_record import environ_conflicts, modules_to_import, user_code_dir

LOW_PRIORITY = 10
ENV_ROOM = "FT_LAUNCHER_ENV_ROOM"  # padding in the reserve's start environment, see _show_environ
CAP_SYS_NICE = 23


def main(argv: List[str]) -> None:
    ctrl_fd, local_rank, imports_file, covered_file, budget, preimport, kind, target, *args = argv
    sock = socket.socket(fileno=int(ctrl_fd))
    sock.setblocking(True)
    from ft_launcher.rank_monitor.proc_title import set_title

    set_title(f"ft_launcher: warm_reserve local_rank={local_rank}")
    base_priority = _lower_priority()
    # the bootstrap's entry (our packages' directory) gives way to where the rank resolves imports,
    # already during warm-up: the rank sees a cold rank's sys.path
    sys.path[0] = _path0(kind, target)
    start = time.monotonic()
    stats = _warm_up(imports_file, user_code_dir(kind, target), start + float(budget), covered_file, preimport)
    # What warm-up made lives as long as the rank: keep it out of every collection, so the rank's
    # garbage collections, and its exit, do not walk torch's objects (exit: 0.8 s -> 0.13 s).
    # Taken while warming (an early failure: the activation already waits), the rank is late:
    # skip the full collection first (0.3 s here), a cold rank does not make one either.
    taken = _activation_waiting(sock)
    if not taken:
        gc.collect()
    gc.freeze()
    _send(sock, dict(stats, kind="ready", pid=os.getpid(), seconds=round(time.monotonic() - start, 3),
                     rss=_rss(), low_priority=base_priority is not None, frozen=gc.get_freeze_count(),
                     taken=taken))
    try:
        data, fds, _, _ = socket.recv_fds(sock, 1 << 22, 2)
        msg = json.loads(data) if data else {}
    except (OSError, ValueError):
        msg, fds = {}, []
    if msg.get("op") != "activate" or len(fds) != 2:  # dismissed, or the agent is gone
        os._exit(0)
    out, err = fds
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    sock.close()
    _restore_priority(base_priority)
    os.environ.clear()
    os.environ.update(msg["env"])
    import_record.started_environ = dict(msg["env"])   # what the rank's record compares its environment with
    _show_environ(msg["env"])
    set_title(msg.get("title") or target)
    if os.environ.get("FT_LAUNCHER_EXCEPTION_HOOK") == "1":   # install_exception_hook (rank_monitor.rank_side.excepthook)
        from ft_launcher.rank_monitor.rank_side import excepthook

        excepthook.install()
    _run(kind, target, args)


def _show_environ(env: dict) -> None:
    """Make /proc/<pid>/environ show the rank's environment, as a cold rank's does (tools find
    ranks by RANK there). The kernel reports the block the process started with; the agent put
    the ENV_ROOM padding last in it. The variables the rank has beyond (or other than) the
    reserve's own are written over that padding, and nothing else is touched: C code may keep
    pointers that getenv() returned into the rest of the block. If they do not fit, nothing is
    written."""
    try:
        import ctypes

        with open("/proc/self/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        start, end = int(fields[47]), int(fields[48])  # env_start, env_end (fields 50, 51)
        with open("/proc/self/environ", "rb") as fh:
            block = fh.read()
        room = block.find(b"\0" + ENV_ROOM.encode() + b"=") + 1
        if room <= 0 or len(block) != end - start:
            return
        before = dict(item.split(b"=", 1) for item in block[:room].split(b"\0") if b"=" in item)
        added = b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()
                         if before.get(k.encode()) != v.encode())
        size = end - start - room
        if len(added) <= size:
            ctypes.memmove(start + room, added + b"\0" * (size - len(added)), size)
    except (OSError, ValueError, IndexError, UnicodeError):
        pass


def _activation_waiting(sock: socket.socket) -> bool:
    """Has the agent sent the activation already (peeked, left in the socket with its descriptors)?"""
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:   # nothing yet (BlockingIOError), or the agent is gone
        return False


def _send(sock: socket.socket, msg: dict) -> None:
    try:
        sock.send(json.dumps(msg).encode())
    except OSError:
        os._exit(0)


def _warm_up(imports_file: Optional[str], user_dir: str, deadline: float, covered_file: str,
             preimport: str) -> dict:
    """Import the slot's modules (in the order the rank imported them) until `deadline`."""
    names, cuda_device = modules_to_import(imports_file or None, user_dir, preimport)
    imported, failed = 0, []
    for name in names:
        if name in sys.modules:
            continue
        if time.monotonic() > deadline:
            break
        try:
            importlib.import_module(name)
            imported += 1
        except BaseException:  # noqa: BLE001 - a module that cannot load here is skipped
            failed.append(name)
    # torch imported here, with a value of a variable it reads then that the rank's script had set
    # otherwise (maybe before importing torch): the agent starts this slot's next reserves with none
    conflicts = environ_conflicts(imports_file or None) if preimport == "torch" and "torch" in sys.modules else []
    cuda = None
    if cuda_device is not None:
        try:
            import torch

            torch.cuda.set_device(cuda_device)
            torch.zeros(1, device=f"cuda:{cuda_device}")  # makes the context on that device
            cuda = cuda_device
        except Exception:  # noqa: BLE001 - the rank makes its own context then
            cuda = None
    try:
        with open(covered_file, "w") as fh:
            fh.write("\n".join([*sys.modules, *failed]))
    except OSError:
        pass
    return {"imported": imported, "failed": len(failed), "modules": len(sys.modules), "cuda_device": cuda,
            "environ_conflict": conflicts}


def _path0(kind: str, target: str) -> str:
    """sys.path[0] as `python` sets it: the script's directory, the cwd for -m, '' for -c."""
    if kind == "module":
        return os.getcwd()
    if kind == "run_path":
        return ""
    return os.path.dirname(os.path.realpath(target))


def _run(kind: str, target: str, args: List[str]) -> None:
    sys.argv = [target, *args]
    try:
        if kind == "module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:  # noqa: BLE001 - reported as python reports an uncaught error
        sys.excepthook(type(exc), exc, _user_frames(exc.__traceback__))
        sys.exit(1)


def _user_frames(tb):
    """The traceback from the script's first frame on, as a cold rank would print it."""
    ours = {os.path.abspath(__file__), os.path.abspath(runpy.__file__)}
    while tb is not None and tb.tb_next is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) in ours:
        tb = tb.tb_next
    return tb


def _can_restore_priority(base: int) -> bool:
    try:
        with open("/proc/self/status") as fh:
            caps = next((line.split()[1] for line in fh if line.startswith("CapEff:")), "0")
        if int(caps, 16) >> CAP_SYS_NICE & 1:
            return True
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
        return soft == resource.RLIM_INFINITY or 20 - soft <= base
    except (OSError, ValueError, ImportError):
        return False


_group_base: Optional[int] = None   # this session's autogroup nice before warm-up lowered it


def autogroup_nice(pid="self") -> Optional[int]:
    """The nice of `pid`'s session autogroup ("/autogroup-N nice K"), None without autogroups."""
    try:
        with open(f"/proc/{pid}/autogroup") as fh:
            return int(fh.read().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def set_autogroup_nice(pid, nice: int, tries: int = 1) -> bool:
    """Write `pid`'s autogroup nice. Without CAP_SYS_ADMIN the kernel takes one such change per
    0.1 s machine-wide (EAGAIN otherwise): `tries` attempts 20 ms apart."""
    for attempt in range(tries):
        try:
            fd = os.open(f"/proc/{pid}/autogroup", os.O_WRONLY)
            try:
                os.write(fd, str(nice).encode())
                return True
            finally:
                os.close(fd)
        except OSError as exc:
            if exc.errno != errno.EAGAIN:
                return False
        if attempt + 1 < tries:
            time.sleep(0.02)
    return False


def _lower_priority() -> Optional[int]:
    """Nice +10 while warming (the thread's and its session's autogroup's), if it can be undone;
    returns the priority to restore, or None."""
    global _group_base
    try:
        base = os.getpriority(os.PRIO_PROCESS, 0)
        if not _can_restore_priority(base):
            return None
        os.setpriority(os.PRIO_PROCESS, 0, min(19, base + LOW_PRIORITY))
    except OSError:
        return None
    group = autogroup_nice()
    if group is not None and set_autogroup_nice("self", min(19, group + LOW_PRIORITY), tries=15):
        _group_base = group
    return base


def _restore_priority(base: Optional[int]) -> None:
    """Every thread back to the rank's priority (threads made while warming inherited the nice),
    and the session's autogroup (retried in the background if the kernel says not yet)."""
    if base is None:
        return
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, base)
        except OSError:
            pass
    if _group_base is not None and autogroup_nice() != _group_base and not set_autogroup_nice("self", _group_base):
        threading.Thread(target=set_autogroup_nice, args=("self", _group_base, 100), daemon=True).start()


def _rss() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
