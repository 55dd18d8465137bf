"""The in-place carrier: this node's ranks that restart in their own process (the ladder's first
rung), carried from the cycle that failed into the next one.

- While a cycle runs, `news` declares the node restartable to the round (the policy's input) once every rank runs
  under `ft.restartable`, and returns a rank whose function raised (it waits, alive, for the verdict).
- When the verdict is rung `in_process`, `ask` applies it: the ranks it keeps (Verdict.stays: not a
  rank the verdict replaces, not one that exited, not one stopped as hung, which the agent learns
  from agent.recovery.hang_blame.settle) are requested to leave their function at once
  (agent.ranks.inprocess_ranks.request). The agent stops every other rank; `carry` keeps those asked.
- In the next cycle `adopt` waits (up to `inprocess_timeout` from the request) for them to reach
  their restart point and returns those to adopt; one that exited or is late is killed and its slot
  starts afresh (`inprocess_timeout` event). A signal meanwhile reaches the carried ranks too and
  ends the wait (round_types.Stopped).
- `drop` kills carried ranks that will not be adopted (this node waits as a spare, the job ends);
  a rank SIGKILL does not end is agent.ranks.process_wait's Unkillable.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, Optional, Set, Tuple

from ft_launcher.agent.ranks import inprocess_ranks
from ft_launcher.agent.ranks.process_wait import Unkillable, kill_and_wait
from ft_launcher.agent.rounds.round_types import Round, Stopped
from ft_launcher.agent.ranks.workers import Rank, WorkerGroup


class InPlaceCarrier:
    def __init__(self, cfg, events):
        self.cfg = cfg
        self.events = events
        self.proto = None                 # the round protocol, once the store is reached: told when this node is restartable
        self._carried: Dict[int, Tuple[object, Rank, float]] = {}   # local rank -> (monitor, rank, when asked)
        self.declared = False             # this cycle's ranks all run under ft.restartable (told once)

    # ---- while a cycle runs ---------------------------------------------------------------
    def begin_cycle(self) -> None:
        self.declared = False

    def news(self, number: int, monitors: list, ranks: list) -> Optional[Tuple[Rank, str]]:
        """Declare the node restartable when all its ranks are; (rank, its exception's line) of a
        rank whose function raised, else None."""
        if not self.declared and inprocess_ranks.all_restartable(monitors):
            self.declared = True
            self.proto.declare_restartable(number)
        raised = inprocess_ranks.raised(monitors, ranks)
        return (raised[0][0], raised[0][2]) if raised else None

    # ---- at the verdict ---------------------------------------------------------------------
    def ask(self, rnd: Round, verdict, node_id: str, group: WorkerGroup, monitor_set,
            stopped_as_hung: Set[int]) -> Dict[int, tuple]:
        """Apply the verdict: ask this node's ranks it keeps in place (Verdict.stays) to leave their
        function now. Returns local rank -> (monitor, rank, when asked) of those asked."""
        if verdict is None or rnd.group_rank is None:
            return {}
        keep, now = {}, time.monotonic()
        for rank in verdict.stays(group.ranks, node_id, stopped_as_hung):
            monitor = monitor_set.handles[rank.local_rank]
            if inprocess_ranks.request(monitor, rank, verdict.next_round):
                keep[rank.local_rank] = (monitor, rank, now)
        return keep

    def carry(self, keep: Dict[int, tuple]) -> None:
        """Those asked (`ask`) are carried into the next cycle; the others have been stopped."""
        self._carried = keep

    # ---- the next cycle ---------------------------------------------------------------------
    def adopt(self, number: int, previous: Optional[WorkerGroup], stop: Callable[[], Optional[int]]) -> Dict[int, Rank]:
        """Wait for the carried ranks to reach their restart point for cycle `number`; kill those
        that do not. Returns local rank -> rank to adopt. A signal (`stop()`) is passed on to the
        carried ranks (SIGKILL after term_timeout) and raises Stopped."""
        carried = self._carried
        if not carried:
            return {}
        deadline = min(asked for _, _, asked in carried.values()) + self.cfg.ft.inprocess_timeout
        reached = inprocess_ranks.wait_ready([(m, r) for m, r, _ in carried.values()], number, deadline, stop)
        sig = stop()
        if sig:   # now, not after inprocess_timeout
            if previous is not None:
                previous.stop(sig, self.cfg.term_timeout)   # they are the previous cycle's ranks
            self._carried = {}
            raise Stopped(sig)
        self._carried = {}
        adopted = {}
        for local_rank, (_, rank, asked) in carried.items():
            if reached.get(local_rank):
                adopted[local_rank] = rank
                continue
            gone = rank.proc.poll() is not None
            what = ("exited before it reached its restart point" if gone else
                    f"did not reach its restart point within inprocess_timeout="
                    f"{self.cfg.ft.inprocess_timeout:g}s -> killed")
            self.events.event("inprocess_timeout", f"rank {rank.rank} (pid {rank.pid}) {what}; its slot "
                              f"starts afresh", rank=rank.rank, pid=rank.pid, exited=gone,
                              waited=round(time.monotonic() - asked, 3))
            if not kill_and_wait(rank.proc):
                rank.unkillable = True
                raise Unkillable([(rank.rank, rank.pid)])
            if previous is not None:
                previous.reap(rank)
        return adopted

    def drop(self, why: Optional[str]) -> None:
        """Carried ranks that will not be adopted: kill them (`why`: said per rank; None on the way
        out, where a rank SIGKILL does not end is said, not raised)."""
        carried, self._carried = self._carried, {}
        stuck = []
        for _, rank, _ in carried.values():
            if why:
                self.events.say(f"rank {rank.rank} (pid {rank.pid}) will not restart in place: {why}")
            if not kill_and_wait(rank.proc):   # the orphan watchdog still has it
                rank.unkillable = True
                stuck.append((rank.rank, rank.pid))
        if stuck and why:
            raise Unkillable(stuck)
        if stuck:
            self.events.event("rank_unkillable", f"error: {Unkillable(stuck)}", ranks=stuck)
