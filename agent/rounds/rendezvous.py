"""Rendezvous: the job-wide TCPStore and the round protocol the agents run on it.

One agent hosts torch's `TCPStore` at the rendezvous endpoint; every agent talks to it. All keys
live under `ft/<run_id>/`. A *round* is one training cycle:

    r<R>/joined            counter; each agent's `add` gives it a join sequence number
    r<R>/node/<seq>        JSON NodeInfo of that joiner
    r<R>/closed            the number of joiners admitted (set once, by compare_set)
    r<R>/worker_store      "addr:port" of the fresh store the workers of this round use
    r<R>/interrupt         why the round ends early: a failure or a shutdown (first writer wins)
    r<R>/verdict           what the job does next (restart or stop), written by that first writer
    r<R>/done, r<R>/left   barrier counters for a round that succeeds
    restarts_used          the job-wide restart budget spent so far
    excluded, excluded/<id>  nodes that left the job (agent.recovery.no_restart): a join stops the job once
                           too few can remain
    r<R>/progress, r<R>/strag/<g>  a step completed in round R (agent.recovery.progress); node g's
                           straggler window (agent.observation.stragglers)
    alive/<node_id>        keep-alive counters (each agent watches the WATCHED_PEERS nodes after it)
    generation, took_over  which store this is (0: the first; a failover's successor: 1, 2, ...)

Ranks are assigned in infrastructure order (SLURM_PROCID / node rank / GROUP_RANK when known,
then the order agents first reached the store, kept for the job's life), never purely by who joined first. With `--nnodes MIN:MAX`,
the first MIN nodes in that order train and the others wait as hot spares for the next round.
Waits block in the store (`TCPStore.wait`), so a closed round is seen at once, not on a 1 s poll.

Every wait here is cut into slices of at most WAIT_SLICE seconds and asks the agent's `stop`
callable between slices, so a signal ends any wait (for the store host, for peers, for the
workers' store, for a verdict) within a second with `Stopped`. A signal while a round is being
joined is written to that round as a shutdown: the other joiners stop too, instead of closing a
round with a node that is gone. While it waits for peers, the agent says after 1 s, then every
PROGRESS_EVERY seconds, who joined and who is missing.

A store host that stops answering (killed, paused, cut off) is noticed by the RoundWatcher: a
store call that fails, or one that has not returned within the keep-alive limit (a paused host
never answers and torch's client then never returns). agent/rounds.store_failover.py takes it from there.

With FT_LAUNCHER_STORE_STATS=<dir> every store call is counted (calls and payload bytes per
method and per connection) and written to <dir>/<pid>.json at exit (bench/rendezvous_scale.py);
unset, the clients are torch's own objects, untouched.
"""
from __future__ import annotations

import atexit
import dataclasses
import datetime
import errno
import json
import os
import secrets
import socket
import threading
import time
from typing import Callable, Dict, List, Optional

from torch.distributed import DistNetworkError, DistStoreError, TCPStore

from ft_launcher.agent.rounds import segments, store_threads
from ft_launcher.agent.rounds.keepalive import SilenceWatch
from ft_launcher.agent.launch_config import LaunchConfig
from ft_launcher.agent.recovery.no_restart import NoRestart
from ft_launcher.agent.recovery.progress import ProgressTracker
from ft_launcher.agent.recovery.restart_policy import NODE_FAILURE_LIMIT, PolicyInputs, RestartPolicy, RoundFacts, Verdict
from ft_launcher.agent.rounds.round_types import NodeInfo, RendezvousError, Round, Stopped, StoreLost, StoreReplaced

LINGER_POLL = 0.02   # seconds between looks while a leaving store host keeps the store up
WAIT_SLICE = 0.25     # seconds: the longest a wait goes without looking for a signal
PROGRESS_EVERY = 5.0  # seconds between "still waiting for ..." lines
WATCHED_PEERS = 2     # keep-alive counters each agent watches: the next nodes in the round's order


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def is_local_address(host: str) -> bool:
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False


