"""The supervisor: watches one cycle of this node's ranks and says, typed, what ends it.

One selector waits on every rank's pidfd, every monitor's report channel and the agent's wake-up
pipe (signal handlers, the round watcher and a raising in-place rank write to it), so a rank's
death, a monitor's report, a peer's failure and a signal are each seen the moment they happen.
`wait` returns the monitors' reports that arrived; `outcome` then looks, in this order, for what
ends the cycle:

- the store host is lost: raises StoreLost (agent.rounds.store_failover takes over);
- the round already has a verdict (another node reported first, or the job completed): `Interrupted`;
- a rank's WorkloadControlRequest: `Failure` "rank_request" (Continue is only said; the step guard's
  decisions come as Continue requests and are said as `step_guard` events);
- peer nodes stopped answering: `Failure` "peers_lost";
- a rank ended non-zero: `Failure` "rank_ended", why from agent.recovery.failure_cause (its monitor's
  reports, the hang blame, its exit status); a rank that ended 0 is reaped and said, and so is one
  that agent.recovery.teardown_watch ended as hung in its teardown (the job's work was done: it
  counts as finished);
- a rank's function raised under ft.restartable (agent.ranks.in_place_carrier; after the deaths, since
  a dead peer is the likelier cause): `Failure` "rank_raised";
- every local rank ended 0: `Finished`, once (the cycle goes on until the other nodes finish).

It decides nothing: the agent reports a Failure to the round, whose policy decides the verdict
(agent.recovery.restart_policy). Signals are the agent's (one shutdown path).
"""
from __future__ import annotations

import os
import selectors
from typing import List, Optional, Tuple, Union

from ft_launcher.agent.recovery import failure_cause
from ft_launcher.agent.recovery.failure_cause import Failure
from ft_launcher.rank_monitor.workload_requests import STEP_GUARD_PREFIX
from ft_launcher.agent.rounds.round_types import Round, StoreLost


class Interrupted:
    """The round has a verdict already: read it (RoundProtocol.verdict)."""


class Finished:
    """Every rank of this node ended 0 in this cycle."""


Outcome = Union[None, Failure, Interrupted, Finished]


class Supervisor:
    def __init__(self, rnd: Round, group, monitor_set, watcher, carrier, blame, events, node_words: str,
                 node_id: str, wake_fd: int, teardown=None):
        self.rnd = rnd
        self.group = group
        self.monitor_set = monitor_set
        self.watcher = watcher
        self.carrier = carrier
        self.blame = blame
        self.events = events
        self.node_words = node_words   # "node 1 (host)"
        self.node_id = node_id
        self._wake_fd = wake_fd
        self.teardown = teardown   # agent.recovery.teardown_watch.TeardownWatch, or None
        self._finished = False
        self.sel = selectors.DefaultSelector()
        self.sel.register(wake_fd, selectors.EVENT_READ, "wake")
        for rank in group.ranks:
            self.sel.register(rank.pidfd, selectors.EVENT_READ, rank)
        monitor_set.register(self.sel)

    def close(self) -> None:
        self.sel.close()

    def wait(self, timeout: float) -> List[Tuple[int, dict]]:
        """Wait up to `timeout` s for anything; (local rank, report) of the monitors' new reports."""
        reports = []
        for key, _ in self.sel.select(timeout=timeout):
            if key.data == "wake":
                try:
                    os.read(self._wake_fd, 4096)
                except BlockingIOError:
                    pass
            elif isinstance(key.data, tuple):
                local_rank = key.data[1]
                reports += [(local_rank, r) for r in self.monitor_set.reports(local_rank, self.sel, self._rank_of)]
        return reports

    def _rank_of(self, local_rank: int):
        return next((r for r in self.group.ranks if r.local_rank == local_rank), None)

    def outcome(self) -> Outcome:
        """What ends the cycle now, if anything (see the module docstring)."""
        rnd, watcher = self.rnd, self.watcher
        if watcher.store_lost:
            raise StoreLost(watcher.store_lost)
        if watcher.interrupted_round == rnd.number:
            return Interrupted()
        request = self._workload_request()
        if request is not None:
            return request
        if watcher.dead_peers:
            return failure_cause.peers_lost(watcher.dead_peers)
        for rank in list(self.group.ranks):
            if rank.exitcode is not None or rank.proc.poll() is None:
                continue
            self.sel.unregister(rank.pidfd)
            code = self.group.reap(rank)
            if code != 0 and self.teardown is not None and self.teardown.ended(rank):
                self.events.event("rank_exit", f"rank {rank.rank} was ended after hanging in its teardown "
                                  f"(exit code {code}): counted as finished", rank=rank.rank, exitcode=code,
                                  teardown_hang=True)
                continue
            if code != 0:
                # only this cycle's reports: a monitor can fire while a previous cycle is torn down
                reports = self.monitor_set.take_pending(rank.local_rank, rnd.number)
                return failure_cause.rank_ended(rank, code, self.node_words, reports, self.blame)
            self.events.event("rank_exit", f"rank {rank.rank} finished (exit code 0)", rank=rank.rank, exitcode=0)
        raised = self.carrier.news(rnd.number, self.monitor_set.handles, self.group.ranks)
        if raised is not None:
            return failure_cause.rank_raised(raised[0], self.node_words, raised[1])
        if not self._finished and not self.group.running():
            self._finished = True
            return Finished()
        return None

    def _workload_request(self) -> Optional[Failure]:
        for local_rank, monitor in enumerate(self.monitor_set.handles):
            request = monitor.control_request()
            if request is None:
                continue
            rank = next((r.rank for r in self.group.ranks if r.local_rank == local_rank),
                        self.rnd.rank_offset + local_rank)   # (a slot's rank moves after an exit 16)
            failure = failure_cause.rank_request(rank, self.node_words, self.node_id, request)
            if failure is not None:
                return failure
            text = request["description"] or ""
            if text.startswith(STEP_GUARD_PREFIX):   # the step guard's decision (rank_side.live.step_guard)
                self.events.event("step_guard", f"rank {rank}: {text[len(STEP_GUARD_PREFIX):]}", rank=rank,
                                  decision=text[len(STEP_GUARD_PREFIX):])
                continue
            action, asked = failure_cause.request_words(rank, self.node_words, request)
            self.events.event("workload_request", f"{asked}: nothing to do", rank=rank, action=action,
                              description=request["description"])
        return None
