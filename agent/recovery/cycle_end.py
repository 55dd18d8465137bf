"""The cycle's end: what ended a cycle goes in, the verdict is reported or read, and a typed next
step comes out; the node loop (agent.agent, NodeAgent._cycles) only switches on it, as torch
elastic's `_RendezvousJoinOp` returns an action that its executor runs.

The steps:
- `Restart`: the next round (`Verdict.next_round`), the ranks `Verdict.stays` names kept in place,
  a rank's exit 16 re-run elsewhere (`Verdict.rerun`); `Resize` is a restart that re-forms the job
  with a node that joined (`--elastic`, kind `grow`: agent.rounds.elastic);
- `Finish`: every rank of every node ended 0 (exit 0);
- `ShutDown`: a signal ends the job (exit 128 + N);
- `Stop`: restarting is pointless, the job stops for good (exit no_restart_exit_code);
- `Leave`: this node leaves the job (ExcludeThisNode, a straggler, an exit 17's suspect; exit
  no_restart_exit_code);
- `Failed`: the restart budget is spent (exit 1).

`CycleEnd` reports what this node saw end the cycle (a `Failure` from agent.recovery.supervisor, a
hot spare's lost peers, an elastic spare's grow) to the round's end (agent.recovery.round_end,
which runs the policy), reads the verdict another node's report won, and says what the operator
reads of both: the failure's line, the culprit named in the victims' tracebacks, the restart line
(held back until this cycle's ranks are stopped), the rerun's record and the job's last words.
"""
from __future__ import annotations

import dataclasses
import hashlib
import signal
import time
from typing import List, Optional

from ft_launcher.agent.recovery import rerun_exits
from ft_launcher.agent.recovery.failure_cause import Failure, peers_lost
from ft_launcher.agent.recovery.no_restart import mark_excluded
from ft_launcher.agent.recovery.restart_policy import Verdict
from ft_launcher.agent.rounds import store_keys
from ft_launcher.agent.rounds.round_types import Round

EXIT_OK, EXIT_FAILED = 0, 1


@dataclasses.dataclass
class Step:
    """What the node does once a cycle has ended; `verdict`: the round's verdict that says so."""
    verdict: Verdict


@dataclasses.dataclass
class Restart(Step):
    """Join round `next_round`; the ranks the verdict keeps stay in place."""

    @property
    def next_round(self) -> int:
        return self.verdict.next_round


@dataclasses.dataclass
class Resize(Restart):
    """--elastic: the job re-forms with a node that joined (agent.rounds.elastic)."""


@dataclasses.dataclass
class Finish(Step):
    """The job is complete: exit 0."""
    code: int = EXIT_OK


@dataclasses.dataclass
class ShutDown(Step):
    """A signal ends the job: exit 128 + N."""
    code: int = 128


@dataclasses.dataclass
class Stop(Step):
    """The job stops for good (agent.recovery.no_restart): exit no_restart_exit_code."""
    reason: str = ""


@dataclasses.dataclass
class Leave(Step):
    """This node leaves the job (agent.recovery.no_restart): exit no_restart_exit_code."""
    reason: str = ""


@dataclasses.dataclass
class Failed(Step):
    """The restart budget is spent: exit 1 (its line, `job_failed`, is said)."""
    code: int = EXIT_FAILED


