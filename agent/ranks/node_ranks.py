"""This node's processes beside the agent, as one part: the orphan watchdog, the ranks' output,
one monitor per local rank (agent.ranks.monitor_set), the warm reserves (agent.ranks.reserve_pool),
the in-place carrier (agent.ranks.in_place_carrier) and the cycle's worker group
(agent.ranks.workers).

The agent opens it in order (the watchdog first: everything after registers its leftovers with
it; the flight recorder, which the agent makes, comes between the watchdog and the monitors), starts
each cycle's ranks through it (`start_ranks`: a rank carried in place goes on in its process, the
others start from a warm reserve or cold) and stops them as the verdict says. A rank SIGKILL does not
end raises `Unkillable` (agent.ranks.process_wait).

Which rank runs in which slot (`slot_ranks`: slot -> index of the rank on this node, global rank =
the round's offset + index) is the identity until a rank's exit 16 moves ranks to other devices
(`apply_rerun`: the verdict's swap of two slots, or a rotation by one slot, agent.recovery.rerun_exits);
it then stays so, so that a later restart never puts a rank back on the device it left. A slot keeps
its device (LOCAL_RANK, its monitor, its warm reserves); the rank moves. The cycle after a 16, every
rank gets the re-run's variables (rank_monitor.rerun_env).
"""
from __future__ import annotations

import glob
import os
from typing import Dict, List, Optional

from ft_launcher.agent.ranks import inprocess_ranks
from ft_launcher.agent.ranks.gpu_env import heartbeat_warning, slot_device
from ft_launcher.agent.ranks.in_place_carrier import InPlaceCarrier
from ft_launcher.agent.ranks.monitor_set import MonitorSet
from ft_launcher.agent.ranks.orphan_watchdog import OrphanWatchdog
from ft_launcher.agent.ranks.process_wait import Unkillable
from ft_launcher.agent.ranks.rank_output import RankOutput
from ft_launcher.agent.ranks.reserve_pool import ReservePool
from ft_launcher.agent.ranks.workers import WorkerGroup, rank_env, set_wake_fd
from ft_launcher.rank_monitor import buddy_store, rerun_env, shm_layout

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
        self.slot_ranks: List[int] = list(range(cfg.nproc_per_node))   # slot -> the rank's index on this node
        self.rerun_env: Dict[str, str] = {}               # the next cycle's re-run variables (after a 16)
        self.moved_from: Dict[int, str] = {}              # slot -> the hardware its rank left (after a 16)

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

    def hardware(self, slot: int, node_id: str, host: str) -> dict:
        """Where slot `slot`'s rank runs, for a report of its exit 16 or 17 (agent.recovery.rerun_exits)."""
        return {"node_id": node_id, "host": host, "slot": slot, "device": slot_device(slot, os.environ),
                "slots": list(self.slot_ranks)}

    def apply_rerun(self, rerun: dict, node_id: str, host: str, trained: bool) -> List[str]:
        """The verdict's `rerun` (empty: none): the slots of this node's ranks change as it says (when
        this node trained in the round) and the next cycle's ranks get its variables; one line per
        rank moved."""
        self.rerun_env, self.moved_from = {}, {}
        if not rerun:
            return []
        suspect = rerun.get("suspect") or {}
        self.rerun_env = {
            rerun_env.ENV_RERUN_OF: str(rerun["cycle"])
            + (f":{rerun['iteration']}" if rerun.get("iteration") is not None else ""),
            rerun_env.ENV_RERUN_RANK: str(rerun.get("rank")),
            rerun_env.ENV_RERUN_SUSPECT: f"{suspect.get('host')}:{suspect.get('device')}"}
        before = list(self.slot_ranks)
        swap = rerun.get("swap") or {}
        if trained and swap.get("node_id") == node_id:
            a, b = swap["slots"]
            self.slot_ranks[a], self.slot_ranks[b] = self.slot_ranks[b], self.slot_ranks[a]
        elif trained and rerun.get("rotate") and len(self.slot_ranks) > 1:
            self.slot_ranks = self.slot_ranks[1:] + self.slot_ranks[:1]
        lines = []
        for slot, index in enumerate(self.slot_ranks):
            if before[slot] != index:
                old = before.index(index)
                self.moved_from[slot] = f"{host}:{slot_device(old, os.environ)}"
                lines.append(f"rank index {index} of this node moves from slot {old} (device "
                             f"{slot_device(old, os.environ)}) to slot {slot} (device {slot_device(slot, os.environ)})")
        return lines

    def global_rank(self, rnd, slot: int) -> int:
        """The global rank slot `slot` runs in round `rnd`."""
        return rnd.rank_offset + self.slot_ranks[slot]

    def start_ranks(self, rnd, master: tuple, in_place: Dict[int, object], extra_env: Dict[str, str]) -> None:
        """This node's ranks of cycle `rnd.number`: those carried in place go on in their process
        (`in_place`: local rank -> rank), the others start from a warm reserve or cold."""
        cfg = self.cfg
        monitors = self.monitor_set.handles if self.monitor_set is not None else []
        for local_rank in range(cfg.nproc_per_node):
            monitor = monitors[local_rank] if monitors else None
            moved = {rerun_env.ENV_RERUN_MOVED: self.moved_from[local_rank]} if local_rank in self.moved_from else {}
            env = rank_env(cfg, local_rank, self.global_rank(rnd, local_rank), rnd.number, rnd.group_rank,
                           rnd.world_size, rnd.nnodes, master,
                           {**(monitor.rank_env() if monitor else {}), **self.reserves.rank_env(local_rank),
                            **extra_env, **self.rerun_env, **moved})
            kept = in_place.get(local_rank)
            if kept is not None:   # at its restart point: it runs its function again, same process
                rank = self.group.adopt(kept, self.global_rank(rnd, local_rank), rnd.number)
                monitor.rank_started(rank.pid, rank.rank, rnd.number, rank.start_ns)
                inprocess_ranks.go(monitor, env, rnd.number)
                continue
            # The first cycle starts cold, as torchrun's does, even where a reserve is ready (after a
            # long rendezvous): with some ranks warm (they exit fast) and some cold (their exit walks
            # torch's objects for ~1 s), a cold rank's exception could take a warm peer down, and be
            # blamed on it, before the cold rank itself had exited.
            reserve = self.reserves.take(local_rank) if rnd.number > 0 else None
            rank = self.group.start(local_rank, self.global_rank(rnd, local_rank), env, rnd.number, reserve)
            self.reserves.rank_started(local_rank, rank.warm)   # a cold start is timed: the early rung's yardstick
            if monitor:
                monitor.rank_started(rank.pid, rank.rank, rnd.number, rank.start_ns)

    def shut_down(self, sig: int, timeout: float) -> None:
        """The job ends by signal `sig`: the ranks are told why (their monitors' records) and stopped,
        SIGKILL after `timeout`."""
        if self.group is not None:
            self.monitor_set.mark_stopping(shm_layout.STOP_SHUTDOWN, timeout)
            self.group.stop(sig, timeout)

    @staticmethod
    def remove_marks(agent_pid: int) -> None:
        """The ranks' said-once marks and their buddy copies (rank_monitor.buddy_store: host memory that
        outlived the ranks, in the agent's own directory; the orphan watchdog removes them too if the
        agent is killed)."""
        for marker in glob.glob(shm_layout.warned_prefix(agent_pid) + "*"):
            try:
                os.unlink(marker)
            except OSError:
                pass
        buddy_store.remove_agent_dir(agent_pid)
