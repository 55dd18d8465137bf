"""The orphan watchdog: a tiny process beside the agent that kills the agent's process groups
(ranks, their children, monitors) the moment the agent dies, however it dies.

The agent writes `+PGID` / `-PGID` lines into the watchdog's stdin as it starts and reaps
process groups, `!PATH` for a scratch file or directory of its own, `*PATTERN` for files named by
a glob pattern (its monitors' shared-memory records), and `?PATH` for a directory that is removed
only if nothing but empty files is in it (the stack-dump directory: a dump is kept). When that
pipe reaches end-of-file (the kernel closes it when the agent exits, SIGKILL included), every
group still registered gets SIGKILL and every such path still there is removed. The watchdog runs in its own
session and ignores SIGINT/SIGTERM/SIGHUP, so a signal aimed at the agent's terminal or process
group cannot take it out first. Started as a fresh interpreter
(rank_monitor.own_modules.module_command), not a fork of a threaded agent.
"""
from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys

from ft_launcher.rank_monitor.own_modules import module_command


def main() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    from ft_launcher.rank_monitor.proc_title import set_title

    set_title(f"ft_launcher: orphan_watchdog agent_pid={os.getppid()}")
    groups, dirs, patterns, tidy = set(), set(), set(), set()
    for line in sys.stdin.buffer:
        text = line.strip().decode(errors="replace")
        if text.startswith("!/"):
            dirs.add(text[1:])
        elif text.startswith("*/"):
            patterns.add(text[1:])
        elif text.startswith("?/"):
            tidy.add(text[1:])
        elif len(text) > 1 and text[1:].isdigit():
            (groups.add if text[0] == "+" else groups.discard)(int(text[1:]))
    for pgid in groups:  # EOF: the agent is gone
        try:
            os.killpg(pgid, signal.SIGCONT)
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for pattern in patterns:   # after the kill: no monitor is left to write them again
        dirs.update(glob.glob(pattern))
    for path in dirs:
        _remove(path)
    for path in tidy:
        _tidy(path)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    try:
        os.unlink(path)
    except OSError:
        pass


def _tidy(path: str) -> None:
    """Remove the stack-dump files no dump was written to in `path`, then `path` if that left it
    empty (a dump's file stays: the hang line named it)."""
    from ft_launcher.rank_monitor.agent_side.monitor_handle import MonitorHandle

    MonitorHandle.tidy_run_dir(path, remove_if_empty=True)


class OrphanWatchdog:
    """Agent side: start the watchdog and register process groups with it."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            module_command("ft_launcher.agent.ranks.orphan_watchdog"), stdin=subprocess.PIPE,
            start_new_session=True, close_fds=True)

    def _send(self, line: str) -> None:
        try:
            self._proc.stdin.write(line.encode())
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass

    def watch(self, pgid: int) -> None:
        self._send(f"+{pgid}\n")

    def forget(self, pgid: int) -> None:
        self._send(f"-{pgid}\n")

    def remove_at_exit(self, path: str) -> None:
        """Remove the file or directory `path` when the agent is gone, however it ends."""
        self._send(f"!{os.path.abspath(path)}\n")

    def remove_matching_at_exit(self, pattern: str) -> None:
        """Remove the files matching the glob `pattern` when the agent is gone."""
        self._send(f"*{os.path.abspath(pattern)}\n")

    def tidy_at_exit(self, path: str) -> None:
        """When the agent is gone: remove the empty stack-dump files in directory `path`, and `path`
        if that left it empty."""
        self._send(f"?{os.path.abspath(path)}\n")

    def close(self) -> None:
        """Normal exit: every group is already reaped; let the watchdog end."""
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()


if __name__ == "__main__":
    main()