def _port_taken(host: str, port: int) -> bool:
    """After torch could not listen on `port`: whether something else holds it (EADDRINUSE on a
    bind of our own), told by errno, since torch's DistNetworkError carries none."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


class JobStore:
    """The job's store: hosted here or reached as a client; keys are namespaced per run id."""

    # A listener that does not answer as a TCPStore within this is foreign. A real store answers
    # in milliseconds (its server is a native thread, never held up by the host agent's Python);
    # the endpoint is only tried once something listens there.
    HANDSHAKE_LIMIT = 4.0

    def __init__(self, cfg: LaunchConfig, say: Callable[[str], None],
                 stop: Optional[Callable[[], Optional[int]]] = None):
        self.cfg = cfg
        self.say = say
        self.stop = stop  # returns the number of a signal that should end every wait, else None
        self.prefix = f"ft/{cfg.rdzv_id}/"
        self.is_host = False
        self.replaced: Optional[str] = None  # set when a successor store took the job over from us
        self.server: Optional[TCPStore] = None
        self.host, self.port = cfg.rdzv_host, cfg.rdzv_port
        timeout = _td(cfg.conf("read_timeout"))
        want_host = cfg.is_host
        if want_host is None:
            want_host = cfg.standalone or is_local_address(self.host)
        if want_host:
            try:
                self.server = TCPStore(self.host if not cfg.standalone else "127.0.0.1", self.port,
                                       is_master=True, wait_for_workers=False, timeout=timeout)
                self.port = self.server.port
                self.is_host = True
            except (DistNetworkError, RuntimeError) as exc:
                if not _port_taken(self.host if not cfg.standalone else "127.0.0.1", self.port):
                    raise RendezvousError(f"cannot host the rendezvous store on port {self.port}: "
                                          f"{str(exc).splitlines()[0]}") from None
                if cfg.is_host:
                    raise RendezvousError(
                        f"port {self.port} is already in use: cannot host the rendezvous store there "
                        f"(pick another {self._port_flag()} port)") from None
        self.client = _counted(self.server, "main") if self.is_host else _counted(self._connect(timeout), "main")

    def adopt(self, host: str, port: int, server: Optional[TCPStore], client: Optional[TCPStore] = None) -> None:
        """Use the successor store at host:port from now on (`server`: hosted by this agent)."""
        self.host, self.port = host, port
        self.server = server
        self.is_host = server is not None
        self.client = _counted(server if server is not None else client, "main")

    def _connect(self, timeout: datetime.timedelta) -> TCPStore:
        deadline = time.monotonic() + self.cfg.conf("join_timeout")
        told = False
        while True:  # wait until something listens at the endpoint
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    break
            except OSError:
                self.check_stop()
                if time.monotonic() > deadline:
                    raise RendezvousError(
                        f"no rendezvous store answered at {self.host}:{self.port} within "
                        f"join_timeout={self.cfg.conf('join_timeout'):g}s") from None
                if not told and time.monotonic() > deadline - self.cfg.conf("join_timeout") + 3:
                    self.say(f"waiting for the rendezvous host {self.host}:{self.port} to start")
                    told = True
                time.sleep(0.05)
        return self.new_client(timeout, "main")

    def new_client(self, timeout: Optional[datetime.timedelta] = None, label: Optional[str] = None) -> TCPStore:
        """A separate connection (each thread uses its own)."""
        timeout = timeout or _td(self.cfg.conf("read_timeout"))
        client = connect_client(self.host, self.port, timeout, self.HANDSHAKE_LIMIT, self.check_stop)
        if client is None:
            raise RendezvousError(
                f"port {self.port} on {self.host} is in use by another program that is not a "
                f"rendezvous store (pick another {self._port_flag()} port)")
        if isinstance(client, Exception):
            raise RendezvousError(f"cannot reach the rendezvous store at {self.host}:{self.port}: "
                                  f"{str(client).splitlines()[0]}")
        return _counted(client, label or "other")

    def key(self, name: str) -> str:
        return self.prefix + name

    def check_stop(self) -> None:
        """Raise Stopped if a signal asked this agent to stop."""
        sig = self.stop() if self.stop else None
        if sig:
            raise Stopped(sig)

    def wait_key(self, client: TCPStore, key: str, timeout: float) -> bool:
        """Wait up to `timeout` s for `key` to exist, in slices so that a signal ends the wait
        (Stopped); False when the time is up, StoreLost when the store goes away."""
        deadline = time.monotonic() + timeout
        while True:
            self.check_stop()
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                client.wait([key], _td(min(WAIT_SLICE, left)))
                return True
            except DistStoreError:
                continue
            except DistNetworkError as exc:
                raise StoreLost(f"lost the rendezvous store at {self.host}:{self.port} "
                                f"({str(exc).splitlines()[0]})") from None

    def linger(self, done: Callable[[], bool], within: float, stop: Callable[[], bool] = lambda: False,
               grace: float = 0.0, poll: float = LINGER_POLL) -> None:
        """This agent hosts the store and leaves: keep the store up until `done()` (the other
        agents have read what they need; asked every `poll` s), at most `within` s; once `stop()`
        (a signal), at most `grace` s more. Every agent that leaves while hosting the store
        lingers here."""
        if not self.is_host:
            return
        deadline = time.monotonic() + within
        while time.monotonic() < deadline and not done():
            if stop():
                deadline = min(deadline, time.monotonic() + grace)
            time.sleep(poll)

    def _port_flag(self) -> str:
        return "--master-port" if self.cfg.rdzv_backend == "static" else "--rdzv-endpoint"


