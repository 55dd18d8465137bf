"""Megatron's exit codes 16 and 17 (megatron/core/rerun_state_machine.py), and the SDC guard's, under
our launcher: what the restart policy (agent.recovery.restart_policy) does with them. Pure.

- **16, "resume to disambiguate on a different GPU"**: the rank's step gave a suspect result twice
  on its GPU; it must re-run on other hardware. The job restarts with that rank placed elsewhere,
  never on the same device again:
  - the ranks restart in place (`ft.restartable`): the rank swaps slots with the next one of its
    node (`swap`), so it runs on that slot's device, the other rank on its own; both are replaced,
    every other rank is kept;
  - every rank restarts (Megatron's scripts): every node rotates its ranks by one slot (`rotate`),
    so every rank runs on another device. Megatron's ranks all exit 16 together (the decision is
    collective) and only its log names the suspect, so every rank moves;
  - a node of one rank: a hot spare takes the node's place (the node leaves); with none and
    `--elastic`, the node is dropped and the job goes on with the others while at least MIN
    (`--nnodes MIN:MAX`) remain; else the job stops with one line (no other hardware to re-run on).
  A second 16 for the same iteration (no progress since the first, and the checkpoint iteration, when
  `checkpoint_iteration_file` says it, the same) came from other hardware: the result reproduces
  there, so the data or the model is to blame: the job stops with one line.
- **17, "failed validation"**: no restart in place on that device: its node is suspect. A 17
  right after a 16's re-run (no progress since) ends that re-run: the suspect is the node the 16
  came from. The suspect node leaves when a hot spare can take its place (it has already left:
  the job goes on); with no spare and `--elastic` it is dropped and the job goes on with the
  others while at least MIN remain (an elastic node loss: the next round closes on fewer nodes);
  else the job stops with one line. A 17 again before any progress stops the job (Megatron's 17
  after its re-run would come back from its checkpoint every time).
Both are re-runs, not failures to make progress: a cycle that ended in one is never counted by
`max_no_progress_cycles` nor by `max_identical_failures`. A stop is the policy's kind `stop` (every
agent exits `no_restart_exit_code`, 93). Each decision is one line (`Verdict.what`) and its
`rerun` record (the event `rerun`, the ranks' environment: rank_monitor.rerun_env); a node dropped
under `--elastic` is also the verdict's `detail["dropped"]` ({node_id, nodes: how many go on, exitcode}).

The failing node's report carries `hardware` ({node_id, host, slot, device, slots: its slot ->
rank-index map}); the decider keeps it, with the exit code and the iteration, in the round's origin
(`r<R>/origin`), which later decisions read back (PolicyInputs.origins).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

from ft_launcher.agent.rounds.elastic import Elastic

RESUME_ELSEWHERE = 16      # Megatron's EXIT_CODE_RESUME_TO_DISAMBIGUATE
FAILED_VALIDATION = 17     # Megatron's EXIT_CODE_FAILED_ON_RESULT_VALIDATION
CODES = (RESUME_ELSEWHERE, FAILED_VALIDATION)
MEANING = {RESUME_ELSEWHERE: "resume to disambiguate on a different GPU",
           FAILED_VALIDATION: "failed result validation: its node is suspect"}


def code_of(report: dict) -> Optional[int]:
    """16 or 17 when the report is a rank's exit with one of them (the agent attached its hardware)."""
    code = report.get("exitcode")
    return code if code in CODES and report.get("hardware") else None


def where(hw: dict) -> str:
    """'host device 1' for a line."""
    return f"{hw.get('host') or hw.get('node_id')} device {hw.get('device')}"


def earlier(number: int, inputs) -> List[Tuple[int, dict]]:
    """The rounds before `number`, newest first, whose failure was a 16 or 17 with no progress
    since it (their origins: agent.recovery.restart_policy.PolicyInputs)."""
    out = []
    back = 1
    while not inputs.progressed(back - 1):
        origin = inputs.origins.get(number - back)
        if origin is None or origin.get("exitcode") not in CODES:
            break
        out.append((number - back, origin))
        back += 1
    return out


def same_iteration(before: dict, iteration: Optional[int]) -> bool:
    """No progress came between; with the checkpoint iteration known at both, it is also the same."""
    was = before.get("iteration")
    return was is None or iteration is None or was == iteration


def iteration_words(cycle: int, iteration: Optional[int]) -> str:
    return f"cycle {cycle}" + (f", checkpoint iteration {iteration}" if iteration is not None else "")


