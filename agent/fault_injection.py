"""Simulated faults, injected by the agent into any script with no code change.

`rank_killed` sends SIGKILL to the rank's process (a crash); `rank_hung` sends SIGSTOP (a real
hang: only a section or heartbeat timeout can find it); `random` picks one of them. The plan of
each cycle (which rank, which fault, when) is a pure function of the seed, the cycle and the
world size, so every agent computes the same plan and a run can be reproduced; only the agent
that hosts the chosen rank acts. A job-wide counter in the store makes a fault fire once per job
by default (`simulated_fault_count`, -1 for every cycle).
"""
from __future__ import annotations

import dataclasses
import os
import random
import signal
from typing import Callable, Optional

from ft_launcher.rank_monitor.config import FaultToleranceConfig


@dataclasses.dataclass
class FaultPlan:
    kind: str           # rank_hung | rank_killed
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

    def __init__(self, ft: FaultToleranceConfig, claim: Callable[[], int]):
        self.ft = ft
        self._claim = claim   # store counter: returns how many faults the job has now fired
        self.pending: Optional[FaultPlan] = None
        self.due_ns: Optional[int] = None

    def arm(self, cycle: int, world_size: int, first_rank: int, nproc: int, start_ns: int) -> Optional[FaultPlan]:
        plan = plan_for_cycle(self.ft, cycle, world_size)
        self.pending = plan if plan and first_rank <= plan.rank < first_rank + nproc else None
        self.due_ns = start_ns + int(self.pending.delay * 1e9) if self.pending else None
        return self.pending

    def seconds_until_due(self, now_ns: int) -> Optional[float]:
        return None if self.due_ns is None else max(0.0, (self.due_ns - now_ns) / 1e9)

    def fire(self, pid: int) -> Optional[FaultPlan]:
        """Inject the pending fault into `pid` if the job's budget of faults allows it."""
        plan, self.pending, self.due_ns = self.pending, None, None
        if plan is None:
            return None
        if self.ft.simulated_fault_count >= 0 and self._claim() > self.ft.simulated_fault_count:
            return None
        try:
            os.kill(pid, signal.SIGSTOP if plan.kind == "rank_hung" else signal.SIGKILL)
        except ProcessLookupError:
            return None
        return plan
