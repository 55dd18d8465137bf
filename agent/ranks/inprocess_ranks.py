"""In-process restart, the agent side: which of this node's ranks run under `ft.restartable`,
which raised, asking the healthy ones to leave their function, and letting them go on with the
next cycle's environment (the rank side is rank_monitor.rank_side.inprocess; the words are shm_layout's H_IP_*).

A rank asked to restart must reach its restart point (IP_READY for the requested cycle) within
`inprocess_timeout` seconds of the request; the agent kills one that does not and starts its slot
afresh (warm reserve, else cold), like a failed rank.
"""
from __future__ import annotations

import json
import os
import time
from typing import Callable, Dict, List, Tuple

from ft_launcher.rank_monitor import atomic_file
from ft_launcher.rank_monitor import shm_layout as L
from ft_launcher.rank_monitor.rank_side.inprocess import IN_PLACE_SIGNAL

from ft_launcher.agent.ranks.workers import Rank

POLL = 0.002   # seconds between looks at the ranks' records while waiting for their restart points


def _words(monitor):
    rec = monitor.record() if monitor is not None else None
    return rec[1] if rec is not None else None


def state(monitor) -> int:
    words = _words(monitor)
    return words[L.H_IP_STATE] if words is not None else L.IP_NONE


def all_restartable(monitors: list) -> bool:
    """Every rank of this node has entered its restartable function in this cycle."""
    return bool(monitors) and all(state(m) in (L.IP_RUNNING, L.IP_FAILED, L.IP_READY, L.IP_DONE)
                                  for m in monitors)


def raised(monitors: list, ranks: List[Rank]) -> List[Tuple[Rank, int, str]]:
    """This node's running ranks whose function raised and who wait for a restart: (rank, when
    it raised (monotonic ns), the exception's one-line summary), earliest first."""
    out = []
    for rank in ranks:
        if rank.exitcode is not None:
            continue
        monitor = monitors[rank.local_rank]
        rec = monitor.record()
        if rec is None:
            continue
        mm, words = rec
        if words[L.H_IP_STATE] == L.IP_FAILED and words[L.H_CLIENT_PID] == rank.pid:
            out.append((rank, words[L.H_IP_FAIL_NS], L.read_ip_text(mm, words)))
    return sorted(out, key=lambda item: item[1])


def request(monitor, rank: Rank, cycle: int) -> bool:
    """Ask `rank` to leave its function and wait to run as cycle `cycle`; False when it cannot
    restart in place (not restartable, finished, gone)."""
    words = _words(monitor)
    if words is None or rank.exitcode is not None or rank.proc.poll() is not None:
        return False
    if words[L.H_IP_STATE] not in (L.IP_RUNNING, L.IP_FAILED, L.IP_READY) or words[L.H_CLIENT_PID] != rank.pid:
        return False
    words[L.H_IP_REQUEST] = cycle
    try:
        os.kill(rank.pid, IN_PLACE_SIGNAL)
    except ProcessLookupError:
        return False
    return True


def wait_ready(pairs: List[Tuple[object, Rank]], cycle: int, deadline: float,
               stop: Callable[[], object] = lambda: None) -> Dict[int, bool]:
    """Wait until each (monitor, rank) is at its restart point for `cycle`, or `deadline`
    (monotonic s) passes, or `stop()` is true (a signal to the agent): local rank -> reached it."""
    reached: Dict[int, bool] = {}
    while not stop():
        for monitor, rank in pairs:
            if rank.local_rank in reached:
                continue
            words = _words(monitor)
            if words is None or rank.proc.poll() is not None:
                reached[rank.local_rank] = False
            elif words[L.H_IP_STATE] == L.IP_READY and words[L.H_IP_SEEN] == cycle:
                reached[rank.local_rank] = True
        if len(reached) == len(pairs) or time.monotonic() >= deadline:
            break
        time.sleep(POLL)
    return {rank.local_rank: reached.get(rank.local_rank, False) for _, rank in pairs}


def go(monitor, env: Dict[str, str], cycle: int) -> None:
    """Let a rank at its restart point run its function again as cycle `cycle`, with `env`."""
    atomic_file.write(L.env_file(monitor.shm_path), json.dumps(env))
    _words(monitor)[L.H_IP_GO] = cycle
