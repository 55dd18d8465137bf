"""The restart decision: what the job does after a round ends early, decided once, in one place.

A round ends early when an agent reports a failure (a rank died, hung, raised, a node went
silent), a shutdown (a signal), a stop (a rank asked, no progress) or the job's completion. The
first report wins (compare-and-set on `r<R>/interrupt`, agent.rounds.rendezvous); its reporter runs
`RestartPolicy.decide` and writes the resulting `Verdict` to `r<R>/verdict`, which every agent
then reads and applies. Nothing else decides: the agent only carries out a verdict.

A failure climbs the ladder only as far as it must (DESIGN.md, "The recovery ladder"):

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
- no restart: the restart budget is spent (`restart` False, exit 1), or kind `stop` (exit 93):
  a rank asked for it (ShutdownWorkload), a node's leaving leaves fewer than the job's minimum
  (`max nodes - excluded < min nodes`), a failure after `max_no_progress_cycles` cycles in a
  row without a completed step (agent.recovery.progress), or the `max_identical_failures`-th
  failure in a row with the same traceback and no progress between (`RoundFacts.repeats`):
  restarting is pointless, and the failure becomes a stop (its line kept in `detail["failure"]`).

Store keys it keeps (under the run's prefix): `restarts_used` (the budget spent),
`r<R>/restartable` (nodes whose ranks all declared themselves restartable in round R),
`r<R>/origin` (JSON: the rank and node where round R's failure began) and `r<R>/progress`
(agent.recovery.progress). Free of torch: it runs on the store client it is given.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, Optional, Tuple

from ft_launcher.agent.recovery.no_restart import too_few_left
from ft_launcher.agent.recovery.progress import ProgressTracker

GRANULARITIES = ("auto", "rank", "node", "job")
NODE_FAILURE_LIMIT = 3   # failures in a row that began on one node (no progress between) -> it leaves


@dataclasses.dataclass
class Verdict:
    """What every agent does after round `next_round - 1` ended early."""

    kind: str                               # failure | complete | shutdown | stop
    what: str = ""                          # one line for the operator
    restart: bool = False
    next_round: int = 0
    restarts_used: int = 0
    rung: str = "job"                       # in_process | job: how the healthy ranks restart
    replace_ranks: List[int] = dataclasses.field(default_factory=list)
    replace_nodes: List[str] = dataclasses.field(default_factory=list)
    exclude: List[str] = dataclasses.field(default_factory=list)
    dead_nodes: List[dict] = dataclasses.field(default_factory=list)
    node_id: Optional[str] = None           # the reporting node
    rank: Optional[int] = None              # the rank where the failure began, when known
    signal: Optional[int] = None            # kind shutdown: the signal
    detail: Dict[str, Any] = dataclasses.field(default_factory=dict)  # the rest of the report

    _FIELDS = ("kind", "what", "rank", "node_id", "exclude", "dead_nodes", "signal")

    @classmethod
    def from_report(cls, report: dict) -> "Verdict":
        """A verdict that says what `report` says, not yet decided (no restart)."""
        known = {k: report[k] for k in cls._FIELDS if k in report}
        detail = {k: v for k, v in report.items() if k not in cls._FIELDS}
        return cls(**known, detail=detail)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text) -> "Verdict":
        data = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def event_fields(self) -> dict:
        """The verdict as event fields (events.jsonl)."""
        out = dict(self.detail)
        out.update({k: v for k, v in dataclasses.asdict(self).items() if k != "detail" and v not in (None, [], {})})
        return out

    @property
    def in_process(self) -> bool:
        return self.restart and self.rung == "in_process"

    def keeps(self, global_rank: int, node_id: str) -> bool:
        """Does the healthy rank `global_rank` on node `node_id` restart in its own process?"""
        return (self.in_process and global_rank not in self.replace_ranks
                and node_id not in self.replace_nodes and node_id not in self.exclude)

    def rung_words(self) -> str:
        """How the restart happens, for the operator's line."""
        if not self.restart:
            return "no restart"
        if self.rung != "in_process":
            return "restarting all ranks"
        parts = ["healthy ranks restart in place"]
        if self.replace_nodes:
            parts.append(f"node{'s' if len(self.replace_nodes) > 1 else ''} of the failure restart"
                         f"{'' if len(self.replace_nodes) > 1 else 's'} all ranks")
        if self.replace_ranks:
            parts.append("rank " + ", ".join(map(str, self.replace_ranks)) + " replaced (failed again at once)")
        return "; ".join(parts)