def connect_client(host: str, port: int, timeout: datetime.timedelta, within: float,
                   check_stop: Optional[Callable[[], None]] = None):
    """A TCPStore client of host:port; the exception torch raised; or None when none came within
    `within` s (a listener that is not a store, a host that stopped answering). torch's connect
    is not interruptible and can block for good, so it runs in a thread of agent.rounds.store_threads;
    `check_stop` (which raises to end the wait) is asked between slices."""
    box: list = []

    def connect():
        try:
            box.append(TCPStore(host, port, is_master=False, timeout=timeout))
        except Exception as exc:  # noqa: BLE001 - the caller says it in one line or moves on
            box.append(exc)

    thread = store_threads.start(connect, "ft-store-connect")
    deadline = time.monotonic() + within
    while not box and time.monotonic() < deadline:
        if check_stop is not None:
            check_stop()
        thread.join(min(WAIT_SLICE, max(0.0, deadline - time.monotonic())))
    return box[0] if box else None


class RoundProtocol:
    """One agent's side of the round protocol (see the module docstring)."""

    def __init__(self, store: JobStore, cfg: LaunchConfig, me: NodeInfo):
        self.store = store
        self.cfg = cfg
        self.me = me
        self._last_call = cfg.conf("last_call_timeout")
        ft = cfg.ft
        self.policy = RestartPolicy(cfg.max_restarts, ft.restart_granularity, ft.straggler_exclude,
                                    (cfg.min_nodes, cfg.max_nodes), ft.max_no_progress_cycles,
                                    ft.min_progress_iterations, ft.checkpoint_iteration_file)
        # this node's progress (agent.recovery.progress): its agent polls it; when this node decides
        # a verdict, it judges the cycle and reads the history the policy counts
        self.progress = ProgressTracker(ft.max_no_progress_cycles, ft.min_progress_iterations,
                                        ft.checkpoint_iteration_file)
        self.token = secrets.token_hex(8)   # this agent, in the interrupts it writes
        if not me.stable:
            me.stable = self._call(self.s.add, self.k("agents"), 1)

    @property
    def s(self):
        """The store's client: a failover swaps the store under this protocol (JobStore.adopt)."""
        return self.store.client

    def k(self, name: str) -> str:
        return self.store.key(name)

    def _call(self, fn, *args):
        if self.store.replaced:
            raise StoreReplaced(self.store.replaced)
        try:
            return fn(*args)
        except DistNetworkError as exc:
            raise StoreLost(f"lost the rendezvous store at {self.store.host}:{self.store.port} "
                            f"({str(exc).splitlines()[0]})") from None

    # -- plain job-wide values (under the run's prefix) --------------------------------------
    def put(self, name: str, value: str) -> None:
        self._call(self.s.set, self.k(name), value)

    def get(self, name: str) -> str:
        return self._call(self.s.get, self.k(name)).decode()

    def get_many(self, names: List[str]) -> List[str]:
        return [v.decode() for v in self._call(self.s.multi_get, [self.k(n) for n in names])] if names else []

    def exists(self, name: str) -> bool:
        return bool(self._call(self.s.check, [self.k(name)]))

    def count(self, name: str, increment: int = 0) -> int:
        return int(self._call(self.s.add, self.k(name), increment))

    def current_round(self) -> int:
        value = self._call(self.s.compare_set, self.k("round"), "", "0")
        return int(value)

    def join(self, number: int, expected: Optional[List[NodeInfo]] = None) -> Round:
        """Join round `number`; returns once it is closed. `expected`: the nodes of the previous
        round, so a restart round closes as soon as every one of them that is still alive
        (its keep-alive still ticking) is back, instead of waiting out last_call_timeout."""
        me = dataclasses.replace(self.me)
        me.seq = self._call(self.s.add, self.k(f"r{number}/joined"), 1)
        self._call(self.s.set, self.k(f"r{number}/node/{me.seq}"), json.dumps(dataclasses.asdict(me)))
        closed_key = self.k(f"r{number}/closed")
        start = time.monotonic()
        next_progress = start + 1.0  # the first line soon, then every PROGRESS_EVERY s
        min_since = None
        join_timeout = self.cfg.conf("join_timeout")
        liveness = _Liveness(self, expected or [])
        while not self._call(self.s.check, [closed_key]):
            self._check_join_stop(number)
            joined = self._call(self.s.add, self.k(f"r{number}/joined"), 0)
            now = time.monotonic()
            if now >= next_progress:
                next_progress = now + PROGRESS_EVERY
                self.store.say(self._join_progress(number, joined, expected, now - start))
            enough = joined >= self.training_nodes and self._whole_segments(number, joined)
            if enough and min_since is None:
                min_since = now
            full = joined >= self.cfg.max_nodes
            if full and not enough:
                raise RendezvousError(f"rendezvous round {number}: segment {self.cfg.ft.segment}: "
                                      + segments.shortfall(self._nodes(number, joined), self.training_nodes,
                                                           self.cfg.ft.segment))
            everyone_back = enough and expected is not None and joined >= max(
                liveness.alive_count(number, joined, now), self.training_nodes)
            last_call_over = min_since is not None and now - min_since >= self._last_call
            if full or everyone_back or last_call_over:
                self._call(self.s.compare_set, closed_key, "", str(joined))
                break
            if now - start > join_timeout:
                nodes = self._nodes(number, joined)
                raise RendezvousError(
                    f"rendezvous round {number} timed out after {join_timeout:g}s: "
                    f"{joined} of {self.cfg.min_nodes} needed nodes joined "
                    f"({', '.join(n.label() for n in nodes)}); "
                    f"{self.cfg.min_nodes - joined} missing")
            try:
                self.s.wait([closed_key], _td(WAIT_SLICE))  # returns the moment the round closes
            except DistStoreError:
                pass
            except DistNetworkError:
                self._call(self.s.check, [closed_key])  # raises StoreLost
        admitted = int(self._call(self.s.get, closed_key))
        nodes = self._nodes(number, admitted)
        nodes.sort(key=lambda n: (n.order_key is None, n.order_key or 0, n.stable))
        train = self.training_nodes
        active, spares = nodes[:train], nodes[train:]
        if self.cfg.ft.segment:   # whole NVLink-domain segments train (agent.rounds.segments)
            chosen = segments.split(nodes, train, self.cfg.ft.segment)
            if chosen is None:
                raise RendezvousError(f"rendezvous round {number}: segment {self.cfg.ft.segment}: "
                                      + segments.shortfall(nodes, train, self.cfg.ft.segment))
            active, spares = chosen
        if me.seq > admitted:  # joined after the round closed: wait for the next one
            return Round(number, me, active, spares + [me])
        return Round(number, me, active, spares)

    def _whole_segments(self, number: int, joined: int) -> bool:
        """With `segment`: do the nodes that joined hold enough whole segments to train?"""
        if not self.cfg.ft.segment:
            return True
        return segments.split(self._nodes(number, joined), self.training_nodes, self.cfg.ft.segment) is not None

    @property
    def training_nodes(self) -> int:
        """How many nodes train in a round (the first in order); the others wait as hot spares.
        `--nnodes MIN:MAX`: MIN; with active_world_size: that many ranks' worth of nodes, the rest
        of the job's nodes being warm reserve nodes."""
        return min(self.cfg.active_nodes, self.cfg.min_nodes) if self.cfg.active_nodes else self.cfg.min_nodes

    def _check_join_stop(self, number: int) -> None:
        """Stopped if this agent got a signal (then the round is told) or another joiner did."""
        sig = self.store.stop() if self.store.stop else None
        if sig:
            self.abandon(number, sig)
            raise Stopped(sig)
        short = self.policy.too_few_left(self.count("excluded"))
        if short:
            raise NoRestart(f"the job cannot go on: {short}")
        if self._call(self.s.check, [self.k(f"r{number}/interrupt")]):
            verdict = self.verdict(number)
            if verdict.kind == "shutdown":
                self.mark_left(number)
                raise Stopped(int(verdict.signal or 15), by_peer=True)

    def abandon(self, number: int, sig: int) -> None:
        """Stop joining round `number`: record a shutdown there so that the other joiners stop
        too; if this agent hosts the store, keep it up (at most 1 s) until they have read it."""
        reason = {"kind": "shutdown", "signal": sig, "node_id": self.me.node_id}
        text = json.dumps(dict(reason, reporter=self.token), sort_keys=True)
        try:
            if self._call(self.s.compare_set, self.k(f"r{number}/interrupt"), "", text).decode() == text:
                verdict = self.policy.decide(reason, RoundFacts(number, [], [], {}), PolicyInputs())
                self._call(self.s.set, self.k(f"r{number}/verdict"), verdict.to_json())
            self.mark_left(number)
            self.store.linger(lambda: self.left_count(number) >= self.count(f"r{number}/joined"), 1.0)
        except RendezvousError:
            pass

    def _join_progress(self, number: int, joined: int, expected: Optional[List[NodeInfo]],
                       waited: float) -> str:
        """One line: who joined round `number`, who is missing, how long it has waited."""
        nodes = self._nodes(number, joined)
        need = self.cfg.min_nodes
        missing = ""
        if expected:
            ids = {n.node_id for n in nodes}
            gone = [n.label() for n in expected if n.node_id not in ids]
            missing = f"; missing: {', '.join(gone)}" if gone else ""
        elif nodes and all(n.order_key is not None for n in nodes):
            have = {n.order_key for n in nodes}
            absent = [str(i) for i in range(need) if i not in have]
            missing = f"; missing: node rank {', '.join(absent)}" if absent else ""
        if not missing and joined < need:
            missing = f"; {need - joined} more needed"
        return (f"rendezvous round {number}: waiting for nodes: {joined} of {need} joined "
                f"({', '.join(n.label() for n in nodes)}){missing} "
                f"[{waited:.0f}s of join_timeout {self.cfg.conf('join_timeout'):g}s]")

    def _nodes(self, number: int, count: int) -> List[NodeInfo]:
        if count <= 0:
            return []
        raw = self._call(self.s.multi_get, [self.k(f"r{number}/node/{i}") for i in range(1, count + 1)])
        return [NodeInfo(**json.loads(value)) for value in raw]

    # -- the workers' store address --------------------------------------------------------
    def publish_worker_store(self, number: int, addr: str, port: int) -> None:
        self._call(self.s.set, self.k(f"r{number}/worker_store"), f"{addr}:{port}")

    def worker_store(self, number: int) -> tuple:
        key = self.k(f"r{number}/worker_store")
        if not self.store.wait_key(self.s, key, self.cfg.conf("read_timeout")):
            raise RendezvousError(f"round {number}: node 0 never published the workers' store")
        host, _, port = self._call(self.s.get, key).decode().rpartition(":")
        return host, int(port)

    # -- ending a round ----------------------------------------------------------------------
    def interrupt(self, number: int, reason: dict, facts: Optional[RoundFacts] = None) -> Verdict:
        """Report a failure, shutdown, stop or completion of round `number`. The first reporter's
        policy decides the verdict (agent.recovery.restart_policy); returns it, whoever decided it."""
        # The reporter's token makes the text unique: two agents with the same report (the same
        # silent peer) must not both think they won.
        text = json.dumps(dict(reason, reporter=self.token), sort_keys=True)
        winner = self._call(self.s.compare_set, self.k(f"r{number}/interrupt"), "", text)
        if winner.decode() == text:
            facts = facts or RoundFacts(number, [], [], {})
            report = dict(reason, reporter=self.token)
            inputs = self.policy_inputs(report, facts)
            verdict = self.policy.decide(report, facts, inputs)
            if verdict.restarts_used > inputs.restarts_used:   # the budget this restart spends
                self.count("restarts_used", verdict.restarts_used - inputs.restarts_used)
            if verdict.origin is not None:
                self.put(f"r{number}/origin", json.dumps(verdict.origin))
            self._call(self.s.set, self.k(f"r{number}/verdict"), verdict.to_json())
            if verdict.restart:
                self._call(self.s.set, self.k("round"), str(number + 1))
        return self.verdict(number)

    def policy_inputs(self, report: dict, facts: RoundFacts) -> PolicyInputs:
        """What the restart policy decides a failure of round `facts.number` from (the store's
        side of it; agent.recovery.restart_policy.PolicyInputs). Other reports need none."""
        if report.get("kind") != "failure":
            return PolicyInputs()
        number = facts.number
        self.progress.judge(self, number)   # checkpoint_iteration_file: this cycle's progress, by the file
        origins = {}
        for k in range(number - 1, max(-1, number - NODE_FAILURE_LIMIT), -1):
            if self.exists(f"r{k}/origin"):
                origins[k] = json.loads(self.get(f"r{k}/origin"))
        slow = ([n for n in facts.active if self.exists(f"slow/{n}")]
                if self.policy.straggler_exclude and facts.spares else [])
        return PolicyInputs(restarts_used=self.count("restarts_used"), excluded=self.count("excluded"),
                            restartable=self.count(f"r{number}/restartable"),
                            progress=self.progress.history(self, number), origins=origins, slow=slow,
                            last_iteration=self.progress.last)

    def declare_restartable(self, number: int) -> None:
        """This node's ranks all run under ft.restartable in round `number` (once per node)."""
        self.count(f"r{number}/restartable", 1)

    def in_place_possible(self, facts: RoundFacts) -> bool:
        """Would a failure of round `facts.number` restart in place now (agent.recovery.hang_blame asks)?"""
        return self.policy.in_place_possible(facts, self.count(f"r{facts.number}/restartable"))

    def verdict(self, number: int) -> Verdict:
        """The verdict of interrupted round `number`. Its decider writes it just after winning
        the interrupt; if that node dies in between, the wait ends after close_timeout with one
        line naming it (RendezvousError: exit 1)."""
        key = self.k(f"r{number}/verdict")
        timeout = self.cfg.conf("close_timeout")
        if not self.store.wait_key(self.s, key, timeout):
            try:
                who = json.loads(self.get(f"r{number}/interrupt")).get("node_id") or "another node"
            except (RendezvousError, ValueError, AttributeError):
                who = "another node"
            raise RendezvousError(
                f"round {number} was interrupted by {who}, but its verdict did not come within "
                f"close_timeout={timeout:g}s (the deciding node died before writing it?) -> exiting 1")
        return Verdict.from_json(self._call(self.s.get, key))

    def interrupted(self, number: int) -> bool:
        return bool(self._call(self.s.check, [self.k(f"r{number}/interrupt")]))

    def claim_fault(self) -> int:
        """Count one more simulated fault for the job; returns the new total."""
        return self.count("faults_fired", 1)

    def faults_fired(self) -> int:
        return self.count("faults_fired")

    def restarts_used(self) -> int:
        return self.count("restarts_used")

    def mark_done(self, number: int) -> int:
        return self.count(f"r{number}/done", 1)

    def mark_left(self, number: int) -> int:
        return self.count(f"r{number}/left", 1)

    def left_count(self, number: int) -> int:
        return self.count(f"r{number}/left")


