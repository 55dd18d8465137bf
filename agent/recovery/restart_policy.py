"""The restart decision: what the job does after a round ends early, decided once, in one place.

A round ends early when an agent reports a failure (a rank died, hung, raised, a node went
silent), a shutdown (a signal), a stop (a rank asked, no progress) or the job's completion. The
first report wins (compare-and-set on `r<R>/interrupt`, agent.recovery.round_end); its reporter runs
`RestartPolicy.decide` and writes the resulting `Verdict` to `r<R>/verdict`, which every agent
then reads and applies. Nothing else decides: the agent only carries out a verdict.

A failure climbs the ladder only as far as it must (docs/architecture.md, docs/recovery.md):

- rung `in_process`: every rank of the job declared itself restartable (`ft.restartable`) in
  this round and the granularity allows it: the healthy ranks leave the failed step and run
  their function again in the same process; a failed rank's slot gets a warm reserve (else a
  cold process). `replace_ranks` lists ranks replaced although alive (a rank that fails again
  at once in the same slot: the cycle after it first failed, before any step completed);
  `replace_nodes` lists nodes whose every rank is replaced (granularity `node`).
- rung `job`: every rank of every node restarts (torchrun's answer, and ours for a script that
  does not use `ft.restartable`).
- `exclude`: nodes that leave the job, a hot spare taking their place: a straggler (agent
  stragglers marks it `slow/<node>`; left out when `straggler_exclude` is on and a spare is
  there), a rank's ExcludeThisNode (the report's `leaving`: its node, already marked
  `excluded/<node>` by agent.recovery.no_restart), and a node that was where the failure began
  NODE_FAILURE_LIMIT times in a row without progress, while a spare is there to take over.
- a rank's exit 16 or 17 (Megatron's rerun state machine, an SDC guard: agent.recovery.rerun_exits):
  16 re-runs the rank on other hardware (`Verdict.rerun`: a swap of two slots, a rotation of every
  node's slots, or a spare), 17 sends the suspect node to a spare; with no spare under `--elastic`
  the node is dropped and the job goes on with the others while at least MIN remain (`elastic`);
  either stops when that cannot help or cannot be done. They are re-runs: never counted as cycles
  without progress or as the same error again.
- kind `grow` (`--elastic`): a node joined a job that trains on fewer than MAX nodes: the job
  re-forms with it, in place where the failure would have (`in_place_possible`), every healthy
  rank kept; no failure, so no budget spent.
- no restart: the restart budget is spent (`restart` False, exit 1), or kind `stop` (exit 93):
  a rank asked for it (ShutdownWorkload), a node's leaving leaves fewer than the job's minimum
  (`max nodes - excluded < min nodes`), a failure after `max_no_progress_cycles` cycles in a
  row without a completed step (agent.recovery.progress), or the `max_identical_failures`-th
  failure in a row with the same traceback and no progress between (`PolicyInputs.repeats`):
  restarting is pointless, and the failure becomes a stop (its line kept in `detail["failure"]`).

The policy is pure: `decide(report, facts, inputs)` reads and writes nothing. The round's end
(agent.recovery.round_end) gathers its inputs (`PolicyInputs`: the budget spent, the nodes excluded
and declared restartable, the progress and failure origins of recent rounds, the stragglers) and
carries out what the verdict implies (the budget, `r<R>/origin`). Store keys behind the inputs
(under the run's prefix): `restarts_used`, `excluded`, `r<R>/restartable` (nodes whose ranks all
declared themselves restartable in round R), `r<R>/origin` (JSON: the rank and node where round
R's failure began; for an exit 16 or 17 also its code, hardware and checkpoint iteration),
`r<R>/progress` / `r<R>/progress_unknown` (agent.recovery.progress) and
`slow/<node>` (agent.observation.stragglers). The same policy says whether a failure could restart
in place now (`in_place_possible`, asked by the hang blame) and whether too few nodes can remain
(`too_few_left`: a joining node's check, a leaving node's).

A hang inside a cycle is judged here too: `judge_hang(evidence)` says which hung ranks are the
culprits (stopped) and which only waited on them (victims, released to restart in place), from
the flight recorder's finding or the stack dumps (agent.recovery.hang_blame gathers the evidence
in the store, runs the judgement on the node that claimed the cycle's blame, and writes it).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, Optional, Set, Tuple, Union

from ft_launcher.agent.recovery.rerun_exits import RerunDecision, code_of
from ft_launcher.agent.rounds.elastic import Elastic
from ft_launcher.agent.rounds.round_types import Verdict, rung_words  # noqa: F401 - the policy's verdict
from ft_launcher.rank_monitor.config import RESTART_GRANULARITIES

NODE_FAILURE_LIMIT = 3   # failures in a row that began on one node (no progress between) -> it leaves


@dataclasses.dataclass
class RoundFacts:
    """What the deciding agent knows about the round that ended."""

    number: int
    active: List[str]                 # node ids training in the round, in order
    spares: List[str]                 # node ids waiting as hot spares
    nproc: Dict[str, int]             # ranks per node id
    hosts: Dict[str, str] = dataclasses.field(default_factory=dict)   # node id -> host, for lines

    def node_of(self, rank: Optional[int]) -> Optional[str]:
        if rank is None:
            return None
        offset = 0
        for node_id in self.active:
            offset += self.nproc.get(node_id, 0)
            if rank < offset:
                return node_id
        return None


@dataclasses.dataclass
class PolicyInputs:
    """What the round protocol read for one decision (RoundProtocol.policy_inputs)."""

    restarts_used: int = 0            # the job's restart budget spent before this failure
    excluded: int = 0                 # nodes that have left the job
    restartable: int = 0              # training nodes whose ranks all declared themselves restartable
    # this round's progress, then each earlier round's, back to the last that made progress:
    # "progress", "unknown" (checkpoint_iteration_file unreadable or 0 at both ends) or "none"
    progress: List[str] = dataclasses.field(default_factory=list)
    origins: Dict[int, dict] = dataclasses.field(default_factory=dict)   # earlier rounds' origins, by round
    slow: List[str] = dataclasses.field(default_factory=list)            # nodes marked as stragglers
    last_iteration: Optional[int] = None   # checkpoint_iteration_file's value when this failure was judged
    # the rounds just before this one that failed with this failure's traceback, in a row, with no
    # progress since (the `error` signature of their reports, agent.ranks.rank_output)
    repeats: List[int] = dataclasses.field(default_factory=list)

    def rerun_round(self, number: int, back: int) -> bool:
        """Did round `number - back` end in a rank's exit 16 or 17 (a re-run, agent.recovery.rerun_exits)?
        Read from its origin; round `number`'s (back 0) is not written yet: never."""
        return back > 0 and (self.origins.get(number - back) or {}).get("exitcode") in (16, 17)

    def progressed(self, back: int) -> bool:
        """Did round (this one - back) make progress?"""
        return back < len(self.progress) and self.progress[back] == "progress"


