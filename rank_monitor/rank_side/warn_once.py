"""One-line, once-per-key warnings for the rank's client: misuse of sections or heartbeats, hang
detection being off, a request with nowhere to go. Never fatal, whatever the warnings filters say;
with the agent's marker prefix set, once per agent rather than once per process."""
from __future__ import annotations

import hashlib
import os
import sys
import warnings

from ft_launcher.rank_monitor import shm_layout as L


class FtSectionWarning(RuntimeWarning):
    """Misuse of sections or heartbeats, or hang detection being off; never fatal."""


_warned: set = set()


def _warn(key, message: str) -> None:
    """One warning per key, as one line (`FtSectionWarning: ft_launcher: ...`, no source line);
    the warnings filters still decide whether it shows, and -W error never crashes the rank."""
    if key in _warned:
        return
    _warned.add(key)
    prefix = os.environ.get(L.ENV_WARNED)
    if prefix:   # once per agent: the first of its ranks (any cycle) to create the marker says it
        marker = prefix + hashlib.sha1(repr(key).encode()).hexdigest()[:16]
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            return
        except OSError:
            pass
    try:
        with warnings.catch_warnings(record=True) as caught:  # the filters stay the caller's
            warnings.warn(message, FtSectionWarning, stacklevel=4)
        for warning in caught:
            sys.stderr.write(f"{warning.category.__name__}: {warning.message}\n")
    except Exception:  # -W error must not turn a monitoring remark into a crash
        try:
            sys.stderr.write(f"FtSectionWarning: {message}\n")
        except Exception:
            pass


__all__ = ["FtSectionWarning"]
