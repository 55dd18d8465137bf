"""The node agent: one per node. It keeps the node's life as a state (agent.node_state:
starting -> joining -> running or spare -> restarting -> joining ... -> stopping -> finished), the
loop over rounds and the exit codes; every other job is a named part's:

The agent holds three bundles of parts, the round's end and the parts that say what ended a cycle:
- agent.rounds.job_rounds (JobRounds): this node's side of the job's rounds: its liveness port, its
  identity, the job's store, the round protocol on it (agent.rounds.rendezvous: join, close,
  interrupt), the round watcher, and the failover to a successor store (agent.rounds.store_failover).
- agent.ranks.node_ranks (NodeRanks): this node's processes: the orphan watchdog, the ranks' output,
  the rank monitors (agent.ranks.monitor_set), the ranks (agent.ranks.workers), the warm reserves
  (agent.ranks.reserve_pool) and the ranks that restart in their own process
  (agent.ranks.in_place_carrier).
- agent.observation.observers (Observers): what the operator reads: the status file, live-recovery
  news, section use, stragglers, learned timeouts, NVRx's cycle info; agent.observation.events the
  lines and events.jsonl.
- agent.recovery.supervisor: watches a cycle and returns, typed, what ended it; agent.recovery.failure_cause says
  what a failure is, for the operator and for the verdict.
- agent.recovery.round_end (RoundEnd): the one executor from a report to the verdict: the first
  reporter of a round's end gathers the policy's inputs, runs agent.recovery.restart_policy (restart
  in place or all ranks, exclude, stop, or not at all) and publishes the verdict; Verdict.stays
  names the ranks it keeps in place.
- agent.recovery.hang_blame and agent.recovery.flight_recorder: who hung, and where.
Signals take one path (_check_signal -> _shut_down: ranks signalled, round told, Shutdown).

A killed rank's walk: its pidfd wakes the supervisor's selector -> Supervisor.outcome reaps it and
failure_cause.rank_ended says why -> the agent reports the Failure (_fail) -> RoundEnd.interrupt
-> RestartPolicy.decide, and the Verdict is written -> at the cycle's end the hang blame settles who was
stopped as hung, the carrier asks the ranks the verdict keeps (Verdict.stays) to leave their step
(rung in_process) and workers stop the rest -> restarting -> the next round:
the carrier adopts the ranks at their restart point, the dead slot gets a warm reserve
(reserve_pool.take) or a cold start (workers.start).

Exit codes: 0 all ranks succeeded; 1 the restart budget is spent, the rendezvous failed, the
job fell below its minimum, or this node was replaced as the store host; 93
(no_restart_exit_code) the job stopped for good or this node left it (agent.recovery.no_restart; a rank
that SIGKILL does not end, agent.ranks.process_wait, makes its node leave);
128+N terminated by signal N (forwarded to the ranks first).
"""
from __future__ import annotations

import glob
import hashlib
import os
import selectors
import signal
import socket
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional

from ft_launcher.agent.rounds import store_keys
from ft_launcher.rank_monitor import buddy_store, shm_layout
from ft_launcher.rank_monitor.agent_side.monitor_handle import MonitorHandle, MonitorStartError
from ft_launcher.rank_monitor.peer_sockets import ENV_JOB_ADDRS

from ft_launcher.agent.observation.events import EventLog
from ft_launcher.agent.recovery.failure_cause import Failure
from ft_launcher.agent.recovery.fault_injection import FaultInjector
from ft_launcher.agent.recovery.flight_recorder import FlightRecorder
from ft_launcher.agent.recovery.hang_blame import POLL as BLAME_POLL, HangBlame
from ft_launcher.agent.recovery.health_checks import HealthChecks
from ft_launcher.agent.recovery.no_restart import NoRestart, mark_excluded, park_store_host
from ft_launcher.agent.observation.observers import Observers
from ft_launcher.agent.node_state import NodeLife, NodeState
from ft_launcher.agent.launch_config import LaunchConfig
from ft_launcher.agent.ranks.node_ranks import NodeRanks, Unkillable
from ft_launcher.agent.recovery import failure_cause, rerun_exits
from ft_launcher.agent.ranks.gpu_env import slot_device
from ft_launcher.agent.rounds.job_rounds import JobRounds
from ft_launcher.agent.recovery.restart_policy import Verdict
from ft_launcher.agent.recovery.round_end import RoundEnd
from ft_launcher.agent.rounds.round_types import NAMED_UP_TO, RendezvousError, Round, Stopped, StoreLost, StoreReplaced
from ft_launcher.agent.recovery.supervisor import Finished, Interrupted, Supervisor
from ft_launcher.agent.recovery.teardown_watch import TeardownWatch