@dataclasses.dataclass
class HangEvidence:
    """What the hang blame knows when it asks `judge_hang` (agent.recovery.hang_blame)."""

    world: int                         # the cycle's ranks
    late: bool                         # the blame's wait is over (or the cycle ends): decide with what is known
    in_place: bool                     # a failure of this cycle would restart in place
    mine: Set[int] = dataclasses.field(default_factory=set)        # the deciding node's ranks (it kills its culprits)
    hung: Set[int] = dataclasses.field(default_factory=set)        # ranks whose monitor reported a hang
    stacks: Dict[int, str] = dataclasses.field(default_factory=dict)   # rank -> "wait" | "run" | "?" (stack dumps)
    flight_recorder: bool = False      # the job gathers flight-recorder dumps
    fr: Optional[dict] = None          # their finding (culprits, victims, ...); {} none; None not read yet
    fr_complete: bool = False          # every rank's dump was in when it was read

    def sure_fr(self) -> dict:
        """The flight recorder's finding where it can decide: from every rank's dump, or from
        some when every culprit it names reported its hang; else {}."""
        fr = self.fr or {}
        return fr if fr and (self.fr_complete or set(fr["culprits"]) <= self.hung) else {}


def judge_hang(ev: HangEvidence) -> Optional[Tuple[dict, bool]]:
    """The hang blame's verdict, (verdict, quiet), or None while more evidence is worth waiting
    for. The verdict names `culprits` (stopped) and `victims` (released: they restart in place);
    both empty means every hung rank is stopped, with the `why`. `quiet`: nothing to tell (a
    full restart follows whoever hung). Victims are released only when every culprit will be
    stopped: it reported its hang, or it is on the deciding node (killed there)."""
    if not ev.in_place:
        return {"evidence": "none", "why": "the cycle does not restart in place", "culprits": [], "victims": []}, True
    fr = ev.sure_fr()
    if fr:
        return _if_stoppable(dict(fr), ev)
    if ev.flight_recorder and ev.fr is None and not ev.late:
        return None   # the dumps are on their way
    known = [r for r in ev.hung if r in ev.stacks]
    if not ev.late and len(known) < ev.world:
        return None
    culprits = sorted(r for r in known if ev.stacks[r] != "wait")
    victims = sorted(r for r in known if ev.stacks[r] == "wait")
    if culprits and victims:
        return _if_stoppable({"evidence": "stacks", "culprits": culprits, "victims": victims}, ev)
    why = ("every hung rank's stack waits inside a collective" if victims else
           "no hung rank's stack waits inside a collective" if culprits else "no stack dump")
    if ev.flight_recorder:
        why = "the flight recorder found no collective some ranks never joined; " + why
    return {"evidence": "none", "why": why, "culprits": [], "victims": []}, False