class _Liveness:
    """Which of the previous round's nodes still tick their keep-alive counters."""

    def __init__(self, proto: "RoundProtocol", expected: List[NodeInfo]):
        self.proto = proto
        self.expected = {n.node_id: n for n in expected}
        self.silence = SilenceWatch(proto.cfg.conf("keep_alive_interval") * proto.cfg.conf("keep_alive_max_attempt"))
        self.next_check = 0.0
        self.count = len(expected)

    def alive_count(self, number: int, joined: int, now: float) -> int:
        if not self.expected or now < self.next_check:
            return self.count
        self.next_check = now + 0.25
        joined_ids = {n.node_id for n in self.proto._nodes(number, joined)}
        missing = [i for i in self.expected if i not in joined_ids]
        counts = self.proto._call(present_values, self.proto.s, [self.proto.k(f"alive/{i}") for i in missing])
        dead = sum(self.silence.silent(node_id, count, now) for node_id, count in zip(missing, counts))
        self.count = len(self.expected) - dead
        return self.count


class RoundWatcher(threading.Thread):
    """Background thread with its own store connection: wakes the agent the moment the round
    is interrupted, keeps this node's keep-alive counter ticking, and reports peers whose
    counters stop (a node that died without a word).

    It also notices a lost store host: a call that fails, or one still not back after the
    keep-alive limit (a paused host never answers). On the store host it fences itself: when
    the peers it knows (`fence_members`) fall silent, `fence()` looks for a successor store that
    took the job over while this host was unreachable; if there is one, `store.replaced` is set."""

    def __init__(self, store: JobStore, cfg: LaunchConfig, me: NodeInfo, wake: Callable[[], None],
                 fence: Optional[Callable[[], Optional[str]]] = None,
                 on_late_joiner: Optional[Callable[[NodeInfo], None]] = None):
        super().__init__(name="ft-round-watcher", daemon=True)
        store_threads.track(self)   # joined (bounded) when the agent ends, even once replaced
        self.s = store.new_client(label="watcher")
        self.store = store
        self.me = me
        self.wake = wake
        self.fence = fence
        self.fence_members: List[NodeInfo] = []
        # nodes that joined the watched round after it closed (they wait as spares): a store
        # failover must know them too (agent/rounds.store_failover.py shares this list)
        self.late_joiners: List[NodeInfo] = []
        self._known_joined = 0
        self.on_late_joiner = on_late_joiner
        self.interval = cfg.conf("keep_alive_interval")
        self.max_silent = cfg.conf("keep_alive_max_attempt") * self.interval
        self._lock = threading.Lock()
        self._round: Optional[Round] = None
        self._halt = threading.Event()  # not _stop: Thread.join calls its own _stop()
        self.interrupted_round: Optional[int] = None
        self.dead_peers: List[NodeInfo] = []
        self._lost: Optional[str] = None
        self._call_since: Optional[float] = None  # when the store call in progress began
        self._next_fence = 0.0

    @property
    def store_lost(self) -> Optional[str]:
        """Why the store is lost (a failed call, a call that never returns, a successor that
        replaced this host), else None."""
        if self._lost or self.store.replaced:
            return self._lost or self.store.replaced
        since = self._call_since
        # On the host a call to its own store only stalls when this whole process was paused:
        # that is the fence's business (a successor may have taken over), not a lost store.
        if since is not None and not self.store.is_host and time.monotonic() - since > self.max_silent + self.interval:
            return (f"the rendezvous store at {self.store.host}:{self.store.port} has not answered for "
                    f"{time.monotonic() - since:.1f}s")
        return None

    def watch(self, rnd: Optional[Round]) -> None:
        with self._lock:
            self._round = rnd
            self.dead_peers = []
            self._known_joined = len(rnd.active) + len(rnd.spares) if rnd is not None else 0
        self._silence = SilenceWatch(self.max_silent)

    def stop(self, wait: float = 0.0) -> None:
        """Stop; with `wait`, give the thread that long to leave its store call. A daemon thread
        still inside torch's store code when the interpreter exits aborts the process ("terminate
        called without an active exception")."""
        self._halt.set()
        if wait and self.is_alive() and threading.current_thread() is not self:
            self.join(wait)

    def run(self) -> None:
        alive_key = self.store.key(f"alive/{self.me.node_id}")
        self._silence = SilenceWatch(self.max_silent)
        next_beat = 0.0
        while not self._halt.is_set():
            try:
                now = time.monotonic()
                if now >= next_beat:
                    self._call_since = now
                    self.s.add(alive_key, 1)
                    next_beat = now + self.interval
                    self._check_peers(now)
                    self._call_since = None
                with self._lock:
                    rnd = self._round
                if rnd is None:
                    self._halt.wait(min(self.interval, 0.1))
                    continue
                key = self.store.key(f"r{rnd.number}/interrupt")
                try:
                    self._call_since = time.monotonic()
                    self.s.wait([key], _td(max(0.01, next_beat - time.monotonic())))
                    self._call_since = None
                    with self._lock:
                        if self._round is rnd and self.interrupted_round != rnd.number:
                            self.interrupted_round = rnd.number
                            self.wake()
                except DistStoreError:
                    self._call_since = None
            except DistNetworkError as exc:
                self._call_since = None
                if self._halt.is_set():
                    return
                self._lost = (f"lost the rendezvous store at {self.store.host}:{self.store.port} "
                              f"({str(exc).splitlines()[0]})")
                self.wake()
                return

    def _check_peers(self, now: float) -> None:
        with self._lock:
            rnd = self._round
        if rnd is not None:
            self._find_late_joiners(rnd)
        members = rnd.active + rnd.spares if rnd is not None else self.fence_members
        peers = ring_peers(members, self.me.node_id)
        if not peers:
            return
        counts = present_values(self.s, [self.store.key(f"alive/{n.node_id}") for n in peers])
        dead = [node for node, count in zip(peers, counts) if self._silence.silent(node.node_id, count, now)]
        if dead and self.fence is not None and self.store.is_host and now >= self._next_fence:
            self._next_fence = now + self.interval
            where = self.fence()
            if where:
                self.store.replaced = where
                self.wake()
                return
        if dead and rnd is not None:
            with self._lock:
                if self._round is rnd and not self.dead_peers:
                    self.dead_peers = dead
                    self.wake()


    def _find_late_joiners(self, rnd: Round) -> None:
        joined = int(self.s.add(self.store.key(f"r{rnd.number}/joined"), 0))
        if joined <= self._known_joined:
            return
        raw = self.s.multi_get([self.store.key(f"r{rnd.number}/node/{i}")
                                for i in range(self._known_joined + 1, joined + 1)])
        self._known_joined = joined
        known = {n.node_id for n in rnd.active + rnd.spares + self.late_joiners}
        for value in raw:
            node = NodeInfo(**json.loads(value))
            if node.node_id not in known:
                self.late_joiners.append(node)
                if self.on_late_joiner is not None:
                    self.on_late_joiner(node)


