"""NVRx's log layout, written beside ours (--ft-per-cycle-applog-prefix, --ft-nvrx-logfile).

- Per-cycle application log: with prefix `/logs/job.log`, cycle N of the job goes to
  `/logs/job_cycleN.log` (no extension: `.log`), one file for every rank of every node, each line
  behind the rank's global number right-aligned to the width of the largest rank and `: `
  (`srun -l`'s form: ` 3: loss 0.12`). Every node appends whole lines with O_APPEND
  (agent.ranks.rank_output). Our own files (<--log-dir>/cycle_N/rank_R.log) and the console are as
  they are without it.
- Launcher log: every line the agent says (the console's `[ft_launcher ...]` lines) is also
  appended to the --ft-nvrx-logfile path, one write per line, from every node.

A path that cannot be written costs one warning line, never the job.
"""
from __future__ import annotations

import os
from typing import Optional


def cycle_log_file(prefix: str, cycle: int) -> str:
    base, ext = os.path.splitext(os.path.abspath(prefix))
    return f"{base}_cycle{cycle}{ext or '.log'}"


def rank_prefix(rank: int, world_size: int) -> str:
    width = len(str(world_size - 1)) if world_size > 1 else 0
    return f"{rank:>{width}}: "


class LauncherLogTee:
    """A text stream that writes to `stream` and appends each whole line to `path` too."""

    def __init__(self, stream, path: str):
        self.stream, self.path = stream, os.path.abspath(path)
        self._fd: Optional[int] = None
        self._failed = False

    def write(self, text: str) -> int:
        written = self.stream.write(text)
        if not self._failed and text:
            try:
                if self._fd is None:
                    os.makedirs(os.path.dirname(self.path), exist_ok=True)
                    self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                os.write(self._fd, text.encode())
            except OSError as exc:
                self._failed = True   # said once, on the console only (the caller may hold its lock)
                self.stream.write(f"ft_launcher: warning: cannot append to the NVRx launcher log {self.path} "
                                  f"({exc.strerror or exc}): its lines go to the console only\n")
        return written

    def flush(self) -> None:
        self.stream.flush()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