@dataclasses.dataclass
class RoundFacts:
    """What the deciding agent knows about the round that ended."""

    number: int
    active: List[str]                 # node ids training in the round, in order
    spares: List[str]                 # node ids waiting as hot spares
    nproc: Dict[str, int]             # ranks per node id
    hosts: Dict[str, str] = dataclasses.field(default_factory=dict)   # node id -> host, for lines
    # the cycles just before this one that failed with this failure's traceback, in a row, with no
    # progress since (gathered by the round protocol from the rounds' reports)
    repeats: List[int] = dataclasses.field(default_factory=list)

    def node_of(self, rank: Optional[int]) -> Optional[str]:
        if rank is None:
            return None
        offset = 0
        for node_id in self.active:
            offset += self.nproc.get(node_id, 0)
            if rank < offset:
                return node_id
        return None


class RestartPolicy:
    """Decides verdicts from reports (see the module docstring). `count(name, inc)`, `exists(name)`,
    `get(name)` and `put(name, value)` are the round protocol's store calls."""

    def __init__(self, store, max_restarts: int, granularity: str = "auto",
                 progress: Optional[ProgressTracker] = None, straggler_exclude: bool = False,
                 nodes: Tuple[int, int] = (1, 1), identical_failure_limit: int = 0):
        if granularity not in GRANULARITIES:
            raise ValueError(f"restart granularity {granularity!r}: expected one of {', '.join(GRANULARITIES)}")
        self.store = store
        self.max_restarts = max_restarts
        self.granularity = granularity
        # the node's progress tracker (agent.recovery.progress): its agent polls it, the policy asks it
        self.progress = progress or ProgressTracker(0)
        self.straggler_exclude = straggler_exclude
        self.nodes = nodes   # the job's (min, max) node count: a node's leaving may leave too few
        self.identical_failure_limit = identical_failure_limit   # max_identical_failures (0: off)

    # -- what the agents tell it while a round runs ----------------------------------------
    def declare_restartable(self, number: int) -> None:
        """This node's ranks all run under ft.restartable in round `number` (once per node)."""
        self.store.count(f"r{number}/restartable", 1)

    # -- the decision --------------------------------------------------------------------------
    def decide(self, report: dict, facts: RoundFacts) -> Verdict:
        verdict = Verdict.from_report(report)
        verdict.next_round = facts.number + 1
        if verdict.kind != "failure":
            return verdict                      # complete, shutdown, stop: no restart
        leaving = verdict.detail.pop("leaving", None)   # a rank's ExcludeThisNode: its node leaves
        short = leaving and too_few_left(*self.nodes, self.store.count("excluded"))
        if short:
            verdict.kind, verdict.detail["failure"], verdict.what = "stop", verdict.what, f"{verdict.what}; {short}"
            return verdict
        if leaving:
            verdict.exclude = list(verdict.exclude) + [leaving]
        limit = self.identical_failure_limit
        if limit and facts.repeats and len(facts.repeats) + 1 >= limit:
            verdict.kind, verdict.detail["failure"] = "stop", verdict.what
            verdict.what = (f"{verdict.what}: the same error as in cycle {facts.repeats[0]}, "
                            f"{len(facts.repeats) + 1} failures in a row before any progress "
                            f"(max_identical_failures={limit}); restarting cannot help")
            return verdict
        pointless = self.progress.stop_reason(self.store, facts.number)
        if pointless:                           # a stop, the budget untouched
            verdict.kind, verdict.detail["failure"], verdict.what = "stop", verdict.what, pointless
            return verdict
        used = self.store.count("restarts_used", 1)
        verdict.restarts_used = used
        verdict.restart = used <= self.max_restarts
        origin = self._origin(verdict, facts)
        self.store.put(f"r{facts.number}/origin", json.dumps(origin))
        if not verdict.restart:
            return verdict
        if self._in_process_allowed(facts):
            verdict.rung = "in_process"
            if self.granularity == "node" and origin["node_id"] in facts.active:
                verdict.replace_nodes = [origin["node_id"]]
            if origin["rank"] is not None and self._failed_again_at_once(origin, facts.number):
                verdict.replace_ranks = [origin["rank"]]
        self._leave_out_stragglers(verdict, facts)
        leaving = self._node_keeps_failing(origin, facts)
        if leaving and leaving not in verdict.exclude:
            verdict.exclude = list(verdict.exclude) + [leaving]
            verdict.what += (f"; the failure began on node {leaving} {NODE_FAILURE_LIMIT} times in a row "
                             f"without progress: a hot spare takes its place")
        return verdict

    def _leave_out_stragglers(self, verdict: Verdict, facts: RoundFacts) -> None:
        """Straggling nodes (agent.observation.stragglers) leave at this restart, as many as spares can replace."""
        if not self.straggler_exclude or not facts.spares:
            return
        slow = [n for n in facts.active if self.store.exists(f"slow/{n}") and n not in verdict.exclude]
        slow = slow[: len(facts.spares)]
        if slow:
            verdict.exclude = list(verdict.exclude) + slow
            verdict.what += "; straggling node " + ", ".join(facts.hosts.get(n, n) for n in slow) + " is left out"

    def in_place_possible(self, facts: RoundFacts) -> bool:
        """Would a failure of round `facts.number` restart in place now (agent.recovery.hang_blame asks)?"""
        return self._in_process_allowed(facts)

    def _in_process_allowed(self, facts: RoundFacts) -> bool:
        if self.granularity == "job":
            return False
        return self.store.count(f"r{facts.number}/restartable") >= len(facts.active)

    @staticmethod
    def _origin(verdict: Verdict, facts: RoundFacts) -> dict:
        """Where the failure began: its rank (when one failed) and that rank's node, else the
        first dead node, else the reporter."""
        node = facts.node_of(verdict.rank)
        if node is None and verdict.dead_nodes:
            node = verdict.dead_nodes[0].get("node_id")
        return {"rank": verdict.rank, "node_id": node or verdict.node_id}

    def _previous_origin(self, number: int) -> Optional[dict]:
        if number <= 0 or not self.store.exists(f"r{number - 1}/origin"):
            return None
        return json.loads(self.store.get(f"r{number - 1}/origin"))

    def _failed_again_at_once(self, origin: dict, number: int) -> bool:
        """The same rank began the previous round's failure, and no step completed since."""
        before = self._previous_origin(number)
        return (before is not None and before.get("rank") == origin["rank"]
                and not self.store.exists(f"r{number}/progress"))

    def _node_keeps_failing(self, origin: dict, facts: RoundFacts) -> Optional[str]:
        """The origin node, when it was the origin NODE_FAILURE_LIMIT rounds in a row without
        progress and a spare can take its place; else None."""
        node = origin["node_id"]
        if not facts.spares or node not in facts.active:
            return None
        k = facts.number
        for _ in range(NODE_FAILURE_LIMIT - 1):
            if self.store.exists(f"r{k}/progress"):
                return None
            before = self._previous_origin(k)
            if before is None or before.get("node_id") != node:
                return None
            k -= 1
        return node
