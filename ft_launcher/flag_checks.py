"""Flags that are each well-formed but do not fit: a negative restart budget or timeout, a
non-positive polling period, an active_world_size that is not whole nodes, training nodes that are
not whole segments, --elastic without a MIN:MAX to go on within. Each is a one-line UsageError naming the flags.
"""
from __future__ import annotations

import sys
from typing import Optional

from ft_launcher.flag_values import parse_active_nodes
from ft_launcher.flags import UsageError


def check_restart_timings(args) -> None:
    """--max-restarts, --term-timeout and --workers-stop-timeout not negative; --monitor-interval positive."""
    for flag in ("max_restarts", "term_timeout", "workers_stop_timeout"):
        if getattr(args, flag) < 0:
            raise UsageError(f"--{flag.replace('_', '-')} must not be negative, got {getattr(args, flag):g}")
    if args.monitor_interval <= 0:
        raise UsageError(f"--monitor-interval must be positive, got {args.monitor_interval:g}")


def training_nodes(ft, nproc: int, min_nodes: int, max_nodes: int) -> Optional[int]:
    """The nodes that train when active_world_size says so (None: every node up to MIN trains), the
    training nodes checked to be whole segments (--ft-segment)."""
    active_nodes = parse_active_nodes(ft.active_world_size, nproc, max_nodes)
    training = min(active_nodes, min_nodes) if active_nodes else min_nodes
    if ft.segment and training % ft.segment:
        raise UsageError(f"--ft-segment {ft.segment}: the {training} training node(s) (MIN of --nnodes) must be a "
                         f"multiple of it: nodes train in whole segments of {ft.segment} nodes of one NVLink domain")
    return active_nodes


def check_elastic(args, ft, min_nodes: int, max_nodes: int) -> None:
    """--elastic needs --nnodes MIN:MAX with MIN < MAX (the fewest nodes the job goes on with), and
    chooses the training nodes itself (no active_world_size, no --ft-segment); without it, a
    MIN:MAX gets one note saying it means hot spares (NVRx's meaning, not torchrun's)."""
    if not args.elastic:
        if min_nodes < max_nodes:
            print(f"ft_launcher: note: --nnodes {min_nodes}:{max_nodes}: {min_nodes} node(s) train and the others "
                  f"wait as hot spares (NVRx's meaning); for torchrun's (up to {max_nodes} train, the job goes on "
                  f"with as few as {min_nodes}) add --elastic", file=sys.stderr)
        return
    if min_nodes >= max_nodes:
        raise UsageError(f"--elastic needs --nnodes MIN:MAX with MIN < MAX (the fewest nodes the job goes on with), "
                         f"got {min_nodes}:{max_nodes}")
    if ft.active_world_size is not None or ft.segment:
        raise UsageError("--elastic chooses the training nodes itself: it cannot be combined with "
                         + ("active_world_size" if ft.active_world_size is not None else "--ft-segment"))
