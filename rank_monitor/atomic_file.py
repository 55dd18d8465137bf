"""Writing a file so that a reader sees the old contents or the new, never a part: the data goes
to a temporary file in the same directory, which then replaces the file (one rename). With
`durable`, the file and its directory are also synced to disk before returning (ft_state.json:
what a restart reads must survive a crash of the node). The temporary file never stays behind.
Used by every process: the agent (status, cycle info, restart environment), the monitors and the
ranks (import record, flight-recorder dumps, ft_state.json)."""
from __future__ import annotations

import os
import tempfile
from typing import Union


def write(path: str, data: Union[str, bytes], durable: bool = False) -> None:
    """Replace `path` with `data` atomically; OSError as the filesystem raised it."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as fh:
            fh.write(data)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        discard(tmp)
        raise
    if durable:
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def symlink(target: str, link: str) -> None:
    """Point `link` at `target` atomically (a new link renamed over the old one)."""
    tmp = f"{link}.tmp{os.getpid()}"
    try:
        os.symlink(target, tmp)
        os.replace(tmp, link)
    except BaseException:
        discard(tmp)
        raise


def discard(path: str) -> None:
    """Remove a temporary file that was not moved into place (gone already is fine)."""
    try:
        os.unlink(path)
    except OSError:
        pass