class CycleEnd:
    """This node's side of a cycle's end, on the node's bundles (agent.rounds.job_rounds,
    agent.ranks.node_ranks, agent.observation.observers) and the recovery parts
    (agent.recovery.node_cycle)."""

    def __init__(self, cfg, events, rounds, ranks, obs, round_end, flight, injector, monitors):
        self.cfg, self.events, self.say = cfg, events, events.say
        self.rounds, self.ranks, self.obs = rounds, ranks, obs
        self.round_end, self.flight, self.injector = round_end, flight, injector
        self.monitors = monitors   # () -> this node's monitor handles
        self.excluded: Optional[str] = None   # why this node leaves the job (agent.recovery.no_restart)
        self.deferred: Optional[list] = None  # restart lines said once the cycle's ranks stopped

    me = property(lambda self: self.rounds.me)
    proto = property(lambda self: self.rounds.proto)

    # ---- the next step -------------------------------------------------------------------------
    def next_step(self, rnd: Round, verdict: Verdict) -> Step:
        """What the node does after round `rnd`'s verdict; a spent budget's line is said here."""
        if verdict.kind == "complete":
            return Finish(verdict)
        if verdict.kind == "shutdown":
            return ShutDown(verdict, 128 + int(verdict.signal or signal.SIGTERM))
        if verdict.kind == "stop":
            return Stop(verdict, verdict.what or "the job was stopped")
        if not verdict.restart:
            used = min(verdict.restarts_used, self.cfg.max_restarts)
            self.flight.settle()
            self.events.event(
                "job_failed",
                f"error: {verdict.what or 'a failure'} in cycle {rnd.number}; restart budget spent "
                f"({used}/{self.cfg.max_restarts} restarts used) -> exiting 1",
                **dict(verdict.event_fields(), restarts_used=used))
            return Failed(verdict)
        if self.excluded or self.me.node_id in verdict.exclude:
            slow = store_keys.slow(self.me.node_id)
            return Leave(verdict, self.excluded or (f"excluded as a straggler: {self.proto.get(slow)}"
                                                    if self.proto.exists(slow) else verdict.what))
        return Resize(verdict) if verdict.kind == "grow" else Restart(verdict)

    # ---- what ended the cycle --------------------------------------------------------------------
    def failed(self, rnd: Round, failure: Failure) -> Verdict:
        """Report what this node saw end the cycle (agent.recovery.supervisor) to the round; the verdict,
        whoever decided it (agent.recovery.restart_policy)."""
        reason = dict(failure.report, node_id=self.me.node_id)
        self.obs.learner.freeze(self.monitors())   # what the ranks do from now on is no observation
        self.round_end.progress.poll(self.proto, rnd.number, self.monitors())   # this node's last steps count
        if failure.cause == "rank_request":
            return self._rank_request(rnd, reason)
        early = self.early_exits()
        if early:  # a rank that left early is the likely cause: its peers waited for it
            reason["what"] += (f", after rank{'s' if len(early) > 1 else ''} {', '.join(map(str, early))} "
                               f"exited 0 early and left its peers waiting")
            reason["early_exits"] = early
        slot = reason.pop("slot", None)
        if slot is not None:   # a rank's exit 16 or 17: where it ran (agent.recovery.rerun_exits)
            reason["hardware"] = self.ranks.hardware(slot, self.me.node_id, self.me.host)
        error = self.ranks.output.error(rnd.number, reason["rank"]) if reason.get("rank") is not None else None
        if error:   # its traceback: the same one again before any progress stops the job (restart_policy)
            reason["error"] = {"signature": hashlib.sha1(error[0].encode()).hexdigest()[:16], "exception": error[1]}
        verdict = self.round_end.interrupt(rnd.number, reason, rnd=rnd)
        ours = verdict.detail.get("reporter") == self.proto.token   # decided from this report (restart_policy)
        if ours and verdict.kind == "stop":   # restarting is pointless: the stop's own line follows
            line = reason["what"]
        else:   # with what the policy added (a straggler left out, a node that keeps failing)
            what = verdict.what if ours else reason["what"]
            then = ("this node leaves the job" if self.me.node_id in verdict.exclude else
                    "restarting in place" if verdict.in_process else "stopping all ranks")
            line = f"{what} -> {then}"
        self.events.event("failure", line, rank=reason.get("rank"),
                          **{k: v for k, v in reason.items() if k not in ("rank",)})
        if ours and rerun_exits.code_of(reason):   # the decision's record (its line is the failure's)
            self.events.event("rerun", None, rank=reason.get("rank"), exitcode=reason["exitcode"],
                              meaning=rerun_exits.MEANING[reason["exitcode"]], hardware=reason["hardware"],
                              decision=verdict.what, restart=verdict.restart, exclude=verdict.exclude,
                              replace_ranks=verdict.replace_ranks, move=verdict.rerun,
                              dropped=verdict.detail.get("dropped"))
        self.name_culprit(rnd.number, verdict if not ours else None, reason.get("rank"))
        return self.announce(rnd, verdict)

    def name_culprit(self, cycle: int, theirs: Optional[Verdict], rank: Optional[int]) -> None:
        """The failure's line is out: the victims' tracebacks held back by agent.ranks.rank_output
        become one line each naming it. `theirs`: another report decided the round."""
        if theirs is not None:
            rank = theirs.rank
        if rank is not None:
            self.ranks.output.culprit(cycle, [rank], f"rank {rank}, the failure above")
        else:
            self.ranks.output.culprit(cycle, None, "the failure above" + (" (another node)" if theirs else ""))

    def _rank_request(self, rnd: Round, reason: dict) -> Verdict:
        """A rank's ShutdownWorkload or ExcludeThisNode: the policy makes it a stop, or leaves this
        node out (a stop too when fewer than the minimum can remain)."""
        if reason.get("leaving"):
            self.excluded = reason["what"]   # leaves even if another node's report won the round
            mark_excluded(self.proto, self.me.node_id)
        verdict = self.round_end.interrupt(rnd.number, reason, rnd=rnd)
        ours = verdict.detail.get("reporter") == self.proto.token
        self.events.event("workload_request", f"{verdict.what if ours else reason['what']} -> stopping all ranks",
                          rank=reason["rank"], action=reason["action"], description=reason["description"])
        return self.announce(rnd, verdict)

    def interrupted(self, rnd: Round) -> Verdict:
        """Another report ended the round: its verdict (a shutdown's is the signal path's to carry out)."""
        verdict = self.proto.verdict(rnd.number)
        if verdict.kind != "complete":
            self.obs.learner.freeze(self.monitors())
        if verdict.kind == "shutdown":
            return verdict
        if verdict.kind == "complete":
            self.finish_job(rnd)
            return verdict
        if verdict.node_id != self.me.node_id:
            action = ("restarting this node's ranks in place" if verdict.in_process
                      else "stopping this node's ranks")
            self.say(f"{verdict.what} (on another node) -> {action}")
        if verdict.kind in ("failure", "stop"):
            self.name_culprit(rnd.number, verdict, None)
        return self.announce(rnd, verdict)

    def lost_peers(self, rnd: Round, dead_peers) -> Verdict:
        """A hot spare saw a training node die: with no other trainer left, only it notices."""
        reason = dict(peers_lost(dead_peers).report, node_id=self.me.node_id)
        self.events.event("failure", f"{reason['what']} -> the hot spare asks for a new round",
                          what=reason["what"])
        verdict = self.round_end.interrupt(rnd.number, reason, rnd=rnd)
        return self.announce(rnd, verdict)

    def grow(self, rnd: Round, report: dict, warm: bool) -> Verdict:
        """--elastic: this node joined while the job trains on fewer than MAX nodes: it interrupts the
        round (kind `grow`, agent.rounds.elastic); the verdict re-forms the job with it, the healthy
        ranks kept in place."""
        self.events.event("elastic_join", f"{report['what']} -> asking the job to re-form with it", what=report["what"],
                          nnodes=rnd.nnodes, warm=warm)
        verdict = self.round_end.interrupt(rnd.number, report, rnd=rnd)
        return self.announce(rnd, verdict)

    def early_exits(self) -> List[int]:
        """Ranks of this node that exited 0 in this cycle while it has not completed."""
        group = self.ranks.group
        if group is None or self.events.cycle != group.cycle:
            return []
        return [r.rank for r in group.ranks if r.exitcode == 0]

    def announce(self, rnd: Round, verdict: Verdict) -> Verdict:
        if verdict.kind == "failure":
            for rank in self.early_exits():
                self.events.event("early_exit", f"rank {rank} had exited 0 early in this cycle while its "
                                  f"peers still ran: it left them waiting", rank=rank)
        if verdict.restart:
            head = "restarting all ranks" if not verdict.in_process else "restarting in place"
            tail = "" if not verdict.in_process else f": {verdict.rung_words()}"
            args = ("restart", f"{head}: cycle {verdict.next_round} "
                    f"(restart {verdict.restarts_used}/{self.cfg.max_restarts}){tail}")
            fields = dict(next_cycle=verdict.next_round, restarts_used=verdict.restarts_used,
                          rung=verdict.rung, replace_ranks=verdict.replace_ranks,
                          replace_nodes=verdict.replace_nodes, moved=bool(verdict.rerun))
            if self.deferred is not None:   # said once this cycle's ranks are stopped
                self.deferred.append((args, fields))
            else:
                self.events.event(*args, **fields)
        return verdict

    def say_deferred(self) -> None:
        """The restart lines held back, after the stopped ranks' output (their tracebacks)."""
        deferred, self.deferred = self.deferred, None
        for args, fields in deferred or []:
            self.events.event(*args, **fields)

    def finish_job(self, rnd: Round) -> None:
        learner = self.obs.learner
        if learner.enabled and rnd.group_rank == 0:  # every node published before it was done
            learner.compute_as_writer(self.proto, [n.node_id for n in rnd.active], rnd.world_size)
        self.obs.status.cycle_end()  # the last cycle's summary before the job's last word
        self.flight.settle()  # a hang's analysis (an earlier cycle) is told before the job's end
        self.events.event("job_complete", "all ranks on all nodes finished: job complete")
        self.injector.not_injected(time.monotonic_ns())   # planned on this node, but the job was faster
