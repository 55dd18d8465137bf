"""The node agent: one per node. It keeps the node's life as a state (agent.node_state:
starting -> joining -> running or spare -> restarting -> joining ... -> stopping -> finished), the
loop over rounds, the signal path and the exit codes; every other job is a named part's:

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
- agent.recovery.node_cycle (NodeCycle): one cycle of this node, trained or waited through as a hot
  spare, with the recovery parts a cycle needs (the supervisor that says what ended it, the hang
  blame, the flight recorder, the teardown watch, simulated faults, health checks, the round's end:
  agent.recovery.round_end, which runs agent.recovery.restart_policy).
- agent.recovery.cycle_end (CycleEnd): what ended the cycle goes in, the verdict is reported or
  read, and a typed next step comes out: Restart (Resize under --elastic), Finish, ShutDown, Stop,
  Leave or Failed. The loop (_cycles) only switches on it.
Signals take one path (_check_signal -> _shut_down: ranks signalled, round told, Shutdown); another
node's signal comes back as a verdict (_peer_shut_down).

A killed rank's walk: its pidfd wakes the supervisor's selector -> Supervisor.outcome reaps it and
failure_cause.rank_ended says why -> the cycle reports the Failure (CycleEnd.failed) -> RoundEnd.interrupt
-> RestartPolicy.decide, and the Verdict is written -> at the cycle's end the hang blame settles who was
stopped as hung, the carrier asks the ranks the verdict keeps (Verdict.stays) to leave their step
(rung in_process) and workers stop the rest -> the step (Restart) -> restarting -> the next round:
the carrier adopts the ranks at their restart point, the dead slot gets a warm reserve
(reserve_pool.take) or a cold start (workers.start).

Exit codes: 0 all ranks succeeded; 1 the restart budget is spent, the rendezvous failed, the
job fell below its minimum, or this node was replaced as the store host; 93
(no_restart_exit_code) the job stopped for good or this node left it (agent.recovery.no_restart; a rank
that SIGKILL does not end, agent.ranks.process_wait, makes its node leave);
128+N terminated by signal N (forwarded to the ranks first).
"""
from __future__ import annotations

import os
import signal
import socket
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from ft_launcher.agent.launch_config import LaunchConfig
from ft_launcher.agent.node_state import NodeLife, NodeState
from ft_launcher.agent.observation.events import EventLog
from ft_launcher.agent.observation.observers import Observers
from ft_launcher.agent.ranks.node_ranks import NodeRanks, Unkillable
from ft_launcher.agent.recovery.cycle_end import Failed, Finish, Leave, ShutDown, Stop
from ft_launcher.agent.recovery.no_restart import NoRestart, mark_excluded, park_store_host
from ft_launcher.agent.recovery.node_cycle import NodeCycle
from ft_launcher.agent.rounds.job_rounds import JobRounds
from ft_launcher.agent.rounds.round_types import RendezvousError, Round, Stopped, StoreLost, StoreReplaced
from ft_launcher.rank_monitor.agent_side.monitor_handle import MonitorHandle, MonitorStartError

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
        # this node's processes: watchdog, output, monitors, reserves, the in-place carrier, the cycle's
        # ranks (agent.ranks.node_ranks); the carrier is given the round protocol at _run
        self.ranks = NodeRanks(cfg, events)
        # this node's side of the job's rounds: liveness port, store, round protocol, watcher, failover
        # (agent.rounds.job_rounds)
        self.rounds = JobRounds(cfg, self.say, events, self.wake, self._unhandled_signal)
        # Where stack dumps go: the log dir, else a per-agent dir in the platform's temp dir
        # (removed at the end unless a dump was written there).
        self._run_dir = cfg.log_dir or os.path.join(tempfile.gettempdir(), f"ft_launcher-{os.getpid()}")
        # the cycles' recovery parts and their run (agent.recovery.node_cycle), made once the run starts
        # (_run), None until then: _teardown stops them if they exist
        self.cycle: Optional[NodeCycle] = None

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
        self.cycle = NodeCycle(self.cfg, self.events, self.life, self.obs, self.rounds, self.ranks,  # before monitors,
                               self._run_dir, self._wake_r, self._check_signal, self._peer_shut_down,  # reserves
                               self._unhandled_signal)
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
                self.cycle.reach()   # the round's end, simulated faults, health checks (agent.recovery.node_cycle)
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
        if self.cycle is not None:
            self.cycle.flight.close()
        self.rounds.close()   # the watcher, and every store thread joined (agent.rounds.store_threads)
        if self.monitor_set is not None:
            self.monitor_set.stop_all()
        pool.shutdown(wait=True)
        self.ranks.remove_marks(os.getpid())   # the ranks' said-once marks, their buddy copies
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
            unhealthy = self.cycle.unhealthy()
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
                verdict = self.cycle.run(rnd)   # trained, or waited through as a hot spare
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
            step = self.cycle.end.next_step(rnd, verdict)   # agent.recovery.cycle_end
            if isinstance(step, (Finish, ShutDown, Failed)):
                return step.code
            if isinstance(step, Stop):
                return self._no_restart(step.reason)
            if isinstance(step, Leave):
                self._leave_job(step.reason)   # raises NoRestart
            # Restart, Resize: a rank's exit 16: this node's ranks change slots, the next cycle's ranks
            # are told (agent.ranks.node_ranks)
            self.ranks.apply_rerun(step.verdict.rerun, self.me.node_id, self.me.host, rnd.group_rank is not None)
            target = None   # the next round's target: in the store, with the verdict (RoundEnd.interrupt)
            number = step.next_round

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
                self.cycle.round_end.interrupt(rnd.number, {"kind": "shutdown", "signal": sig,
                                                            "node_id": self.me.node_id})
            except RendezvousError:
                pass
        self._shut_down(rnd, sig)

    def _shut_down(self, rnd: Optional[Round], sig: int) -> None:
        """The job ends by signal `sig`: tell the ranks why, stop them (SIGKILL after
        term_timeout), leave the round, raise Shutdown(128 + sig)."""
        self.life.to(NodeState.STOPPING, f"signal {sig}")
        self.ranks.shut_down(sig, self.cfg.term_timeout)
        if rnd is not None:
            self._leave(rnd)
        raise Shutdown(128 + sig)

    def _peer_shut_down(self, rnd: Round, verdict) -> None:
        """Another node's signal ended the round (its verdict, kind `shutdown`): this node's ranks
        stop the same way; raises Shutdown."""
        self.status.cycle_end()
        self._signal = self._signal or int(verdict.signal or signal.SIGTERM)
        self._signal_handled = True
        self.say(f"another node is shutting down the job ({signal.Signals(self._signal).name})")
        self._shut_down(rnd, self._signal)

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
        if self.cycle is not None:
            self.cycle.flight.settle()
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
        short = self.cycle.round_end.policy.too_few_left(left)   # the policy says whether the job goes on without it
        if short and self.cfg.max_nodes > 1:   # (a one-node job obviously stops)
            reason += f"; {short}: the job stops"
        self.cycle.end.excluded = reason
        self.life.to(NodeState.STOPPING, reason)
        if self.store.is_host and self.cfg.max_nodes > 1:
            self.say("this node hosts the rendezvous store: it leaves training but keeps serving the store "
                     "until the other nodes are done")
            park_store_host(self.proto, self.store, self.me.node_id,
                            self.cfg.conf("keep_alive_interval") * self.cfg.conf("keep_alive_max_attempt"),
                            self._unhandled_signal, self.cfg.conf("join_timeout"))
        raise NoRestart(reason, node_only=True)