class RerunDecision:
    """What the policy does with a 16 or 17 (`decide_*`): `stop` (one line) or changes to the verdict."""

    def __init__(self, verdict, facts, inputs, elastic_rules: Optional[Elastic] = None):
        self.verdict, self.facts, self.inputs = verdict, facts, inputs
        self.elastic_rules = elastic_rules or Elastic(1, 1)   # who may be dropped (agent.rounds.elastic)
        self.code = verdict.detail.get("exitcode")
        self.hw = verdict.detail["hardware"]
        self.history = earlier(facts.number, inputs)

    def origin_fields(self) -> dict:
        """What the round's origin keeps of it for later decisions."""
        return {"exitcode": self.code, "hardware": {k: v for k, v in self.hw.items() if k != "slots"},
                "iteration": self.inputs.last_iteration}

    def before_restart(self) -> Optional[str]:
        """Why the job stops before any placement (a 16 again, a 17 again), or None."""
        v, last = self.verdict, self.history[0] if self.history else None
        if self.code == RESUME_ELSEWHERE:
            first = next(((k, o) for k, o in self.history if o["exitcode"] == RESUME_ELSEWHERE), None)
            if first and same_iteration(first[1], self.inputs.last_iteration):
                k, o = first
                return (f"{v.what}: exit 16 again for the same iteration ({iteration_words(k, o.get('iteration'))}) "
                        f"after the re-run on other hardware (cycle {k}'s: rank {o.get('rank')} on "
                        f"{where(o['hardware'])}; this one: rank {v.rank} on {where(self.hw)}): the result reproduces "
                        f"on a different GPU, so the data or the model is to blame, not the GPU; restarting cannot help")
            return None
        if last and last[1]["exitcode"] == FAILED_VALIDATION:
            return (f"{v.what}: exit 17 again before any progress (cycle {last[0]}'s was on "
                    f"{where(last[1]['hardware'])}): the failed validation comes back after a restart; "
                    f"restarting cannot help")
        return None

    def suspect(self) -> Tuple[str, str]:
        """A 17's suspect node and why: the 16's node when it ends that 16's re-run, else its own."""
        if self.history and self.history[0][1]["exitcode"] == RESUME_ELSEWHERE:
            k, o = self.history[0]
            why = f"the node of cycle {k}'s exit 16 ({where(o['hardware'])}), whose re-run this ends"
            return o["hardware"]["node_id"], why
        return self.hw["node_id"], f"its node ({where(self.hw)})"

    def remaining(self, node: str) -> int:
        """How many training nodes go on once `node` leaves with the verdict's other leavers (and
        the dead), with no spare to take their places."""
        gone = set(self.verdict.exclude) | {d.get("node_id") for d in self.verdict.dead_nodes} | {node}
        return len([n for n in self.facts.active if n not in gone])

    def drop(self, node: str) -> Optional[int]:
        """--elastic, no spare: `node` leaves and the job goes on with the others (an elastic node
        loss) when at least MIN remain: how many go on (the verdict's `exclude` and `detail["dropped"]`
        set), or None (not elastic, or too few would remain)."""
        left = self.remaining(node)
        if not self.elastic_rules.drops(left):
            return None
        if node not in self.verdict.exclude:
            self.verdict.exclude = list(self.verdict.exclude) + [node]
        self.verdict.detail["dropped"] = {"node_id": node, "nodes": left, "exitcode": self.code}
        return left

    def too_few(self, node: str) -> str:
        """--elastic: why dropping `node` cannot keep the job going ('' for a job of fixed size)."""
        return self.elastic_rules.too_few_words(self.remaining(node))

    def place_17(self) -> Optional[str]:
        """A 17: the suspect node leaves for a spare, or under --elastic is dropped; the line's tail,
        or a stop's line (None: applied)."""
        v, facts = self.verdict, self.facts
        node, why = self.suspect()
        if node not in facts.active:
            v.what += f"; the suspect, {why}, has already left the job"
            return None
        if len(facts.spares) > len([n for n in v.exclude if n != node]):
            if node not in v.exclude:
                v.exclude = list(v.exclude) + [node]
            v.what += f"; the suspect, {why}, leaves the job: a hot spare takes its place"
            return None
        left = self.drop(node)
        if left is not None:
            v.what += f"; the suspect, {why}, is {self.elastic_rules.dropped_words(left)}"
            return None
        return (f"{v.what}: the suspect, {why}, must not restart in place and no hot spare can take its place"
                f"{self.too_few(node)}; stopping the job")

    def place_16(self, in_process: bool) -> Optional[str]:
        """A 16: put the job's rank elsewhere (the verdict's `rerun`, `replace_ranks`, `exclude`); None,
        or a stop's line when there is no other hardware."""
        v, facts, hw = self.verdict, self.facts, self.hw
        node, slot, slots = hw["node_id"], int(hw["slot"]), list(hw.get("slots") or [])
        n = facts.nproc.get(node, len(slots)) if node in facts.active else 0
        rerun = {"cycle": facts.number, "rank": v.rank, "suspect": {k: hw.get(k) for k in ("node_id", "host", "device")},
                 "iteration": self.inputs.last_iteration, "swap": None, "rotate": False}
        if n >= 2 and len(slots) == n:
            if in_process:   # the two ranks swap slots; every other rank keeps its process
                other = (slot + 1) % n
                offset = v.rank - slots[slot]
                partner = offset + slots[other]
                rerun["swap"] = {"node_id": node, "slots": [slot, other]}
                v.replace_ranks = sorted(set(v.replace_ranks) | {v.rank, partner})
                v.what += (f"; rank {v.rank} re-runs on the device of slot {other} of its node, rank {partner} "
                           f"takes slot {slot}")
            else:            # every rank restarts: every node rotates its ranks by one slot
                rerun["rotate"] = True
                v.what += "; every node rotates its ranks by one slot: every rank re-runs on another device"
        elif node in facts.active and len(facts.spares) > len([e for e in v.exclude if e != node]):
            if node not in v.exclude:
                v.exclude = list(v.exclude) + [node]
            v.what += f"; its node leaves for a hot spare, where rank {v.rank} re-runs"
        elif node in facts.active and self.drop(node) is not None:
            v.what += (f"; its node (one rank: no other device there) is "
                       f"{self.elastic_rules.dropped_words(v.detail['dropped']['nodes'])}, rank {v.rank}'s step re-runs without that GPU")
        else:
            return (f"{v.what}: no other hardware to re-run rank {v.rank} on (one rank on its node, no hot spare"
                    f"{self.too_few(node) if node in facts.active else ''}); restarting would give it the same GPU "
                    f"again")
        v.rerun = rerun
        return None
