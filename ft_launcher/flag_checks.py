"""Flags that are each well-formed but do not fit: a negative restart budget or timeout, a
non-positive polling period, an active_world_size that is not whole nodes, training nodes that are
not whole segments, --elastic without a MIN:MAX to go on within. Each is a one-line UsageError naming the flags.
"""
from __future__ import annotations

from typing import Optional

from ft_launcher.agent.rounds.elastic import check_flag
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


def check_elastic(on: bool, ft, min_nodes: int, max_nodes: int) -> None:
    """--elastic's check is elastic's own (agent.rounds.elastic.check_flag): its error, a UsageError."""
    error = check_flag(on, ft, min_nodes, max_nodes)
    if error:
        raise UsageError(error)
