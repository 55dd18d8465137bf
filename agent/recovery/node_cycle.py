"""One cycle of this node, from its round to its end: the recovery parts a cycle needs (the flight
recorder, the hang blame, the teardown watch, simulated faults, health checks, the round's end and
progress: made here, once per run), a training node's cycle (start its ranks, watch them with the
supervisor until something ends the cycle, end it as the verdict says) and a hot spare's wait.
What ended the cycle goes to agent.recovery.cycle_end, whose typed next step the node loop
(agent.agent, NodeAgent._cycles) switches on.

It stands on the node's bundles: agent.rounds.job_rounds (the store, the round protocol, the
watcher), agent.ranks.node_ranks (the processes), agent.observation.observers (what the operator
reads). The signal path stays the agent's: `check_signal(rnd)` (raises its Shutdown when a signal
came), `peer_shut_down(rnd, verdict)` (another node's signal: the ranks stopped, Shutdown raised)
and `unhandled_signal()` (what a wait asks between slices).

A cycle: cycle_start -> the watcher, flight recorder, hang blame, teardown watch, learned timeouts
and progress begin the cycle -> the carrier adopts the ranks kept in place, the other slots get a
warm reserve or a cold start (agent.ranks.node_ranks) -> the supervisor's loop (reports from the
monitors, planned faults, the observers, signals) until it returns a Failure, Interrupted or all
ranks Finished -> the verdict (agent.recovery.cycle_end) -> the end: the ranks the verdict keeps
asked to stay (agent.ranks.in_place_carrier), the others stopped, the parts told.
"""
from __future__ import annotations

import os
import signal
import selectors
import time
from typing import Callable, List, Optional

from ft_launcher.agent.ranks.gpu_env import slot_device
from ft_launcher.agent.recovery import failure_cause
from ft_launcher.agent.recovery.cycle_end import CycleEnd
from ft_launcher.agent.recovery.failure_cause import Failure
from ft_launcher.agent.recovery.fault_injection import FaultInjector
from ft_launcher.agent.recovery.flight_recorder import FlightRecorder
from ft_launcher.agent.recovery.hang_blame import POLL as BLAME_POLL, HangBlame
from ft_launcher.agent.recovery.health_checks import HealthChecks
from ft_launcher.agent.recovery.restart_policy import Verdict
from ft_launcher.agent.recovery.round_end import RoundEnd
from ft_launcher.agent.recovery.supervisor import Finished, Interrupted, Supervisor
from ft_launcher.agent.recovery.teardown_watch import TeardownWatch
from ft_launcher.agent.node_state import NodeState
from ft_launcher.agent.rounds import store_keys
from ft_launcher.agent.rounds.round_types import NAMED_UP_TO, RendezvousError, Round, StoreLost
from ft_launcher.rank_monitor import shm_layout
from ft_launcher.rank_monitor.peer_sockets import ENV_JOB_ADDRS