EXIT_OK, EXIT_FAILED = 0, 1
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Shutdown(Exception):
    def __init__(self, code: int):
        self.code = code


class NodeAgent:
    def __init__(self, cfg: LaunchConfig, events: EventLog, metrics=None):
        self.cfg = cfg
        self.events = events
        self.obs = Observers(cfg, events, metrics)   # what the operator sees (agent.observation.observers)
        self.status = self.obs.status   # the status file and the cycles' summaries
        self.learner = self.obs.learner   # computed timeouts (agent.observation.timeout_learning)
        self.say = events.say
        self.life = NodeLife(self.say)   # the node's state (agent.node_state), shown by `ft_launcher status`
        self.life.listeners.append(self.status.on_state)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._signal: Optional[int] = None
        self._signal_handled = False  # once True, waits no longer end on self._signal
        events.node = socket.gethostname()  # until the rendezvous gives this node its rank
        self._excluded: Optional[str] = None   # why this node left the job (agent.recovery.no_restart)
        # this node's processes: watchdog, output, monitors, reserves, the in-place carrier, the cycle's
        # ranks (agent.ranks.node_ranks); the carrier is given the round protocol at _run
        self.ranks = NodeRanks(cfg, events)
        # this node's side of the job's rounds: liveness port, store, round protocol, watcher, failover
        # (agent.rounds.job_rounds)
        self.rounds = JobRounds(cfg, self.say, events, self.wake, self._unhandled_signal)
        # Where stack dumps go: the log dir, else a per-agent dir in the platform's temp dir
        # (removed at the end unless a dump was written there).
        self._run_dir = cfg.log_dir or os.path.join(tempfile.gettempdir(), f"ft_launcher-{os.getpid()}")
        # Parts made once the run starts (_run), None until then: _teardown stops those that exist
        self.flight: Optional[FlightRecorder] = None
        self._deferred_restart: Optional[list] = None     # restart lines said once the cycle's ranks stopped

    # this node's processes, by part (agent.ranks.node_ranks)
    carrier = property(lambda self: self.ranks.carrier)
    watchdog = property(lambda self: self.ranks.watchdog)
    output = property(lambda self: self.ranks.output)
    monitor_set = property(lambda self: self.ranks.monitor_set)
    reserves = property(lambda self: self.ranks.reserves)
    group = property(lambda self: self.ranks.group)
    # the job's rounds, by part (agent.rounds.job_rounds)
    store = property(lambda self: self.rounds.store)
    me = property(lambda self: self.rounds.me)
    proto = property(lambda self: self.rounds.proto)
    failover = property(lambda self: self.rounds.failover)
    watcher = property(lambda self: self.rounds.watcher)

    @property
    def monitors(self) -> list:
        """The node's monitor handles by local rank (agent.ranks.monitor_set)."""
        return self.monitor_set.handles if self.monitor_set is not None else []

    # ---- plumbing -----------------------------------------------------------------------
    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"w")
        except BlockingIOError:
            pass

    def _on_signal(self, signum, _frame) -> None:
        if self._signal is None:
            self._signal = signum
        self.wake()

    def _unhandled_signal(self) -> Optional[int]:
        """What the rendezvous waits ask between slices: a signal nobody has acted on yet."""
        return None if self._signal_handled else self._signal

    # ---- main ---------------------------------------------------------------------------
    def run(self) -> int:
        code = EXIT_FAILED
        try:
            code = self._run()
            return code
        finally:
            self.life.to(NodeState.FINISHED, f"exit code {code}")
            self.status.finish(code)

    def _run(self) -> int:
        marks = {"agent_start": time.time()}   # start-up phases (bench/rendezvous_scale.py reads them)
        self.say(self.cfg.summary())
        for sig in self.cfg.signals or FORWARDED_SIGNALS:
            signal.signal(sig, self._on_signal)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        self.ranks.open_watchdog(self._wake_w)   # an in-process restartable rank that raised wakes us through it
        marks["watchdog"] = time.time()
        # What the agent leaves on disk if it is SIGKILLed: its monitors' records, its stack-dump dir,
        # its entry in this user's runtime dir (`ft_launcher status`) and that dir once it is empty
        self.watchdog.remove_matching_at_exit(MonitorHandle.record_pattern(os.getpid()))
        if not self.cfg.log_dir:
            self.watchdog.tidy_at_exit(self._run_dir)
        self.watchdog.remove_at_exit(self.status.registry)
        self.watchdog.tidy_at_exit(os.path.dirname(self.status.registry))
        self.flight = FlightRecorder(self.cfg.log_dir, self.events, self.say, self.watchdog,  # before monitors, reserves
                                     keep_dir=self._run_dir)
        self.blame = HangBlame(self.events)
        self.teardown = TeardownWatch(self.cfg.ft.teardown_hang_grace, self.events)
        os.environ[shm_layout.ENV_HANG_VERDICT] = "1"   # our monitors hold a hung rank for the blame verdict
        pool = ThreadPoolExecutor(max_workers=max(1, self.cfg.nproc_per_node))
        self.ranks.open_monitors(self._run_dir, pool)
        marks["monitors_started"] = time.time()
        self.ranks.open_reserves()
        marks["reserves"] = time.time()
        mark = self.rounds.load()   # the store's modules, timed as a start-up phase
        marks["imports"] = time.time()
        for name, when in marks.items():
            mark(name, when)
        self.rounds.listen()   # this node's liveness port
        try:
            try:
                self.rounds.reach(self.learner)
                self.round_end = RoundEnd(self.proto, self.cfg)   # the verdicts this node decides
                self.failover.round_end = self.round_end
                self.injector = FaultInjector(self.cfg.ft, self.proto.claim_fault, self.proto.faults_fired,
                                              self.events)
                self.flight.on_request = lambda cycle: self.learner.freeze(self.monitors, cycle)
                self.flight.on_done = lambda cycle: [m.flight_done(cycle) for m in list(self.monitors)]
                self._warn_if_hangs_undetectable()
                if self.ranks.heartbeat_warning():
                    self.say(self.ranks.heartbeat_warning())
                self.carrier.proto = self.proto
                self.progress = self.round_end.progress   # one tracker: this node's polls, the policy's inputs
                self.health = HealthChecks(self.cfg.ft, self.cfg.log_dir, self.say)
                mark("store")
                self.rounds.start_watcher()
                self.monitor_set.ready()
                mark("monitors_ready")
                code = self._cycles_failing_over()
                return self._job_stopped(code) if code > 128 else code
            except StoreReplaced as exc:
                self.events.event("store_replaced", f"error: {exc}", error=str(exc))
                return EXIT_FAILED
            except StoreLost as exc:
                self.events.event("store_lost", f"error: {exc}", error=str(exc))
                return EXIT_FAILED
            except RendezvousError as exc:
                self.events.event("rendezvous_failed", f"error: {exc}", error=str(exc))
                return EXIT_FAILED
            except MonitorStartError as exc:
                self.events.event("monitor_failed", f"error: {exc}: ranks are not started unprotected",
                                  error=str(exc))
                return EXIT_FAILED
            except Stopped as exc:  # a signal while reaching the store, before any round
                return self._job_stopped(self._stopped_waiting(exc, "the rendezvous store"))
            except Shutdown as exc:
                return self._job_stopped(exc.code)
            except NoRestart as exc:
                return self._no_restart(exc.reason, exc.node_only)
            except Unkillable as exc:
                return self._unkillable(exc)
        finally:
            self._teardown(pool)

    def _teardown(self, pool) -> None:
        if self.group is not None:
            try:
                self.group.stop(signal.SIGKILL, 1.0)
            except Unkillable as exc:   # found on the way out: the exit code stands, the line is said
                self.events.event("rank_unkillable", f"error: {exc}", ranks=exc.ranks)
        self.carrier.drop(None)
        if self.reserves is not None:
            self.reserves.close()
        if self.flight is not None:
            self.flight.close()
        self.rounds.close()   # the watcher, and every store thread joined (agent.rounds.store_threads)
        if self.monitor_set is not None:
            self.monitor_set.stop_all()
        pool.shutdown(wait=True)
        # the ranks' said-once marks and their buddy copies (rank_monitor.buddy_store: host memory that
        # outlived the ranks, in the agent's own directory; the orphan watchdog removes them too if the
        # agent is killed)
        for marker in glob.glob(shm_layout.warned_prefix(os.getpid()) + "*"):
            try:
                os.unlink(marker)
            except OSError:
                pass
        buddy_store.remove_agent_dir(os.getpid())
        self.watchdog.close()
        if self.output is not None:
            self.output.flush()   # a traceback still held back goes out whole
        MonitorHandle.tidy_run_dir(self._run_dir, remove_if_empty=not self.cfg.log_dir)
        signal.set_wakeup_fd(-1)

    def _cycles_failing_over(self) -> int:
        """The cycles; when the store host is lost, again on the successor store."""
        number, target = None, None
        while True:
            try:
                return self._cycles(number, target)
            except StoreLost as exc:  # the store host is gone: move to its successor
                self.life.to(NodeState.RESTARTING, "the store host was lost")
                self.events.event("store_lost", None, error=str(exc))
                number, target = self.rounds.take_over(exc)
                self.events.event("store_failover", None, host=self.store.host, port=self.store.port,
                                  generation=self.failover.memory.generation, next_cycle=number,
                                  hosted_here=self.store.is_host)

    def _cycles(self, number: Optional[int] = None, target: Optional[int] = None) -> int:
        number = self.proto.current_round() if number is None else number
        while True:
            self._check_signal(None)
            unhealthy = self.health.run()
            rendezvous_mark("health_checks")
            if unhealthy:
                self._leave_job(f"health check failed on this node: {unhealthy}")
            self.life.to(NodeState.JOINING, f"round {number}")
            try:
                rnd = self.proto.join(number, target)
            except Stopped as exc:
                return self._stopped_waiting(exc, f"the other nodes (rendezvous round {number})")
            self.failover.remember(rnd)
            self.events.cycle = number
            try:
                if rnd.group_rank is None:
                    self.carrier.drop("this node waits as a hot spare in the new round")
                    verdict = self._wait_as_spare(rnd)
                else:
                    self.events.node = rnd.group_rank
                    verdict = self._run_round(rnd)
            except Stopped:  # a signal during one of the round's store waits
                self._check_signal(rnd)  # tells the other nodes, stops the ranks, raises Shutdown
                raise
            except (StoreLost, StoreReplaced):
                raise
            except RendezvousError:   # the round ends without a verdict (one that never came): a store
                self._leave(rnd)      # host stays up until the others have ended theirs the same way
                raise
            self.life.to(NodeState.RESTARTING if verdict.restart else NodeState.STOPPING, verdict.kind)
            if not verdict.restart:
                self._leave(rnd)
            if verdict.kind == "complete":
                return EXIT_OK
            if verdict.kind == "shutdown":
                return 128 + int(verdict.signal or signal.SIGTERM)
            if verdict.kind == "stop":
                return self._no_restart(verdict.what or "the job was stopped")
            if not verdict.restart:
                used = min(verdict.restarts_used, self.cfg.max_restarts)
                self.flight.settle()
                self.events.event(
                    "job_failed",
                    f"error: {verdict.what or 'a failure'} in cycle {number}; restart budget spent "
                    f"({used}/{self.cfg.max_restarts} restarts used) -> exiting 1",
                    **dict(verdict.event_fields(), restarts_used=used))
                return EXIT_FAILED
            if self._excluded or self.me.node_id in verdict.exclude:
                slow = store_keys.slow(self.me.node_id)
                self._leave_job(self._excluded or (f"excluded as a straggler: {self.proto.get(slow)}"
                                                   if self.proto.exists(slow) else verdict.what))
            # a rank's exit 16: this node's ranks change slots, the next cycle's ranks are told (agent.ranks.node_ranks)
            self.ranks.apply_rerun(verdict.rerun, self.me.node_id, self.me.host, rnd.group_rank is not None)
            target = None   # the next round's target: in the store, with the verdict (RoundEnd.interrupt)
            number = verdict.next_round

    def _check_signal(self, rnd: Optional[Round]) -> None:
        if self._signal is None:
            return
        sig = self._signal
        self._signal_handled = True
        self.status.cycle_end()  # the running cycle's summary before the job's last words
        self.events.event("signal", f"received {signal.Signals(sig).name}: forwarding to the ranks "
                          f"(SIGKILL after {self.cfg.term_timeout:g}s) and stopping the job", signal=sig)
        if rnd is not None:
            try:
                self.round_end.interrupt(rnd.number, {"kind": "shutdown", "signal": sig, "node_id": self.me.node_id})
            except RendezvousError:
                pass
        self._shut_down(rnd, sig)

    def _shut_down(self, rnd: Optional[Round], sig: int) -> None:
        """The job ends by signal `sig`: tell the ranks why, stop them (SIGKILL after
        term_timeout), leave the round, raise Shutdown(128 + sig)."""
        self.life.to(NodeState.STOPPING, f"signal {sig}")
        if self.group is not None:
            self.monitor_set.mark_stopping(shm_layout.STOP_SHUTDOWN, self.cfg.term_timeout)
            self.group.stop(sig, self.cfg.term_timeout)
        if rnd is not None:
            self._leave(rnd)
        raise Shutdown(128 + sig)

    def _stopped_waiting(self, exc: Stopped, what: str) -> int:
        """A signal (ours or, during a join, another node's) ended a wait: the exit code."""
        self._signal_handled = True
        self.life.to(NodeState.STOPPING, f"signal {exc.signum} while waiting")
        name = signal.Signals(exc.signum).name
        if exc.by_peer:
            self._signal = self._signal or exc.signum
            self.say(f"another node is shutting down the job ({name}) while waiting for {what}")
        else:
            self.events.event("signal", f"received {name} while waiting for {what}: stopping",
                              signal=exc.signum)
        return 128 + exc.signum

    def _job_stopped(self, code: int) -> int:
        """The last word of a job a signal ended."""
        sig = code - 128
        name = signal.Signals(sig).name if sig in signal.valid_signals() else f"signal {sig}"
        self.events.event("job_stopped", f"job stopped by {name} -> exiting {code}", signal=sig, exitcode=code)
        return code

    # ---- stopping for good, leaving the job (agent.recovery.no_restart) -----------------------------
    def _no_restart(self, reason: str, node_only: bool = False) -> int:
        code = self.cfg.ft.no_restart_exit_code
        self.life.to(NodeState.STOPPING, reason)
        if self.flight is not None:
            self.flight.settle()
        if node_only:
            self.events.event("node_left", f"error: this node leaves the job: {reason} -> exiting {code} "
                              f"(no restart)", reason=reason, exitcode=code)
        else:
            self.events.event("job_stopped_no_restart", f"error: {reason} -> the job stops without a restart: "
                              f"exiting {code}", reason=reason, exitcode=code)
        return code

    def _unkillable(self, exc: Unkillable) -> int:
        """A rank SIGKILL did not end (agent.ranks.process_wait): this node leaves the job (exit
        no_restart_exit_code), unless a signal is already ending it (then its code stands)."""
        self.life.to(NodeState.STOPPING, "a rank SIGKILL does not end")
        self.events.event("rank_unkillable", None, ranks=exc.ranks)
        if self._signal_handled and self._signal:
            self.say(f"error: {exc}")
            return self._job_stopped(128 + self._signal)
        try:
            self._leave_job(str(exc))
        except NoRestart as left:
            return self._no_restart(left.reason, node_only=True)
        except RendezvousError:   # the store is gone too: leave all the same
            pass
        return self._no_restart(str(exc), node_only=True)

    def _leave_job(self, reason: str) -> None:
        """This node leaves the job (ExcludeThisNode, a failed health check): mark it, keep the store
        up if it lives here, then end with the no-restart code."""
        left = mark_excluded(self.proto, self.me.node_id)
        short = self.round_end.policy.too_few_left(left)   # the policy says whether the job goes on without it
        if short and self.cfg.max_nodes > 1:   # (a one-node job obviously stops)
            reason += f"; {short}: the job stops"
        self._excluded = reason
        self.life.to(NodeState.STOPPING, reason)
        if self.store.is_host and self.cfg.max_nodes > 1:
            self.say("this node hosts the rendezvous store: it leaves training but keeps serving the store "
                     "until the other nodes are done")
            park_store_host(self.proto, self.store, self.me.node_id,
                            self.cfg.conf("keep_alive_interval") * self.cfg.conf("keep_alive_max_attempt"),
                            self._unhandled_signal, self.cfg.conf("join_timeout"))
        raise NoRestart(reason, node_only=True)

    # ---- one round ----------------------------------------------------------------------
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
        self._start_ranks(rnd, master, self.carrier.adopt(rnd.number, previous, self._unhandled_signal))
        self.obs.ranks_started(rnd, restarts, self.group, self.monitors)
        self.reserves.fill()
        self.injector.plan(rnd.number, rnd.world_size, rnd.rank_offset, self.cfg.nproc_per_node,
                           self.group.ranks[0].start_ns)
        verdict = None
        self._deferred_restart = []   # the restart line waits for the ranks' last words
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
        deferred, self._deferred_restart = self._deferred_restart, None
        for args, fields in deferred or []:   # after the stopped ranks' output (their tracebacks)
            self.events.event(*args, **fields)
        self.carrier.carry(keep)
        kept = {id(k[1]) for k in keep.values()}   # alive: their GPU memory stays theirs
        self.health.dead_pids = [r.pid for r in self.group.ranks if id(r) not in kept]
        self.watcher.watch(None)

    def _supervise(self, rnd: Round) -> Verdict:
        """Watch the cycle (agent.recovery.supervisor) until it ends; the verdict."""
        sup = Supervisor(rnd, self.group, self.monitor_set, self.watcher, self.carrier, self.blame, self.events,
                         self._node_words(rnd), self.me.node_id, self._wake_r, self.teardown)
        try:
            while True:
                for local_rank, report in sup.wait(self._wait_time()):
                    self._on_report(local_rank, report)
                self.injector.inject_due(self.group.ranks, time.monotonic_ns())
                self._observe(rnd)
                outcome = sup.outcome()
                if isinstance(outcome, Failure):
                    return self._fail(rnd, outcome)
                if isinstance(outcome, Interrupted):
                    return self._interrupted(rnd)
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
        self._check_signal(rnd)
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

    def _fail(self, rnd: Round, failure: Failure) -> Verdict:
        """Report what this node saw end the cycle (agent.recovery.supervisor) to the round; the verdict,
        whoever decided it (agent.recovery.restart_policy)."""
        reason = dict(failure.report, node_id=self.me.node_id)
        self.learner.freeze(self.monitors)   # what the ranks do from now on is no observation
        self.progress.poll(self.proto, rnd.number, self.monitors)   # this node's last steps count too
        if failure.cause == "rank_request":
            return self._rank_request(rnd, reason)
        early = self._early_exits()
        if early:  # a rank that left early is the likely cause: its peers waited for it
            reason["what"] += (f", after rank{'s' if len(early) > 1 else ''} {', '.join(map(str, early))} "
                               f"exited 0 early and left its peers waiting")
            reason["early_exits"] = early
        slot = reason.pop("slot", None)
        if slot is not None:   # a rank's exit 16 or 17: where it ran (agent.recovery.rerun_exits)
            reason["hardware"] = self.ranks.hardware(slot, self.me.node_id, self.me.host)
        error = self.output.error(rnd.number, reason["rank"]) if reason.get("rank") is not None else None
        if error:   # its traceback: the same one again before any progress stops the job (restart_policy)
            reason["error"] = {"signature": hashlib.sha1(error[0].encode()).hexdigest()[:16], "exception": error[1]}
        verdict = self.round_end.interrupt(rnd.number, reason, rnd=rnd)
        ours = verdict.detail.get("reporter") == self.proto.token   # decided from this report (agent.recovery.restart_policy)
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
        self._name_culprit(rnd.number, verdict if not ours else None, reason.get("rank"))
        return self._announce(rnd, verdict)

    def _name_culprit(self, cycle: int, theirs: Optional[Verdict], rank: Optional[int]) -> None:
        """The failure's line is out: the victims' tracebacks held back by agent.ranks.rank_output
        become one line each naming it. `theirs`: another report decided the round."""
        if theirs is not None:
            rank = theirs.rank
        if rank is not None:
            self.output.culprit(cycle, [rank], f"rank {rank}, the failure above")
        else:
            self.output.culprit(cycle, None, "the failure above" + (" (another node)" if theirs else ""))

    def _rank_request(self, rnd: Round, reason: dict) -> Verdict:
        """A rank's ShutdownWorkload or ExcludeThisNode: the policy makes it a stop, or leaves this
        node out (a stop too when fewer than the minimum can remain)."""
        if reason.get("leaving"):
            self._excluded = reason["what"]   # leaves even if another node's report won the round
            mark_excluded(self.proto, self.me.node_id)
        verdict = self.round_end.interrupt(rnd.number, reason, rnd=rnd)
        ours = verdict.detail.get("reporter") == self.proto.token
        self.events.event("workload_request", f"{verdict.what if ours else reason['what']} -> stopping all ranks",
                          rank=reason["rank"], action=reason["action"], description=reason["description"])
        return self._announce(rnd, verdict)

    def _interrupted(self, rnd: Round) -> Verdict:
        verdict = self.proto.verdict(rnd.number)
        if verdict.kind != "complete":
            self.learner.freeze(self.monitors)
        if verdict.kind == "shutdown":
            self.status.cycle_end()
            self._signal = self._signal or int(verdict.signal or signal.SIGTERM)
            self._signal_handled = True
            self.say(f"another node is shutting down the job ({signal.Signals(self._signal).name})")
            self._shut_down(rnd, self._signal)
        if verdict.kind == "complete":
            self._finish_job(rnd)
            return verdict
        if verdict.node_id != self.me.node_id:
            action = ("restarting this node's ranks in place" if verdict.in_process
                      else "stopping this node's ranks")
            self.say(f"{verdict.what} (on another node) -> {action}")
        if verdict.kind in ("failure", "stop"):
            self._name_culprit(rnd.number, verdict, None)
        return self._announce(rnd, verdict)

    def _early_exits(self) -> List[int]:
        """Ranks of this node that exited 0 in this cycle while it has not completed."""
        group = self.group
        if group is None or self.events.cycle != group.cycle:
            return []
        return [r.rank for r in group.ranks if r.exitcode == 0]

    def _announce(self, rnd: Round, verdict: Verdict) -> Verdict:
        if verdict.kind == "failure":
            for rank in self._early_exits():
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
            if self._deferred_restart is not None:   # said once this cycle's ranks are stopped
                self._deferred_restart.append((args, fields))
            else:
                self.events.event(*args, **fields)
        return verdict

    def _finish_job(self, rnd: Round) -> None:
        if self.learner.enabled and rnd.group_rank == 0:  # every node published before it was done
            self.learner.compute_as_writer(self.proto, [n.node_id for n in rnd.active], rnd.world_size)
        self.status.cycle_end()  # the last cycle's summary before the job's last word
        self.flight.settle()  # a hang's analysis (an earlier cycle) is told before the job's end
        self.events.event("job_complete", "all ranks on all nodes finished: job complete")
        self.injector.not_injected(time.monotonic_ns())   # planned on this node, but the job was faster

    def _leave(self, rnd: Round) -> None:
        """The job is over: say so, and if this agent hosts the store, keep it up (bounded)
        until every node has read the verdict, so none mistakes the end for a lost store."""
        try:
            self.proto.mark_left(rnd.number)
            everyone = rnd.members + (1 if rnd.late else 0)
            self.store.linger(lambda: self.proto.left_count(rnd.number) >= everyone, 10,
                              stop=lambda: self._signal is not None, grace=1.0)   # a signal: within a second
        except RendezvousError:
            pass

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
        sel.register(self._wake_r, selectors.EVENT_READ)
        # --elastic, the job trains on fewer than MAX nodes: this node asks it to grow, once its warm
        # reserves are ready (at most warm_reserve_timeout): the others stop only for what is left
        grow_by = self.proto.elastic_rules.grow_deadline(rnd, self.cfg.ft.warm_reserve_timeout)
        try:
            while True:
                sel.select(timeout=0.05 if grow_by else 1.0)
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
                self._check_signal(None)
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
                            return self._ask_to_grow(rnd)
                if self.watcher.dead_peers:  # a training node died: with no other trainer left, only we notice
                    reason = dict(failure_cause.peers_lost(self.watcher.dead_peers).report, node_id=self.me.node_id)
                    self.events.event("failure", f"{reason['what']} -> the hot spare asks for a new round",
                                      what=reason["what"])
                    verdict = self.round_end.interrupt(rnd.number, reason, rnd=rnd)
                    return self._announce(rnd, verdict)
        finally:
            sel.close()
            self.watcher.watch(None)

    def _ask_to_grow(self, rnd: Round) -> Verdict:
        """--elastic: this node joined while the job trains on fewer than MAX nodes: it interrupts the
        round (kind `grow`); the verdict re-forms the job with it, the healthy ranks kept in place."""
        report = self.proto.elastic_rules.grow_report(rnd, self.me.label(), self.me.node_id)
        self.events.event("elastic_join", f"{report['what']} -> asking the job to re-form with it", what=report["what"],
                          nnodes=rnd.nnodes, warm=self.reserves.enabled and self.reserves.ready())
        verdict = self.round_end.interrupt(rnd.number, report, rnd=rnd)
        return self._announce(rnd, verdict)

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
