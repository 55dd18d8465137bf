"""Where the job writes, settled and checked before anything starts: the log dir (a temporary one
for --redirects without --log-dir), which streams go to the log files (--redirects, --tee), and
that every folder or file the launcher will write takes a file (ft_state.json, NVRx's per-cycle
app logs and launcher log, the cycle info dir).
"""
from __future__ import annotations

import os
import sys
import tempfile
from typing import Dict, Optional, Tuple

from ft_launcher.flag_values import parse_stream_map
from ft_launcher.flags import PROG, UsageError


def resolve_logs(args, nproc: int) -> Tuple[Optional[str], Dict[int, int], Dict[int, int]]:
    """(log dir, --redirects map, --tee map): a log dir means files for every rank (and the console
    too, unless --redirects or --tee says otherwise)."""
    capture = parse_stream_map("--redirects", args.redirects, nproc)
    tee = parse_stream_map("--tee", args.tee, nproc)
    log_dir = args.log_dir
    if log_dir:
        log_dir = os.path.abspath(log_dir)
        if not capture and not tee:
            tee = {i: 3 for i in range(nproc)}  # a log dir means files for every rank, console too
    elif capture:
        log_dir = tempfile.mkdtemp(prefix="ft_launcher_logs_")
        print(f"{PROG}: --redirects without --log-dir: logs go to {log_dir}", file=sys.stderr)
    return log_dir, capture, tee


def check_writable_dir(what: str, path: str) -> None:
    """`path`, a directory the launcher will write into, exists (or is made now) and takes a file."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except FileExistsError:
        raise UsageError(f"{what}: {path} exists and is not a directory") from None
    except OSError as exc:
        raise UsageError(f"{what}: cannot write in {path}: {exc.strerror or exc}") from None


def check_output_paths(log_dir: Optional[str], ft) -> None:
    """Every path the launcher will write, checked before anything starts."""
    if log_dir:
        check_writable_dir("--log-dir", log_dir)
    if ft.calc_ft_timeouts or ft.ft_state_path:
        from ft_launcher.agent.observation.timeout_learning import default_state_path

        path = os.path.abspath(default_state_path(ft, log_dir))
        what = "--ft-state-path" if ft.ft_state_path else "ft_state.json (calc_ft_timeouts)"
        if os.path.isdir(path):
            raise UsageError(f"{what}: {path} is a directory, not a file")
        check_writable_dir(what, os.path.dirname(path))


def check_nvrx_log_paths(args, ft) -> None:
    """NVRx's per-cycle app logs and launcher log (their folders) and the cycle info dir take a file."""
    applog_prefix, nvrx_logfile = args.nvrx__ft_per_cycle_applog_prefix, args.nvrx__ft_nvrx_logfile
    for flag, path in (("--ft-per-cycle-applog-prefix", applog_prefix), ("--ft-nvrx-logfile", nvrx_logfile),
                       ("--ft-cycle-info-dir", ft.cycle_info_dir)):
        if path:
            check_writable_dir(flag, path if flag == "--ft-cycle-info-dir" else os.path.dirname(os.path.abspath(path)))
