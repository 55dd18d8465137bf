"""Simulated faults, injected by the agent into any script with no code change.

`rank_killed` sends SIGKILL to the rank's process (a crash); `rank_hung` sends SIGSTOP (a real
hang: only a section or heartbeat timeout can find it); `random` picks one of them. The plan of
each cycle (which rank, which fault, when) is a pure function of the seed, the cycle and the
world size, so every agent computes the same plan and a run can be reproduced; only the agent
that hosts the chosen rank acts. A job-wide counter in the store makes a fault fire once per job
by default (`simulated_fault_count`, -1 for every cycle).

`rank_sdc` is silent data corruption: the agent hosting the chosen rank at the job's first cycle
gives its ranks ENV_SDC (`rank_env`: `simulated_sdc`'s KIND:STEP:PERSIST, the local slot (`*`
for a whole node) and PLACE), and the rank puts a NaN, an Inf or a flipped bit where PLACE says
(rank_monitor.rank_side.live.sdc_sim: its gradient before or after the all-reduce, or a parameter
after the optimizer step) at STEP: once, or on every step from STEP on for as long as the rank
runs on that device (`device`) or node (`node`); a rank moved elsewhere is
clean. It fires by the training step, not by time, and sends no signal.

`FaultInjector` is the agent's part for it: `plan` arms a cycle's fault (and says a drawn one),
`inject_due` fires it into its rank when due (a `fault_injected` event), and `not_injected` says a
planned fault the job outran (`fault_not_injected`).
"""
from __future__ import annotations

import dataclasses
import os
import random
import signal
from typing import Callable, Optional

from ft_launcher.rank_monitor.config import FaultToleranceConfig

ENV_SDC = "FT_LAUNCHER_SIM_SDC"   # read by rank_monitor.rank_side.live.sdc_sim


@dataclasses.dataclass
class FaultPlan:
    kind: str           # rank_hung | rank_killed | rank_sdc
    rank: int           # global rank
    delay: float        # seconds after the rank's start
    chosen: bool        # the rank was drawn from the seed, not configured


def plan_for_cycle(ft: FaultToleranceConfig, cycle: int, world_size: int) -> Optional[FaultPlan]:
    if not ft.simulate_fault or world_size <= 0:
        return None
    rng = random.Random(ft.simulated_fault_seed * 1_000_003 + cycle)
    kind = ft.simulated_fault_type
    if kind == "random":
        kind = rng.choice(["rank_hung", "rank_killed"])
    chosen = ft.simulated_fault_rank is None
    rank = rng.randrange(world_size) if chosen else ft.simulated_fault_rank
    if rank >= world_size:
        return None
    delay = ft.simulated_fault_base_delay * (1.0 + 0.2 * rng.random())
    return FaultPlan(kind, rank, delay, chosen)