def _if_stoppable(verdict: dict, ev: HangEvidence) -> Optional[Tuple[dict, bool]]:
    unstopped = [r for r in verdict["culprits"] if r not in ev.hung and r not in ev.mine]
    if not unstopped:
        return verdict, False
    if not ev.late:
        return None
    return {"evidence": "none", "culprits": [], "victims": [],
            "why": f"{evidence_words(verdict)} blames rank(s) {', '.join(map(str, unstopped))}, "
                   f"whose monitor did not report a hang in time"}, False


def evidence_words(v: dict) -> str:
    """What decided a hang verdict, in words."""
    if v.get("evidence") == "flight recorder":
        return f"flight recorder: the hung never joined {v.get('collective')} (sequence {v.get('sequence')})"
    if v.get("evidence") == "stacks":
        return "stack dumps: the waiting ranks are inside a collective, the hung are not"
    return v.get("evidence", "?")


def waiting_words(verdict: dict) -> str:
    """'; rank 0 was waiting on it (evidence)': a hang verdict's victims and what decided, for the
    culprit's failure line and the report's incident (one wording for both)."""
    victims = verdict.get("victims") or []
    if not victims:
        return ""
    return (f"; rank{'s' if len(victims) > 1 else ''} {', '.join(map(str, victims))} "
            f"{'were' if len(victims) > 1 else 'was'} waiting on it ({evidence_words(verdict)})")


