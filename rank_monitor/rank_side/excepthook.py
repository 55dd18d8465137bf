"""A rank's uncaught exception, reported to the launcher at raise time (NVRx 0.7's
`install_exception_hook`, `--ft-install-exception-hook true`).

With the key on, every rank runs its target through `main` (the command `command` builds; a warm
reserve installs the hook itself when ENV_HOOK is set): `hook` becomes sys.excepthook before the
script runs, so a plain script needs no change. An `ft.restartable` function's exception never
reaches it (rank_monitor.rank_side.inprocess reports those); a NVRx client's `init_workload_monitoring`
installs it too when the job's configuration has the key.

The hook prints the traceback as Python would, then reports through the path in-process restart
uses (rank_monitor.rank_side.inprocess): the exception's one-line summary in the rank's shared-memory record,
IP_FAILED, a byte on the agent's wake pipe. The agent's one line names the rank and the exception
("rank 1 on node 0 (host) raised ValueError: ... at train.py:12") and the failure is pinned on this
rank before its peers, blocked in a collective with it, see it go: the rank stays alive up to
REPORT_WAIT for the launcher to stop it, then leaves with os._exit(1) (NVRx's exit, which runs no
cleanup that could hang). Outside ft_launcher it only prints and exits 1.
"""
from __future__ import annotations

import os
import sys
import time
from typing import List

ENV_HOOK = "FT_LAUNCHER_EXCEPTION_HOOK"
REPORT_WAIT = 2.0       # seconds the rank stays for the launcher to stop it after the report

_BOOT = ("import sys\n"
         "sys.path.insert(0, {root!r})\n"
         "from ft_launcher.rank_monitor.rank_side.excepthook import main\n"
         "main()\n")


def report(exc: BaseException) -> bool:
    """Put `exc` in the rank's record and wake the agent; False outside ft_launcher."""
    from ft_launcher.rank_monitor.rank_side import inprocess
    from ft_launcher.rank_monitor import shm_layout as L
    from ft_launcher.rank_monitor.rank_side.shm_attachment import _ATT

    if _ATT.mode == "attached":
        mm, words = _ATT.mm, _ATT.words
    else:
        path = os.environ.get(L.ENV_SHM)
        if not path:
            return False
        try:
            mm, words = L.attach(path)
        except (OSError, ValueError):
            return False
        words[L.H_CLIENT_PID] = os.getpid()   # the agent takes a report from the rank's own pid only
    L.write_ip_text(mm, words, inprocess._summary(exc))
    words[L.H_IP_FAIL_NS] = time.monotonic_ns()
    words[L.H_IP_STATE] = L.IP_FAILED
    inprocess._wake_agent()
    return True


def hook(exc_type, exc, tb) -> None:
    if issubclass(exc_type, KeyboardInterrupt):
        return sys.__excepthook__(exc_type, exc, tb)
    import traceback

    try:
        sys.stdout.flush()
        text = "".join(traceback.format_exception(exc_type, exc, _user_frames(tb)))
        os.write(2, text.encode("utf-8", "replace"))   # as Python prints it, whatever sys.stderr is
    except Exception:  # noqa: BLE001
        pass
    try:
        reported = report(exc)
    except Exception:  # noqa: BLE001 - the hook must end the process whatever happens
        reported = False
    if reported:
        time.sleep(REPORT_WAIT)
    os._exit(1)


def _user_frames(tb):
    """The traceback from the script's first frame on (not ours, not runpy's)."""
    import runpy

    ours = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<string>", "<frozen runpy>"}
    while tb is not None and tb.tb_next is not None and (
            tb.tb_frame.f_code.co_filename in ours or os.path.abspath(tb.tb_frame.f_code.co_filename) in ours):
        tb = tb.tb_next
    return tb


def install() -> None:
    sys.excepthook = hook


def command(kind: str, entrypoint: List[str], target: str, args: List[str], root: str) -> List[str]:
    """The rank's command with the hook installed first: `python -u -c BOOT KIND TARGET ARGS...`
    (same interpreter flags); a program (--no-python) runs as it is."""
    if kind == "program":
        return list(entrypoint)
    return [entrypoint[0], "-u", "-c", _BOOT.format(root=root), kind, target, *args]


def main() -> None:
    """Run the target as `python` would (sys.argv, sys.path[0], __main__) with the hook on."""
    import runpy

    del sys.path[0]                      # BOOT's entry for our package
    kind, target = sys.argv[1], sys.argv[2]
    sys.argv = [target, *sys.argv[3:]]
    if kind == "script":
        sys.path[0] = os.path.dirname(os.path.realpath(target))
    elif kind == "module":
        sys.path[0] = os.getcwd()
    install()
    if kind == "module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(target, run_name="__main__")
