"""The round's end: one executor from a report to the verdict every agent applies.

An agent reports what ended its round (a failure, a shutdown, a stop, the job's completion) with
`RoundEnd.interrupt`. The first report wins the compare-and-set on `r<R>/interrupt` (the round
protocol's store, agent.rounds.rendezvous); its reporter runs the rest here, on its own:

1. the facts: the round's members from the store (`facts`, the one place RoundFacts are built);
2. the policy's inputs (`policy_inputs`): this round's progress judged (agent.recovery.progress,
   `checkpoint_iteration_file`) and the history read back (progress, origins of recent failures,
   the same traceback in a row: `same_error_before`), the budget spent, the nodes excluded and
   declared restartable, the stragglers;
3. the decision: `RestartPolicy.decide` (agent.recovery.restart_policy, pure);
4. its publication: the budget spent, the failure's origin, the nodes the next round expects back,
   the verdict, the next round's number.
Every reporter then reads the verdict, whoever decided it. This executor owns the restart policy
and this node's progress tracker (the agent polls it); the round protocol only reads and writes
the store. The keys are agent.rounds.store_keys'.
"""
from __future__ import annotations

import dataclasses
import json
from typing import List, Optional, Union

from ft_launcher.agent.recovery.progress import ProgressTracker
from ft_launcher.agent.recovery.restart_policy import (NODE_FAILURE_LIMIT, PolicyInputs, RestartPolicy, RoundFacts,
                                                       Verdict)
from ft_launcher.agent.rounds import store_keys
from ft_launcher.agent.rounds.elastic import Elastic
from ft_launcher.agent.rounds.round_types import RendezvousError, Round