def ring_peers(members: List[NodeInfo], me_id: str, count: int = WATCHED_PEERS) -> List[NodeInfo]:
    """The `count` nodes after this one in `members`, wrapping around: the peers whose keep-alives
    this agent watches. Every node is watched by `count` others, and each agent reads `count`
    counters a tick whatever the job's size (all peers would be O(N) per agent, O(N^2) at the host)."""
    ids = [n.node_id for n in members]
    if me_id not in ids:
        return [n for n in members][:count]
    i = ids.index(me_id)
    return [members[(i + step) % len(members)] for step in range(1, min(count, len(members) - 1) + 1)]


def present_values(client, keys: List[str]) -> List[Optional[bytes]]:
    """The values of `keys`, None for a key not (yet) in the store, without blocking on it
    (a plain get waits for a missing key). One call when all exist, else one check per key."""
    if not keys:
        return []
    if client.check(keys):
        return list(client.multi_get(keys))
    present = [k for k in keys if client.check([k])]
    values = dict(zip(present, client.multi_get(present))) if present else {}
    return [values.get(k) for k in keys]


# ---- optional call counting (bench/rendezvous_scale.py) ---------------------------------------
_STATS_DIR = os.environ.get("FT_LAUNCHER_STORE_STATS")
_STATS: Dict[str, Dict[str, list]] = {}
_MARKS: Dict[str, float] = {}