class RestartPolicy:
    """Decides verdicts from reports and what the round protocol read (see the module docstring)."""

    def __init__(self, max_restarts: int, granularity: str = "auto", straggler_exclude: bool = False,
                 nodes: Tuple[int, int] = (1, 1), no_progress_limit: int = 0, min_progress_iterations: int = 1,
                 iteration_file: Optional[str] = None, identical_failure_limit: int = 0, elastic: Union[bool, Elastic] = False):
        if granularity not in RESTART_GRANULARITIES:
            raise ValueError(f"restart granularity {granularity!r}: expected one of {', '.join(RESTART_GRANULARITIES)}")
        self.max_restarts = max_restarts
        self.granularity = granularity
        self.straggler_exclude = straggler_exclude
        self.nodes = nodes   # the job's (min, max) node count: a node's leaving may leave too few
        self.no_progress_limit = no_progress_limit           # max_no_progress_cycles (0: never stop for it)
        self.min_progress_iterations = max(1, int(min_progress_iterations))
        self.iteration_file = iteration_file                 # progress by checkpoint iteration, else by steps
        self.identical_failure_limit = identical_failure_limit   # max_identical_failures (0: off)
        # --elastic: a node that must leave with no spare is dropped while MIN remain (agent.rounds.elastic:
        # its rules, or whether they are on for these nodes)
        self.elastic_rules = elastic if isinstance(elastic, Elastic) else Elastic(nodes[0], nodes[1], elastic)

    # -- the decision --------------------------------------------------------------------------
    def decide(self, report: dict, facts: RoundFacts, inputs: PolicyInputs) -> Verdict:
        verdict = Verdict.from_report(report)
        verdict.next_round = facts.number + 1
        if verdict.kind == "grow":              # --elastic: a node joined a job below MAX nodes
            verdict.restart, verdict.restarts_used = True, inputs.restarts_used   # no failure: no budget spent
            verdict.rung = "in_process" if self.in_place_possible(facts, inputs.restartable) else "job"
            return verdict
        if verdict.kind != "failure":
            return verdict                      # complete, shutdown, stop: no restart
        leaving = verdict.detail.pop("leaving", None)   # a rank's ExcludeThisNode: its node leaves
        short = leaving and self.too_few_left(inputs.excluded)
        if short:
            verdict.kind, verdict.detail["failure"], verdict.what = "stop", verdict.what, f"{verdict.what}; {short}"
            return verdict
        if leaving:
            verdict.exclude = list(verdict.exclude) + [leaving]
        # a rank's exit 16 or 17 is a re-run, never a failure to progress (agent.recovery.rerun_exits)
        rerun = RerunDecision(verdict, facts, inputs, self.elastic_rules) if code_of(report) else None
        pointless = (rerun.before_restart() if rerun else
                     self.same_error_again(verdict.what, inputs) or self.no_progress(inputs, facts.number))
        if pointless:                           # a stop, the budget untouched
            return self._stop(verdict, pointless)
        used = inputs.restarts_used + 1
        verdict.restarts_used = used
        verdict.restart = used <= self.max_restarts
        origin = verdict.origin = self._origin(verdict, facts)
        if rerun:
            origin.update(rerun.origin_fields())
        if not verdict.restart:
            return verdict
        if self.in_place_possible(facts, inputs.restartable):
            verdict.rung = "in_process"
            if self.granularity == "node" and origin["node_id"] in facts.active:
                verdict.replace_nodes = [origin["node_id"]]
            if origin["rank"] is not None and self._failed_again_at_once(origin, facts.number, inputs):
                verdict.replace_ranks = [origin["rank"]]
        if rerun:
            stop = rerun.place_16(verdict.in_process) if rerun.code == 16 else rerun.place_17()
            if stop:
                verdict.restart, verdict.restarts_used, verdict.rerun = False, inputs.restarts_used, {}
                return self._stop(verdict, stop)
        self._leave_out_stragglers(verdict, facts, inputs)
        leaving = self._node_keeps_failing(origin, facts, inputs)
        if leaving and leaving not in verdict.exclude:
            verdict.exclude = list(verdict.exclude) + [leaving]
            verdict.what += (f"; the failure began on node {leaving} {NODE_FAILURE_LIMIT} times in a row "
                             f"without progress: a hot spare takes its place")
        return verdict

    @staticmethod
    def _stop(verdict: Verdict, why: str) -> Verdict:
        """Restarting is pointless: kind `stop`, the failure's own line kept in `detail["failure"]`."""
        verdict.kind, verdict.detail["failure"], verdict.what = "stop", verdict.what, why
        return verdict

    def too_few_left(self, excluded: int) -> Optional[str]:
        """Why the job cannot go on once `excluded` nodes have left (`max nodes - excluded < min
        nodes`), or None: a node's leaving, and every joining node, ask."""
        min_nodes, max_nodes = self.nodes
        left = max_nodes - excluded
        if left >= min_nodes:
            return None
        return (f"{excluded} node{'s' if excluded != 1 else ''} excluded: at most {left} of the "
                f"{min_nodes} needed can remain")

    def same_error_again(self, what: str, inputs: PolicyInputs) -> Optional[str]:
        """Why the job must stop: this failure is the `max_identical_failures`-th in a row with the
        same traceback and no progress between (a restart would fail the same way), or None."""
        limit = self.identical_failure_limit
        if not limit or not inputs.repeats or len(inputs.repeats) + 1 < limit:
            return None
        return (f"{what}: the same error as in cycle {inputs.repeats[0]}, {len(inputs.repeats) + 1} failures in a "
                f"row before any progress (max_identical_failures={limit}); restarting cannot help")

    def no_progress(self, inputs: PolicyInputs, number: int = 0) -> Optional[str]:
        """Why the job must stop instead of restarting: `max_no_progress_cycles` cycles in a row
        ended without progress (agent.recovery.progress), or None. Rounds before `number` that ended
        in a rank's exit 16 or 17 are re-runs, not counted (agent.recovery.rerun_exits)."""
        if self.no_progress_limit <= 0:
            return None
        streak = sum(1 for back, status in enumerate(inputs.progress)
                     if status == "none" and not inputs.rerun_round(number, back))
        if streak < self.no_progress_limit:
            return None
        plural = "s" if streak != 1 else ""
        if self.iteration_file:
            return (f"no progress: {streak} cycle{plural} in a row ended without the checkpoint iteration in "
                    f"{self.iteration_file} rising by min_progress_iterations={self.min_progress_iterations} "
                    f"(it reads {inputs.last_iteration}; max_no_progress_cycles={self.no_progress_limit}); "
                    f"restarting is pointless")
        if "progress" not in inputs.progress:   # never made progress: the job does not use `step`
            return None
        steps = ("a completed 'step' section" if self.min_progress_iterations == 1
                 else f"{self.min_progress_iterations} completed 'step' sections")
        return (f"no progress: {streak} cycle{plural} in a row ended without {steps} on any rank "
                f"(max_no_progress_cycles={self.no_progress_limit}); restarting is pointless")

    def _leave_out_stragglers(self, verdict: Verdict, facts: RoundFacts, inputs: PolicyInputs) -> None:
        """Straggling nodes (agent.observation.stragglers) leave at this restart, as many as spares can replace."""
        if not self.straggler_exclude or not facts.spares:
            return
        slow = [n for n in facts.active if n in inputs.slow and n not in verdict.exclude]
        slow = slow[: len(facts.spares)]
        if slow:
            verdict.exclude = list(verdict.exclude) + slow
            verdict.what += "; straggling node " + ", ".join(facts.hosts.get(n, n) for n in slow) + " is left out"

    def in_place_possible(self, facts: RoundFacts, restartable: int) -> bool:
        """Would a failure of round `facts.number` restart in place, `restartable` of its training
        nodes having declared their ranks restartable (agent.recovery.hang_blame asks too)?"""
        return self.granularity != "job" and restartable >= len(facts.active)

    @staticmethod
    def _origin(verdict: Verdict, facts: RoundFacts) -> dict:
        """Where the failure began: its rank (when one failed) and that rank's node, else the
        first dead node, else the reporter."""
        node = facts.node_of(verdict.rank)
        if node is None and verdict.dead_nodes:
            node = verdict.dead_nodes[0].get("node_id")
        return {"rank": verdict.rank, "node_id": node or verdict.node_id}

    @staticmethod
    def _failed_again_at_once(origin: dict, number: int, inputs: PolicyInputs) -> bool:
        """The same rank began the previous round's failure, and no step completed since."""
        before = inputs.origins.get(number - 1)
        return before is not None and before.get("rank") == origin["rank"] and not inputs.progressed(0)

    @staticmethod
    def _node_keeps_failing(origin: dict, facts: RoundFacts, inputs: PolicyInputs) -> Optional[str]:
        """The origin node, when it was the origin NODE_FAILURE_LIMIT rounds in a row without
        progress and a spare can take its place; else None."""
        node = origin["node_id"]
        if not facts.spares or node not in facts.active:
            return None
        for back in range(NODE_FAILURE_LIMIT - 1):
            if inputs.progressed(back):
                return None
            before = inputs.origins.get(facts.number - back - 1)
            if before is None or before.get("node_id") != node:
                return None
        return node