class FaultInjector:
    """One cycle's pending fault on this node, if any."""

    def __init__(self, ft: FaultToleranceConfig, claim: Callable[[], int], fired: Callable[[], int], events):
        self.ft = ft
        self._claim = claim   # store counter: returns how many faults the job has now fired
        self._fired = fired   # the same counter, read
        self.events = events
        self.pending: Optional[FaultPlan] = None
        self.due_ns: Optional[int] = None
        self._start_ns = 0
        self._sdc: Optional[str] = None   # this node's rank_sdc env value, once decided (the first cycle)

    # ---- the agent's calls ------------------------------------------------------------------
    def plan(self, cycle: int, world_size: int, first_rank: int, nproc: int, start_ns: int) -> None:
        """Arm cycle `cycle`'s fault if it falls on this node's ranks and the job's budget of
        faults lasts; a rank drawn from the seed is said."""
        self.pending, self.due_ns, self._start_ns = None, None, start_ns
        ft = self.ft
        if not ft.simulate_fault or (ft.simulated_fault_count >= 0 and self._fired() >= ft.simulated_fault_count):
            return
        plan = self.arm(cycle, world_size, first_rank, nproc, start_ns)
        if plan and plan.chosen:
            self.events.say(f"simulated fault planned: {plan.kind} in rank {plan.rank} (drawn from seed "
                            f"{ft.simulated_fault_seed}) {plan.delay:.2f}s after start")

    def rank_env(self, cycle: int, world_size: int, first_rank: int, nproc: int) -> dict:
        """ENV_SDC for this node's ranks when rank_sdc hits a rank of this node at the job's first
        cycle (its slot, or `*` with `node` persistence); said once as a `fault_injected` event."""
        ft = self.ft
        if not ft.simulate_fault or ft.simulated_fault_type != "rank_sdc":
            return {}
        if self._sdc is None:
            self._sdc = ""
            plan = plan_for_cycle(ft, 0, world_size) if cycle == 0 else None
            if plan is not None and first_rank <= plan.rank < first_rank + nproc:
                mode, step, persist, place = (ft.simulated_sdc.split(":") + ["backward"])[:4]
                local = "*" if persist == "node" else str(plan.rank - first_rank)
                self._sdc = f"{mode}:{step}:{persist}:{local}:{place}"
                self.events.event("fault_injected", f"simulated fault: rank_sdc ({mode}) armed in rank {plan.rank}'s "
                                  f"{'parameters' if place == 'memory' else 'gradient'} at step {step} ({place}, "
                                  f"{persist})", rank=plan.rank, fault="rank_sdc",
                                  sdc=ft.simulated_sdc, chosen=plan.chosen)
        return {ENV_SDC: self._sdc} if self._sdc else {}

    def inject_due(self, ranks: list, now_ns: int) -> None:
        """Fire the pending fault into its rank (of `ranks`, workers.Rank) once it is due."""
        if self.seconds_until_due(now_ns) != 0:
            return
        rank = next((r for r in ranks if r.rank == self.pending.rank and r.exitcode is None), None)
        if rank is None:   # its rank has ended already: nothing to inject into
            self.pending, self.due_ns = None, None
            return
        plan = self.fire(rank.pid)
        if plan:
            self.events.event("fault_injected", f"simulated fault: {plan.kind} injected into rank {plan.rank} "
                              f"(pid {rank.pid}) {plan.delay:.2f}s after its start", rank=plan.rank,
                              fault=plan.kind, delay=round(plan.delay, 3), pid=rank.pid, chosen=plan.chosen)

    def not_injected(self, now_ns: int) -> None:
        """The job ended: a fault planned on this node that the job outran is said."""
        pending = self.pending
        if pending is None:
            return
        ran = (now_ns - self._start_ns) / 1e9
        self.events.event("fault_not_injected", f"simulated fault not injected: {pending.kind} in rank "
                          f"{pending.rank} was planned {pending.delay:.2f}s after the start, but the job "
                          f"ended first ({ran:.2f}s)", rank=pending.rank, fault=pending.kind,
                          delay=round(pending.delay, 3))

    def arm(self, cycle: int, world_size: int, first_rank: int, nproc: int, start_ns: int) -> Optional[FaultPlan]:
        plan = plan_for_cycle(self.ft, cycle, world_size)
        if plan is not None and plan.kind == "rank_sdc":   # by the training step, in the rank (rank_env)
            plan = None
        self.pending = plan if plan and first_rank <= plan.rank < first_rank + nproc else None
        self.due_ns = start_ns + int(self.pending.delay * 1e9) if self.pending else None
        return self.pending

    def seconds_until_due(self, now_ns: int) -> Optional[float]:
        return None if self.due_ns is None else max(0.0, (self.due_ns - now_ns) / 1e9)

    def fire(self, pid: int) -> Optional[FaultPlan]:
        """Inject the pending fault into `pid` if the job's budget of faults allows it."""
        plan, self.pending, self.due_ns = self.pending, None, None
        if plan is None or pid <= 0:   # never os.kill(-1, ...): that signals every process we may
            return None
        if self.ft.simulated_fault_count >= 0 and self._claim() > self.ft.simulated_fault_count:
            return None
        try:
            os.kill(pid, signal.SIGSTOP if plan.kind == "rank_hung" else signal.SIGKILL)
        except ProcessLookupError:
            return None
        return plan