def _size(value) -> int:
    if isinstance(value, (bytes, str)):
        return len(value)
    if isinstance(value, (list, tuple)):
        return sum(_size(v) for v in value)
    return 8 if isinstance(value, (int, float)) else 0


class _CountingStore:
    """A TCPStore client that counts its calls and their payload bytes (keys and values, both
    ways) per method, under a label (main: the round protocol; watcher: keep-alives and
    interrupts). Only built when FT_LAUNCHER_STORE_STATS is set."""

    def __init__(self, inner, label: str):
        self._inner = inner
        self._table = _STATS.setdefault(label, {})

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args):
            row = self._table.setdefault(name, [0, 0])
            row[0] += 1
            row[1] += sum(_size(a) for a in args if not isinstance(a, datetime.timedelta))
            if name == "add" and len(args) == 2 and args[1] == 1 and str(args[0]).endswith("/joined"):
                _MARKS.setdefault("joined_at", time.time())
            result = attr(*args)
            row[1] += _size(result)
            if name == "get" and str(args[0]).endswith("/closed"):
                _MARKS["round_known_at"] = time.time()
            return result
        return call


def _counted(client, label: str):
    if not _STATS_DIR or client is None or isinstance(client, _CountingStore):
        return client
    return _CountingStore(client, label)


def _write_stats() -> None:
    _MARKS["exit_at"] = time.time()
    try:
        os.makedirs(_STATS_DIR, exist_ok=True)
        with open(os.path.join(_STATS_DIR, f"{os.getpid()}.json"), "w") as fh:
            json.dump({"calls": _STATS, "marks": _MARKS}, fh)
    except OSError:
        pass


if _STATS_DIR:
    atexit.register(_write_stats)
