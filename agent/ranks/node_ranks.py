"""This node's processes beside the agent, as one part: the orphan watchdog, the ranks' output,
one monitor per local rank (agent.ranks.monitor_set), the warm reserves (agent.ranks.reserve_pool),
the in-place carrier (agent.ranks.in_place_carrier) and the cycle's worker group
(agent.ranks.workers).

The agent opens it in order (the watchdog first: everything after registers its leftovers with
it; the flight recorder, which the agent makes, comes between the watchdog and the monitors), starts
each cycle's ranks through it (`start_ranks`: a rank carried in place goes on in its process, the
others start from a warm reserve or cold) and stops them as the verdict says. A rank SIGKILL does not
end raises `Unkillable` (agent.ranks.process_wait).
"""
from __future__ import annotations

import os
from typing import Dict, Optional

from ft_launcher.agent.ranks import inprocess_ranks
from ft_launcher.agent.ranks.gpu_env import heartbeat_warning
from ft_launcher.agent.ranks.in_place_carrier import InPlaceCarrier
from ft_launcher.agent.ranks.monitor_set import MonitorSet
from ft_launcher.agent.ranks.orphan_watchdog import OrphanWatchdog
from ft_launcher.agent.ranks.process_wait import Unkillable
from ft_launcher.agent.ranks.rank_output import RankOutput
from ft_launcher.agent.ranks.reserve_pool import ReservePool
from ft_launcher.agent.ranks.workers import WorkerGroup, rank_env, set_wake_fd

__all__ = ["NodeRanks", "Unkillable"]


class NodeRanks:
    def __init__(self, cfg, events) -> None:
        self.cfg = cfg
        self.events = events
        # the ranks that restart in their own process, from one cycle into the next
        self.carrier = InPlaceCarrier(cfg, events)
        # made once the run starts (open_*), None until then: the agent's teardown stops those that exist
        self.watchdog: Optional[OrphanWatchdog] = None
        self.output: Optional[RankOutput] = None          # the ranks' streams (agent.ranks.rank_output)
        self.monitor_set: Optional[MonitorSet] = None
        self.reserves: Optional[ReservePool] = None
        self.group: Optional[WorkerGroup] = None          # this cycle's ranks

    def open_watchdog(self, wake_fd: int) -> OrphanWatchdog:
        """The orphan watchdog and the ranks' output; a restartable rank that raised wakes the agent
        through `wake_fd`."""
        self.watchdog = OrphanWatchdog()
        self.output = RankOutput(self.events.disk_warning)
        set_wake_fd(wake_fd)
        return self.watchdog

    def open_monitors(self, run_dir: str, pool) -> None:
        self.monitor_set = MonitorSet(self.cfg, run_dir, self.watchdog, self.events)
        self.monitor_set.start(pool)

    def open_reserves(self) -> None:
        self.reserves = ReservePool(self.cfg, self.watchdog, self.events)

    def heartbeat_warning(self) -> Optional[str]:
        """A line when the ranks' environment makes heartbeats unreliable (agent.ranks.gpu_env)."""
        return heartbeat_warning(os.environ, self.cfg.ft)

    def new_group(self, number: int) -> Optional[WorkerGroup]:
        """Cycle `number`'s worker group; returns the previous cycle's (its carried ranks are adopted)."""
        previous = self.group
        self.group = WorkerGroup(self.cfg, self.watchdog, self.output, number)
        return previous

    def start_ranks(self, rnd, master: tuple, in_place: Dict[int, object], extra_env: Dict[str, str]) -> None:
        """This node's ranks of cycle `rnd.number`: those carried in place go on in their process
        (`in_place`: local rank -> rank), the others start from a warm reserve or cold."""
        cfg = self.cfg
        monitors = self.monitor_set.handles if self.monitor_set is not None else []
        for local_rank in range(cfg.nproc_per_node):
            monitor = monitors[local_rank] if monitors else None
            env = rank_env(cfg, local_rank, rnd.rank_offset + local_rank, rnd.number, rnd.group_rank,
                           rnd.world_size, rnd.nnodes, master,
                           {**(monitor.rank_env() if monitor else {}), **self.reserves.rank_env(local_rank),
                            **extra_env})
            kept = in_place.get(local_rank)
            if kept is not None:   # at its restart point: it runs its function again, same process
                rank = self.group.adopt(kept, rnd.rank_offset + local_rank, rnd.number)
                monitor.rank_started(rank.pid, rank.rank, rnd.number, rank.start_ns)
                inprocess_ranks.go(monitor, env, rnd.number)
                continue
            # The first cycle starts cold, as torchrun's does, even where a reserve is ready (after a
            # long rendezvous): with some ranks warm (they exit fast) and some cold (their exit walks
            # torch's objects for ~1 s), a cold rank's exception could take a warm peer down, and be
            # blamed on it, before the cold rank itself had exited.
            reserve = self.reserves.take(local_rank) if rnd.number > 0 else None
            rank = self.group.start(local_rank, rnd.rank_offset + local_rank, env, rnd.number, reserve)
            self.reserves.rank_started(local_rank, rank.warm)   # a cold start is timed: the early rung's yardstick
            if monitor:
                monitor.rank_started(rank.pid, rank.rank, rnd.number, rank.start_ns)