class NodeCycle:
    """This node's cycles (see the module docstring); made once the agent's run starts, before the
    monitors and the warm reserves (the flight recorder's files are the watchdog's to remove)."""

    def __init__(self, cfg, events, life, obs, rounds, ranks, run_dir: str, wake_r: int,
                 check_signal: Callable, peer_shut_down: Callable, unhandled_signal: Callable):
        self.cfg, self.events, self.say, self.life = cfg, events, events.say, life
        self.obs, self.rounds, self.ranks = obs, rounds, ranks
        self.wake_r = wake_r
        self.check_signal, self.peer_shut_down, self.unhandled_signal = check_signal, peer_shut_down, unhandled_signal
        self.flight = FlightRecorder(cfg.log_dir, events, events.say, ranks.watchdog, keep_dir=run_dir)
        self.blame = HangBlame(events)
        self.teardown = TeardownWatch(cfg.ft.teardown_hang_grace, events)
        os.environ[shm_layout.ENV_HANG_VERDICT] = "1"   # our monitors hold a hung rank for the blame verdict
        # made once the store is reached (reach)
        self.round_end: Optional[RoundEnd] = None
        self.injector: Optional[FaultInjector] = None
        self.health: Optional[HealthChecks] = None
        self.end: Optional[CycleEnd] = None

    # the node's bundles, by part
    status = property(lambda self: self.obs.status)
    learner = property(lambda self: self.obs.learner)
    proto = property(lambda self: self.rounds.proto)
    store = property(lambda self: self.rounds.store)
    me = property(lambda self: self.rounds.me)
    watcher = property(lambda self: self.rounds.watcher)
    carrier = property(lambda self: self.ranks.carrier)
    monitor_set = property(lambda self: self.ranks.monitor_set)
    reserves = property(lambda self: self.ranks.reserves)
    group = property(lambda self: self.ranks.group)
    progress = property(lambda self: self.round_end.progress)   # one tracker: this node's polls, the policy's inputs

    @property
    def monitors(self) -> list:
        """The node's monitor handles by local rank (agent.ranks.monitor_set)."""
        return self.monitor_set.handles if self.monitor_set is not None else []

    def reach(self) -> None:
        """The store is reached (JobRounds.reach): the parts that stand on the round protocol."""
        self.round_end = RoundEnd(self.proto, self.cfg)   # the verdicts this node decides
        self.rounds.failover.round_end = self.round_end
        self.injector = FaultInjector(self.cfg.ft, self.proto.claim_fault, self.proto.faults_fired, self.events)
        self.flight.on_request = lambda cycle: self.learner.freeze(self.monitors, cycle)
        self.flight.on_done = lambda cycle: [m.flight_done(cycle) for m in list(self.monitors)]
        self._warn_if_hangs_undetectable()
        if self.ranks.heartbeat_warning():
            self.say(self.ranks.heartbeat_warning())
        self.carrier.proto = self.proto
        self.health = HealthChecks(self.cfg.ft, self.cfg.log_dir, self.say)
        self.end = CycleEnd(self.cfg, self.events, self.rounds, self.ranks, self.obs, self.round_end, self.flight,
                            self.injector, lambda: self.monitors)

    def unhealthy(self) -> Optional[str]:
        """The health checks before a round (agent.recovery.health_checks): what failed, or None."""
        unhealthy = self.health.run()
        rendezvous_mark("health_checks")
        return unhealthy

    def run(self, rnd: Round) -> Verdict:
        """Round `rnd` on this node: trained, or waited through as a hot spare; its verdict."""
        if rnd.group_rank is None:
            self.carrier.drop("this node waits as a hot spare in the new round")
            return self._wait_as_spare(rnd)
        self.events.node = rnd.group_rank
        return self._run_round(rnd)

    # ---- a training node's cycle ---------------------------------------------------------------
    def _run_round(self, rnd: Round) -> Verdict:
        cfg = self.cfg
        self.life.to(NodeState.RUNNING, f"cycle {rnd.number}")
        worker_store, master = self.rounds.workers_store(rnd)   # MASTER_ADDR/PORT (group rank 0 hosts it)
        restarts = self.proto.restarts_used()
        self.events.event(
            "cycle_start",
            f"cycle {rnd.number}: node {rnd.group_rank} of {rnd.nnodes}, ranks "
            f"{rnd.rank_offset}-{rnd.rank_offset + cfg.nproc_per_node - 1} of {rnd.world_size}"
            + (f", {rnd.nspares} hot spare(s)" if rnd.nspares else "")
            + (f" (restart {restarts}/{cfg.max_restarts})" if rnd.number else ""),
            world_size=rnd.world_size, master=f"{master[0]}:{master[1]}", **_names(rnd))
        self._say_resize(rnd)
        self.obs.cycle_starting(rnd)   # NVRx's cycle info (group rank 0), the live news' cycle
        previous = self.ranks.new_group(rnd.number)
        self.watcher.watch(rnd)
        self.flight.start_cycle(self.store, rnd, self.me.node_id,
                                lambda: [(r.local_rank, r.rank) for r in self.group.ranks])
        self.blame.start_cycle(self.store, rnd.number, rnd.world_size, self.me.node_id, self.flight.enabled,
                               lambda: self.round_end.in_place_possible(rnd),
                               lambda: [r.rank for r in self.group.ranks])
        self.teardown.grace = self.cfg.ft.teardown_hang_grace
        self.teardown.begin_cycle(rnd.number, rnd.nnodes, lambda: self.proto.count(store_keys.done(rnd.number)))
        self._apply_timeouts(self.learner.load())
        self.learner.begin_cycle(rnd.number)
        self.progress.begin_cycle(rnd.number)   # the checkpoint iteration it starts from (agent.recovery.progress)
        self.carrier.begin_cycle()
        self._start_ranks(rnd, master, self.carrier.adopt(rnd.number, previous, self.unhandled_signal))
        self.obs.ranks_started(rnd, restarts, self.group, self.monitors)
        self.reserves.fill()
        self.injector.plan(rnd.number, rnd.world_size, rnd.rank_offset, self.cfg.nproc_per_node,
                           self.group.ranks[0].start_ns)
        verdict = None
        self.end.deferred = []   # the restart line waits for the ranks' last words
        try:
            verdict = self._supervise(rnd)
            return verdict
        finally:
            self._end_cycle(rnd, verdict)
            del worker_store

    def _say_resize(self, rnd: Round) -> None:
        """--elastic: the round trains on fewer (or again more) nodes than the previous one: one line
        on node 0 (agent.rounds.elastic)."""
        resized = self.proto.elastic_rules.resized(rnd, self.proto.get_raw)
        if resized:
            self.events.event("elastic_resize", resized[0], **resized[1])

    def _start_ranks(self, rnd: Round, master: tuple, in_place: dict) -> None:
        """This node's ranks of cycle `rnd.number` (agent.ranks.node_ranks.start_ranks), then said."""
        self.ranks.start_ranks(rnd, master, in_place, {ENV_JOB_ADDRS: ",".join(_job_hosts(rnd)),
                                                       **self.injector.rank_env(rnd.number, rnd.world_size,
                                                                                rnd.rank_offset,
                                                                                self.cfg.nproc_per_node)})
        self._ranks_started()
        for rank in self.group.ranks:   # placed on other hardware after an exit 16 (agent.recovery.rerun_exits)
            left = self.ranks.moved_from.get(rank.local_rank)
            if left:
                device = slot_device(rank.local_rank, os.environ)
                self.events.event("rank_moved", f"rank {rank.rank} re-runs on {self.me.host} device {device} "
                                  f"(slot {rank.local_rank}); it left {left}", rank=rank.rank, slot=rank.local_rank,
                                  device=device, left=left)
        self.ranks.moved_from = {}

    def _end_cycle(self, rnd: Round, verdict: Optional[Verdict]) -> None:
        """The cycle is over (`verdict`, or None when a signal or a lost store ended it): the ranks
        the verdict keeps are asked to stay and carried, the others stopped, the parts told."""
        if verdict is not None:   # else whatever raised (a signal, a lost store) has said where we go
            self.life.to(NodeState.RESTARTING if verdict.restart else NodeState.STOPPING, verdict.kind)
        # first: they leave their step while we go on (agent.ranks.in_place_carrier)
        in_place = verdict is not None and verdict.in_process and rnd.group_rank is not None
        stopped_as_hung = self.blame.settle(self.monitor_set, self.group.ranks, rnd.number) if in_place else set()
        keep = self.carrier.ask(rnd, verdict, self.me.node_id, self.group, self.monitor_set, stopped_as_hung)
        self.blame.end_cycle()
        self.obs.live_news.poll(self.monitors)   # a cycle that ends at once still tells its recovery
        # a flight-recorder dump in progress ends before any rank is stopped
        self.flight.end_cycle(store_ok=not self.watcher.store_lost)
        self.obs.cycle_ended()
        if self.learner.enabled:
            try:
                self._learn(rnd)
            except RendezvousError:  # a lost store: the failover follows, the ranks stop first
                pass
            self.learner.end_of_cycle(self.monitors)
        for monitor in self.monitors:
            monitor.rank_stopped()
        self.monitor_set.mark_stopping(shm_layout.STOP_RESTART, self.cfg.workers_stop_timeout, skip=keep)
        self.group.stop(signal.SIGTERM, self.cfg.workers_stop_timeout, keep=[k[1] for k in keep.values()])
        if self.cfg.ft.check_remaining_processes:   # NVRx 0.7's key: name what outlived its rank's stop
            left = self.group.leftovers(keep=[k[1] for k in keep.values()])
            self.events.event("remaining_processes", "warning: check_remaining_processes: " + "; ".join(
                f"pid {p['pid']} ({p['name']}, state {p['state']}, group {p['pgid']}): {p['cmdline']}"
                for p in left[:20]) if left else None, processes=left[:20], count=len(left))
        self.end.say_deferred()   # after the stopped ranks' output (their tracebacks)
        self.carrier.carry(keep)
        kept = {id(k[1]) for k in keep.values()}   # alive: their GPU memory stays theirs
        self.health.dead_pids = [r.pid for r in self.group.ranks if id(r) not in kept]
        self.watcher.watch(None)

    def _supervise(self, rnd: Round) -> Verdict:
        """Watch the cycle (agent.recovery.supervisor) until it ends; the verdict."""
        sup = Supervisor(rnd, self.group, self.monitor_set, self.watcher, self.carrier, self.blame, self.events,
                         self._node_words(rnd), self.me.node_id, self.wake_r, self.teardown)
        try:
            while True:
                for local_rank, report in sup.wait(self._wait_time()):
                    self._on_report(local_rank, report)
                self.injector.inject_due(self.group.ranks, time.monotonic_ns())
                self._observe(rnd)
                outcome = sup.outcome()
                if isinstance(outcome, Failure):
                    return self.end.failed(rnd, outcome)
                if isinstance(outcome, Interrupted):
                    verdict = self.end.interrupted(rnd)
                    if verdict.kind == "shutdown":   # another node's signal: the signal path raises Shutdown
                        self.peer_shut_down(rnd, verdict)
                    return verdict
                if isinstance(outcome, Finished):
                    self._ranks_finished(rnd)
        finally:
            sup.close()

    def _wait_time(self) -> float:
        """How long the supervisor may wait for news: until the next planned fault, the next look at a
        hang's evidence, the next status sample, or monitor_interval."""
        due = self.injector.seconds_until_due(time.monotonic_ns())
        wait = self.cfg.monitor_interval if due is None else min(due, self.cfg.monitor_interval)
        if self.blame.pending:   # a hang verdict is awaited: look at the evidence often
            wait = min(wait, BLAME_POLL)
        return min(wait, self.status.poll_interval() or wait)

    def _observe(self, rnd: Round) -> None:
        """What the agent does on every pass while ranks run, besides looking for the cycle's end."""
        self.blame.tick(self.monitors, self.group.ranks)
        self.teardown.tick(self.group.ranks, self.monitors)   # a rank left hanging once the work is done
        self.obs.poll(self.monitors)
        self.check_signal(rnd)
        self.monitor_set.check_ticks()
        self.reserves.maintain()
        if self.learner.due():
            self._learn(rnd)
        self.progress.poll(self.proto, rnd.number, self.monitors)
        self.obs.stragglers.tick(self.proto, rnd, self.group.ranks, self.monitors)

    def _ranks_finished(self, rnd: Round) -> None:
        """Every rank of this node ended 0: the job completes when every node's have."""
        if self.learner.enabled:
            self.learner.publish(self.proto, self.monitors)
        if self.proto.mark_done(rnd.number) >= rnd.nnodes:
            self.round_end.interrupt(rnd.number, {"kind": "complete"})
        else:
            self.say("all local ranks finished; waiting for the other nodes")

    def _ranks_started(self) -> None:
        rendezvous_mark("ranks_started")
        ranks = self.group.ranks
        if any(r.warm or r.in_place for r in ranks):
            self.say("ranks started: " + ", ".join(
                f"{r.rank} ({'in place' if r.in_place else 'warm reserve' if r.warm else 'cold'}, pid {r.pid})"
                for r in ranks))
        self.events.event("ranks_started", None, ranks=[
            {"rank": r.rank, "local_rank": r.local_rank, "pid": r.pid, "warm": r.warm, "in_place": r.in_place}
            for r in ranks])

    def _learn(self, rnd: Round) -> None:
        """Computed timeouts: publish ours; node 0 computes for the job; everyone applies."""
        self.learner.publish(self.proto, self.monitors)
        if rnd.group_rank == 0:
            self.learner.compute_as_writer(self.proto, [n.node_id for n in rnd.active], rnd.world_size)
        new = self.learner.poll(self.proto)
        if new is not None:
            self._apply_timeouts(new)

    def _apply_timeouts(self, ft) -> None:
        if ft is not self.cfg.ft:
            self.cfg.ft = ft
            for monitor in self.monitors:
                monitor.update_config(ft)

    def _warn_if_hangs_undetectable(self) -> None:
        ft = self.cfg.ft
        if not (ft.simulate_fault or ft.calc_ft_timeouts or ft.ft_state_path
                or any(v for v in ft.timeout_keys().values())):
            self.say("hang detection is off: no section or heartbeat timeout is configured; turn it on with "
                     "--ft-rank-section-timeouts setup:600,step:180 (seconds per ft.section), "
                     "--ft-rank-heartbeat-timeout SECONDS (ft.heartbeat) or --ft-calc-ft-timeouts true")
        if ft.simulate_fault and ft.simulated_fault_type in ("rank_hung", "random") and not any(
                v for v in ft.timeout_keys().values()):
            self.say("warning: simulated rank_hung faults need a section or heartbeat timeout to be "
                     "detected; none is configured, so a hung rank will stay hung")

    def _node_words(self, rnd: Round) -> str:
        return f"node {rnd.group_rank} ({self.me.host})"

    # ---- a hot spare's wait -------------------------------------------------------------------------
    def _wait_as_spare(self, rnd: Round) -> Verdict:
        self.life.to(NodeState.SPARE, f"round {rnd.number}")
        self.say(f"hot spare: {rnd.nnodes} node(s) are training; waiting to be needed")
        self.status.spare(rnd.number)
        self.events.event("spare_waiting", None, **({"active": _names(rnd)["nodes"]} if _names(rnd) else
                                                    {"nnodes": rnd.nnodes}))
        self.reserves.arm()  # so that taking over skips the cold start
        self.reserves.fill()
        self.watcher.watch(rnd)
        sel = selectors.DefaultSelector()
        sel.register(self.wake_r, selectors.EVENT_READ)
        # --elastic, the job trains on fewer than MAX nodes: this node asks it to grow, once its warm
        # reserves are ready (at most warm_reserve_timeout): the others stop only for what is left
        grow_by = self.proto.elastic_rules.grow_deadline(rnd, self.cfg.ft.warm_reserve_timeout)
        try:
            while True:
                sel.select(timeout=0.05 if grow_by else 1.0)
                try:
                    os.read(self.wake_r, 4096)
                except BlockingIOError:
                    pass
                self.check_signal(None)
                self.reserves.maintain()
                if self.watcher.store_lost:
                    raise StoreLost(self.watcher.store_lost)
                if self.watcher.interrupted_round == rnd.number:
                    return self.proto.verdict(rnd.number)
                if grow_by:
                    self.reserves.hurry()
                    if self.reserves.ready() or time.monotonic() >= grow_by:
                        if self.proto.count(store_keys.done(rnd.number)):   # the job is ending: no grow
                            grow_by = None
                        else:
                            return self.end.grow(rnd, self.proto.elastic_rules.grow_report(
                                rnd, self.me.label(), self.me.node_id), self.reserves.enabled and self.reserves.ready())
                if self.watcher.dead_peers:  # a training node died: with no other trainer left, only we notice
                    return self.end.lost_peers(rnd, self.watcher.dead_peers)
        finally:
            sel.close()
            self.watcher.watch(None)

    # ---- what the monitors report (agent.ranks.monitor_set) -------------------------------------
    def _on_report(self, local_rank: int, report: dict) -> None:
        kind = report.get("kind")
        if kind == "hang":
            self.learner.freeze(self.monitors)   # before the dump request lets any hung rank resume
            self.flight.hang(report)   # every rank of the job dumps its trace before the monitor acts
            self.blame.on_hang(local_rank, report)   # and the agents decide who hung (agent.recovery.hang_blame)
            self.monitor_set.pending.setdefault(local_rank, []).append(report)
            held = ("its monitor holds it until the agents decide who hung" if self.carrier.declared
                    else "monitor is stopping it")
            self.events.event(
                "hang", f"rank {report.get('rank')} hang detected: {failure_cause.hang_place(report)} "
                f"elapsed {report.get('elapsed', 0):.2f}s > timeout {report.get('timeout', 0):g}s "
                f"-> {held}; {failure_cause.dump_words(report)}",
                rank=report.get("rank"), **{k: v for k, v in report.items() if k != "rank"})
        elif kind == "stack_dump":  # follows its hang report once the rank has written it
            if report.get("reason") != "teardown":   # (a teardown hang's: agent.recovery.teardown_watch)
                self.blame.on_stack(report)
            self.events.event("stack_dump", None, rank=report.get("rank"), cycle=report.get("cycle"),
                              stack_file=report.get("stack_file"), stack=report.get("stack"))
        else:
            self.events.event(kind or "monitor_report", None, rank=report.get("rank"), **report)



def _names(rnd: Round) -> dict:
    """The round's nodes by label, for events, in a round small enough to read them; else {}."""
    if rnd.members > NAMED_UP_TO:
        return {}
    return {"nodes": [n.label() for n in rnd.active], "spares": [n.label() for n in rnd.spares]}


def _job_hosts(rnd: Round) -> List[str]:
    """The job's node addresses for the ranks (FT_LAUNCHER_JOB_ADDRS, rank_monitor.peer_sockets):
    every training node's in a round of at most NAMED_UP_TO nodes; past that, reading the list in
    every agent would cost the store host O(N^2): this node's, its watched peers' and the head's."""
    if rnd.members <= NAMED_UP_TO:
        return list(dict.fromkeys(n.host for n in rnd.active))
    return list(dict.fromkeys([rnd.me.host] + [n.host for n in rnd.peers + rnd.head]))


def rendezvous_mark(name: str) -> None:
    """A start-up phase's time, for bench/rendezvous_scale.py (kept only with FT_LAUNCHER_STORE_STATS)."""
    from ft_launcher.agent.rounds.rendezvous import mark

    mark(name)