class RoundEnd:
    """This agent's side of a round's end, on the round protocol `proto` (agent.rounds.rendezvous)."""

    def __init__(self, proto, cfg):
        self.proto = proto
        ft = cfg.ft
        self.policy = RestartPolicy(cfg.max_restarts, ft.restart_granularity, ft.straggler_exclude,
                                    (cfg.min_nodes, cfg.max_nodes), ft.max_no_progress_cycles,
                                    ft.min_progress_iterations, ft.checkpoint_iteration_file,
                                    ft.max_identical_failures, Elastic.of(cfg))
        # this node's progress: its agent polls it; when this node decides a verdict, it judges the
        # cycle and reads the history the policy counts
        self.progress = ProgressTracker(ft.max_no_progress_cycles, ft.min_progress_iterations,
                                        ft.checkpoint_iteration_file)
        proto.too_few_left = self.policy.too_few_left   # a joiner's check (RoundProtocol._check_join_stop)

    def history_rounds(self) -> int:
        """How many rounds back the policy reads (what a store failover carries, agent.rounds.store_keys)."""
        policy = self.policy
        return store_keys.carry_rounds(NODE_FAILURE_LIMIT, policy.identical_failure_limit, policy.no_progress_limit)

    def facts(self, rnd: Union[Round, int]) -> RoundFacts:
        """What the decider of a round's verdict knows: from this agent's Round (its member lists,
        read from the store once, with itself among the spares when it joined late), or from the
        store's member list of round number `rnd`."""
        if isinstance(rnd, Round):
            number, active, spares = rnd.number, rnd.active, rnd.spares
        else:
            number, (active, spares) = rnd, self.proto.members(rnd)
        try:   # hot spares that joined during the round wait too (a 16 or 17 in cycle 0 can use them)
            known = {n.node_id for n in active} | {n.node_id for n in spares}
            spares = list(spares) + [n for n in self.proto.late_joiners(number) if n.node_id not in known]
        except RendezvousError:
            pass
        return RoundFacts(number, [n.node_id for n in active], [n.node_id for n in spares],
                          {n.node_id: n.nproc for n in active}, {n.node_id: n.host for n in active})

    def interrupt(self, number: int, reason: dict, facts: Optional[RoundFacts] = None,
                  rnd: Optional[Round] = None) -> Verdict:
        """Report a failure, shutdown, stop or completion of round `number` (`rnd`: this agent's
        Round, when it has one). The first reporter decides and publishes the verdict; returns it,
        whoever decided it. `facts`: the round's, when the caller knows them (else built here, by
        the decider of a failure only)."""
        proto = self.proto
        report = proto.claim_interrupt(number, reason)
        if report is not None:
            if facts is None:
                facts = (self.facts(rnd or number) if report.get("kind") in ("failure", "grow")
                         else RoundFacts(number, [], [], {}))
            inputs = self.policy_inputs(report, facts)
            verdict = self.policy.decide(report, facts, inputs)
            if verdict.restarts_used > inputs.restarts_used:   # the budget this restart spends
                proto.count(store_keys.restarts_used(), verdict.restarts_used - inputs.restarts_used)
            if verdict.origin is not None:
                proto.put(store_keys.origin(number), json.dumps(verdict.origin))
            if verdict.restart:
                self._publish_target(number, verdict, facts)
            proto.put(store_keys.verdict(number), verdict.to_json())
            if verdict.restart:
                proto.put(store_keys.next_round(), str(number + 1))
        return proto.verdict(number)

    def policy_inputs(self, report: dict, facts: RoundFacts) -> PolicyInputs:
        """What the restart policy decides a failure of round `facts.number` from (the store's
        side of it; agent.recovery.restart_policy.PolicyInputs). A grow needs the budget spent and who
        is restartable; other reports need none."""
        proto, number = self.proto, facts.number
        if report.get("kind") == "grow":
            return PolicyInputs(restarts_used=proto.count(store_keys.restarts_used()),
                                restartable=proto.count(store_keys.restartable(number)))
        if report.get("kind") != "failure":
            return PolicyInputs()
        self.progress.judge(proto, number)   # checkpoint_iteration_file: this cycle's progress, by the file
        origins = {}
        back = max(NODE_FAILURE_LIMIT, self.policy.no_progress_limit + 1)   # re-runs are not counted as no progress
        for k in range(number - 1, max(-1, number - back), -1):
            if proto.exists(store_keys.origin(k)):
                origins[k] = json.loads(proto.get(store_keys.origin(k)))
        slow = []
        if self.policy.straggler_exclude and facts.spares:   # one read for all of them
            marks = proto.get_raw([store_keys.slow(n) for n in facts.active])
            slow = [n for n, mark in zip(facts.active, marks) if mark]
        return PolicyInputs(restarts_used=proto.count(store_keys.restarts_used()),
                            excluded=proto.count(store_keys.excluded()),
                            restartable=proto.count(store_keys.restartable(number)),
                            progress=self.progress.history(proto, number), origins=origins, slow=slow,
                            last_iteration=self.progress.last, repeats=self.same_error_before(number, report))

    def same_error_before(self, number: int, reason: dict) -> List[int]:
        """The rounds just before `number` whose failure had the same traceback as `reason`'s
        (its `error` signature, agent.ranks.rank_output), in a row, none with progress (the
        restart policy's `repeats`). After ProgressTracker.judge: this round's progress is known."""
        proto = self.proto
        signature = (reason.get("error") or {}).get("signature")
        if not signature or proto.exists(store_keys.progress(number)):
            return []
        same: List[int] = []
        for k in range(number - 1, -1, -1):
            if not proto.exists(store_keys.interrupt(k)):
                break
            try:
                before = json.loads(proto.get(store_keys.interrupt(k)))
            except ValueError:
                break
            if before.get("kind") == "store_lost" and not proto.exists(store_keys.progress(k)):
                continue   # a round a store failover ended: no failure of the script's, passed over
            if (before.get("error") or {}).get("signature") != signature or proto.exists(store_keys.progress(k)):
                break
            same.insert(0, k)
        return same

    def in_place_possible(self, rnd: Union[Round, int], facts: Optional[RoundFacts] = None) -> bool:
        """Would a failure of round `rnd` restart in place now (agent.recovery.hang_blame asks)?"""
        facts = facts or self.facts(rnd)
        return self.policy.in_place_possible(facts, self.proto.count(store_keys.restartable(facts.number)))

    def end_lost_round(self, number: int, successor: bool) -> None:
        """Round `number` ended with its store (agent.rounds.store_failover), on the new store: this
        node's progress in it; on the successor, its end as a store loss (the same-error history
        passes over it) and, with checkpoint_iteration_file, its progress judged by the file."""
        if self.progress.reported(number):
            self.proto.put(store_keys.progress(number), "1")
        if successor:
            self.proto.put(store_keys.interrupt(number), json.dumps({"kind": "store_lost"}))
            self.progress.judge(self.proto, number)

    def _publish_target(self, number: int, verdict: Verdict, facts: RoundFacts) -> None:
        """The nodes round `number + 1` expects back: the round's members and late joiners,
        less the dead, the excluded and those that left the job."""
        proto = self.proto
        if not facts.active:
            return
        try:
            active, spares = proto.members(number)
        except RendezvousError:
            return
        nodes = active + spares + proto.late_joiners(number)
        gone = {n["node_id"] for n in verdict.dead_nodes} | set(verdict.exclude)
        left = proto.get_raw([store_keys.excluded_node(n.node_id) for n in nodes])
        expected = [n for n, out in zip(nodes, left) if n.node_id not in gone and not out]
        proto.put_raw([store_keys.expect(number + 1), store_keys.target(number + 1)],
                      [json.dumps([dataclasses.asdict(n) for n in expected], separators=(",", ":")),
                       str(len(expected))])
