"""Rendezvous: the job-wide TCPStore and the round protocol the agents run on it.

One agent hosts torch's `TCPStore` (libuv backend) at the rendezvous endpoint; every agent talks
to it through its own client of that wire protocol (agent.rounds.store_client: no torch in a
non-host agent, slow told from dead). All keys live under `ft/<run_id>/`. A *round* is one
training cycle; what it costs the store host is O(N) bytes in all (O(1) per agent). Every key,
its shape, writer and readers, and what a store failover does with it, is declared in
agent.rounds.store_keys; a round's are `r<R>/...`: the joiners' records and sequence numbers
(`records`, `joined`), the closer's assignments (`closed`, `at/<node>`, `info`, `members`,
`assigned`), late joiners (`late`, `nlate`), the workers' store, the round's end (`interrupt`,
`verdict`, `origin`, `target`, `expect`) and its barriers (`done`, `left`).

Joining: an agent appends its record, adds 1 to `joined` (one round trip: append has no answer)
and, when its number completes the round (the maximum, or the target of a restart round), closes
it: it reads the records once, orders them, and publishes every assignment in one multi_set. The
joiner that brings the round to its minimum keeps the last-call timer (`--nnodes MIN:MAX`). Each
agent's watcher holds one WAIT on `r<R>/interrupt` while the round runs.
Everybody else blocks on `r<R>/assigned`: no polling. A waiting agent says every PROGRESS_EVERY s
who joined (in a job of more than NAMES_UP_TO nodes, only the first joiner reads that; the others
make no store call while they wait but a PING every ping_every s), and the first joiner of a
restart round checks then whether a node it waits for is still alive (agent.rounds.keepalive).

Ranks are assigned in infrastructure order (SLURM_PROCID / node rank / GROUP_RANK when known,
then the order agents first reached the store, kept for the job's life), never purely by who
joined first. With `--nnodes MIN:MAX`, the first MIN nodes in that order train and the others
wait as hot spares for the next round.

Every wait asks the agent's `stop` callable between local slices (no store traffic), so a signal
ends any wait within a second with `Stopped`. A signal while a round is being joined is written
to that round as a shutdown: the other joiners stop too.

A lost store host (agent.rounds.store_client tells dead, gone and unresponsive from slow) is
noticed by the RoundWatcher (agent.rounds.round_watcher) or by any store call;
agent.rounds.store_failover takes it from there.

With FT_LAUNCHER_STORE_STATS=<dir> every store call is counted (calls and bytes per method and
per connection) and written to <dir>/<pid>.json at exit (bench/rendezvous_scale.py).
"""
from __future__ import annotations

import atexit
import dataclasses
import errno
import json
import os
import secrets
import socket
import time
import weakref
from typing import Callable, Dict, List, Optional, Tuple

from ft_launcher.agent.rounds import segments, store_client, store_keys
from ft_launcher.agent.rounds.elastic import Elastic
from ft_launcher.agent.rounds.keepalive import Misses
from ft_launcher.agent.rounds.store_client import NotAStore, StoreClient, StoreTimeout, StoreUnreachable
from ft_launcher.agent.launch_config import LaunchConfig
from ft_launcher.agent.rounds.round_types import (HEAD, NodeInfo, NoRestart, RendezvousError, Round, Stopped,
                                                  StoreLost, StoreReplaced, Verdict)

LINGER_POLL = 0.02   # seconds between looks while a leaving store host keeps the store up
WAIT_SLICE = store_client.SLICE   # seconds: the longest a wait goes without looking for a signal
PROGRESS_EVERY = 5.0  # seconds between "still waiting for ..." lines
# An endpoint host name that does not resolve: said at once, then again after these gaps (the
# last one repeats); looked up again once a second meanwhile (a name can appear late: a
# Kubernetes service, a DNS record still propagating)
UNRESOLVED_SAY_GAPS = (5.0, 10.0, 20.0, 30.0)
UNRESOLVED_RETRY = 1.0
WATCHED_PEERS = 2     # nodes each agent watches: the next ones in the round's order
ELASTIC_LOOK = 0.1    # seconds between looks at the missing nodes of an elastic restart round
NAMES_UP_TO = 32      # a "waiting for nodes" line names the nodes while no more have joined


def is_local_address(host: str) -> bool:
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe_sock:
                probe_sock.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False


def name_lookup_error(host: str) -> Optional[str]:
    """None when `host` resolves (or is an address), else the resolver's reason in words."""
    try:
        socket.getaddrinfo(host, None)
        return None
    except socket.gaierror as exc:
        return exc.strerror or str(exc)
    except (OSError, UnicodeError) as exc:
        return str(exc)


def host_store(host: str, port: int, read_timeout: float):
    """torch's TCPStore server (libuv) listening on `port` (0: any free port) of every address of
    `host`'s family. The listening socket is ours, handed to torch (master_listen_fd): an IPv4
    endpoint gets an IPv4 socket, so the server sees its clients' own addresses (on a dual-stack
    socket it sees IPv4-mapped IPv6 ones, whose reverse lookups go to DNS: where DNS does not
    answer, each costs the server 5 s with every new connection waiting behind it). Raises
    OSError (EADDRINUSE when the port is taken). torch is imported here, once the port is bound,
    by the one agent that hosts the store."""
    import datetime

    guard = _host_guard(port)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
        # torch only once the port is free (an agent that finds it taken, another agent of this
        # host hosting, goes on as a client without importing torch); it listens once the server
        # can answer: until then a client is refused, and waits for the host to start
        from torch.distributed import TCPStore

        listener.listen(socket.SOMAXCONN)

        store = TCPStore(host if family == socket.AF_INET else "::1", listener.getsockname()[1], is_master=True,
                         wait_for_workers=False, timeout=datetime.timedelta(seconds=read_timeout),
                         master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        if guard is not None:
            guard.close()
        raise
    listener.detach()   # the server owns the descriptor now (it closes it when it stops)
    return HostedStore(store, guard)


def _host_guard(port: int) -> Optional[socket.socket]:
    """Two agents of one host may both find the port free and both import torch; only one may
    host. The first to bind this host-wide name (a Linux abstract socket: released when its
    process ends, no file left) does; the other gets EADDRINUSE, as if the port were taken."""
    if not port or not hasattr(socket, "AF_UNIX"):
        return None
    guard = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        guard.bind(f"\0ft_launcher-store-{port}")
    except OSError as exc:
        guard.close()
        if exc.errno == errno.EADDRINUSE:
            raise
        return None   # no abstract sockets here: the TCP bind alone decides
    return guard


class HostedStore:
    """torch's store server, serving on a listening socket of ours."""

    def __init__(self, store, guard: Optional[socket.socket] = None):
        self.store = store
        self.guard = guard
        self.port = store.port


def gone_after(cfg: LaunchConfig) -> float:
    """Seconds within which a peer host that stops answering at the TCP level is known gone."""
    return cfg.conf("keep_alive_interval") * (cfg.conf("keep_alive_max_attempt") + 1)


class JobStore:
    """The job's store: hosted here or reached as a client; keys are namespaced per run id."""

    # A running program on this host that holds the port and has not answered the store's
    # handshake within this is not a store (agent.rounds.store_client: a paused one is waited for).
    HANDSHAKE_LIMIT = store_client.HANDSHAKE_LIMIT

    def __init__(self, cfg: LaunchConfig, say: Callable[[str], None],
                 stop: Optional[Callable[[], Optional[int]]] = None):
        self.cfg = cfg
        self.say = say
        self.stop = stop  # returns the number of a signal that should end every wait, else None
        self.prefix = f"ft/{cfg.rdzv_id}/"
        self.is_host = False
        self.replaced: Optional[str] = None  # set when a successor store took the job over from us
        self.server = None
        self.host, self.port = cfg.rdzv_host, cfg.rdzv_port
        self.reach_host = self.host   # what this agent's own clients connect to
        want_host = cfg.is_host
        if want_host is None:
            want_host = cfg.standalone or is_local_address(self.host)
        self.local = cfg.standalone or is_local_address(self.host)
        if want_host:
            bind = self.host if not cfg.standalone else "127.0.0.1"
            unresolved = name_lookup_error(bind)
            if unresolved:   # asked to host (static node 0, is_host=true): the store listens on every
                # address anyway; this agent's own clients reach it on the loopback
                say(f"the rendezvous host name {self.host!r} ({self._endpoint_flag()}) does not resolve on "
                    f"this node ({unresolved}); hosting the store here on port {self.port} all the same: "
                    f"the other nodes must reach this node by that name")
                bind = self.reach_host = "127.0.0.1"
            try:
                self.server = host_store(bind, self.port, cfg.conf("read_timeout"))
                self.port = self.server.port
                self.is_host = True
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise RendezvousError(f"cannot host the rendezvous store on port {self.port}: "
                                          f"{exc.strerror or exc}") from None
                if cfg.is_host:
                    raise RendezvousError(
                        f"port {self.port} is already in use: cannot host the rendezvous store there "
                        f"(pick another {self._port_flag()} port)") from None
            except RuntimeError as exc:   # torch's own errors
                raise RendezvousError(f"cannot host the rendezvous store on port {self.port}: "
                                      f"{str(exc).splitlines()[0]}") from None
        if self.is_host:
            raise_file_limit(cfg.max_nodes)
            self.client = self.new_client("main", host="127.0.0.1" if cfg.standalone else self.reach_host)
        else:
            self.client = self._connect()

    def adopt(self, host: str, port: int, server, client: Optional[StoreClient] = None) -> None:
        """Use the successor store at host:port from now on (`server`: hosted by this agent)."""
        self.host, self.port = host, port
        self.reach_host = host
        self.server = server
        self.is_host = server is not None
        self.client = client if client is not None else self.new_client("main")

    def _connect(self) -> StoreClient:
        """Wait (up to join_timeout) until something listens at the endpoint, then shake hands. A
        host name that does not resolve is said at once and again while waiting
        (UNRESOLVED_SAY_GAPS): the lookup is retried, since a name can appear late."""
        join_timeout = self.cfg.conf("join_timeout")
        start = time.monotonic()
        deadline = start + join_timeout
        told = False
        unresolved: Optional[str] = None
        say_at, gaps = start, list(UNRESOLVED_SAY_GAPS)
        while True:  # wait until something listens at the endpoint
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    break
            except OSError as exc:
                self.check_stop()
                now = time.monotonic()
                unresolved = (exc.strerror or str(exc)) if isinstance(exc, socket.gaierror) else None
                if now > deadline:
                    why = (f": the host name {self.host!r} ({self._endpoint_flag()}) does not resolve ({unresolved})"
                           if unresolved else "")
                    raise RendezvousError(
                        f"no rendezvous store answered at {self.host}:{self.port} within "
                        f"join_timeout={join_timeout:g}s{why}") from None
                if unresolved:
                    if now >= say_at:
                        self.say(f"the rendezvous host name {self.host!r} ({self._endpoint_flag()}) does not "
                                 f"resolve: {unresolved}; looking it up again every {UNRESOLVED_RETRY:g}s until "
                                 f"join_timeout={join_timeout:g}s (a name can appear late, e.g. a Kubernetes "
                                 f"service) [waited {now - start:.0f}s]")
                        say_at = now + (gaps.pop(0) if len(gaps) > 1 else gaps[0])
                    self._pause(UNRESOLVED_RETRY)
                    continue
                if not told and now > start + 3:
                    self.say(f"waiting for the rendezvous host {self.host}:{self.port} to start")
                    told = True
                time.sleep(0.05)
        return self.new_client("main", within=join_timeout)

    def _pause(self, seconds: float) -> None:
        """Sleep, looking for a signal every WAIT_SLICE."""
        end = time.monotonic() + seconds
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(WAIT_SLICE, left))
            self.check_stop()

    def new_client(self, label: Optional[str] = None, within: Optional[float] = None,
                   host: Optional[str] = None, stop: bool = True) -> StoreClient:
        """A separate connection (each thread uses its own)."""
        host = host or self.reach_host
        try:
            client = StoreClient.connect(
                host, self.port, within=within or self.cfg.conf("store_unresponsive_timeout"),
                unresponsive=self.cfg.conf("store_unresponsive_timeout"), gone_after=gone_after(self.cfg),
                ping_every=ping_every(self.cfg) * (1 if label == "watcher" else 2),
                stop=self._stop_check() if stop else None, say=self.say,
                label=label or "other", local=self.local or host == "127.0.0.1",
                handshake_limit=self.HANDSHAKE_LIMIT)
            client.default_timeout = self.cfg.conf("read_timeout")
            return client
        except NotAStore as exc:
            raise RendezvousError(
                f"port {self.port} on {self.host} is in use by another program that is not a "
                f"rendezvous store ({exc}; pick another {self._port_flag()} port)") from None
        except StoreUnreachable as exc:
            raise RendezvousError(f"cannot reach the rendezvous store at {self.host}:{self.port}: {exc}") from None

    def key(self, name: str) -> str:
        return self.prefix + name

    def _stop_check(self) -> Callable[[], None]:
        """check_stop for this store's clients, without a reference to this store (a client that
        held one would keep a store hosted here alive, through the cycle, after its last user)."""
        ref = weakref.ref(self)

        def check() -> None:
            store = ref()
            if store is not None:
                store.check_stop()
        return check

    def check_stop(self) -> None:
        """Raise Stopped if a signal asked this agent to stop."""
        sig = self.stop() if self.stop else None
        if sig:
            raise Stopped(sig)

    def wait_key(self, client: StoreClient, key: str, timeout: float) -> bool:
        """Wait up to `timeout` s for `key` to exist, blocking in the store (a signal ends the
        wait: Stopped); False when the time is up, StoreLost when the store goes away."""
        try:
            client.wait([key], timeout)
            return True
        except StoreTimeout:
            return False
        except StoreUnreachable as exc:
            raise StoreLost(f"lost the rendezvous store at {self.host}:{self.port} ({exc})") from None

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

    def _endpoint_flag(self) -> str:
        """Where the endpoint's host came from, for a line about it."""
        origin = self.cfg.origins.get("endpoint")
        if not origin or origin == "default":
            origin = "--master-addr" if self.cfg.rdzv_backend == "static" else "--rdzv-endpoint"
        return f"from {origin}"


def ping_every(cfg: LaunchConfig) -> float:
    """How often a connection with nothing else to say asks the store whether it still answers
    (the watcher's; the main connection's, during a long wait, half as often)."""
    return max(0.5, min(5.0, cfg.conf("store_unresponsive_timeout") / 4))


def raise_file_limit(max_nodes: int) -> None:
    """The store host holds two connections per agent (and the watchers' inbound ones): lift the
    soft limit on open files to the hard one, and say when even that is too low."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        return
    need = 2 * max_nodes + 64
    if hard != resource.RLIM_INFINITY and hard < need:
        print(f"[ft_launcher] warning: the store host may open at most {hard} files, but {max_nodes} "
              f"nodes need about {need} connections: raise `ulimit -n`", flush=True)


def _record(node: NodeInfo) -> str:
    return json.dumps(dataclasses.asdict(node), separators=(",", ":"))


def _node(data) -> NodeInfo:
    if isinstance(data, (bytes, str)):
        data = json.loads(data)
    names = {f.name for f in dataclasses.fields(NodeInfo)}
    return NodeInfo(**{k: v for k, v in data.items() if k in names})


def order(nodes: List[NodeInfo]) -> List[NodeInfo]:
    """Infrastructure order: order key, then the order agents first reached the store."""
    return sorted(nodes, key=lambda n: (n.order_key is None, n.order_key or 0, n.stable))


def _lines(raw: bytes) -> List[NodeInfo]:
    """The records of a blob of JSON lines, the first of each node id kept."""
    out: Dict[str, NodeInfo] = {}
    for line in raw.decode().splitlines():
        if line.strip():
            node = _node(line)
            out.setdefault(node.node_id, node)
    return list(out.values())


class RoundProtocol:
    """One agent's side of the round protocol (see the module docstring)."""

    def __init__(self, store: JobStore, cfg: LaunchConfig, me: NodeInfo):
        self.store = store
        self.cfg = cfg
        self.elastic_rules = Elastic.of(cfg)   # --nnodes MIN:MAX and --elastic (agent.rounds.elastic)
        self.me = me
        self._last_call = cfg.conf("last_call_timeout")
        # why too few nodes can remain once `excluded` have left, or None: the restart policy's,
        # set by the round's end (agent.recovery.round_end); a joiner asks it
        self.too_few_left: Callable[[int], Optional[str]] = lambda excluded: None
        self.token = secrets.token_hex(8)   # this agent, in the interrupts it writes
        self._members: tuple = (None, None)   # (round, its member lists) once read
        self._misses: tuple = (None, None)    # (round, Misses of its missing nodes) once probed
        if not me.stable:
            me.stable = self._call(self.s.add, self.k(store_keys.agents()), 1)

    @property
    def s(self) -> StoreClient:
        """The store's client: a failover swaps the store under this protocol (JobStore.adopt)."""
        return self.store.client

    def k(self, name: str) -> str:
        return self.store.key(name)

    def _call(self, fn, *args):
        if self.store.replaced:
            raise StoreReplaced(self.store.replaced)
        try:
            return fn(*args)
        except StoreUnreachable as exc:
            raise StoreLost(f"lost the rendezvous store at {self.store.host}:{self.store.port} ({exc})") from None

    # -- plain job-wide values (under the run's prefix) --------------------------------------
    def put(self, name: str, value: str) -> None:
        self._call(self.s.set, self.k(name), value)

    def get(self, name: str) -> str:
        try:
            return self._call(self.s.get, self.k(name), self.cfg.conf("read_timeout")).decode()
        except StoreTimeout:
            raise RendezvousError(f"the store has no {name!r} after read_timeout="
                                  f"{self.cfg.conf('read_timeout'):g}s") from None

    def get_raw(self, names: List[str]) -> List[bytes]:
        """The values of `names` as stored, b"" for those that do not exist (one read)."""
        return self._call(self.s.multi_get_now, [self.k(n) for n in names]) if names else []

    def put_raw(self, names: List[str], values: List[bytes]) -> None:
        """Set every name to its value (one write)."""
        if names:
            self._call(self.s.multi_set, [self.k(n) for n in names], values)

    def get_many(self, names: List[str]) -> List[str]:
        return [v.decode() for v in self._call(self.s.multi_get_now, [self.k(n) for n in names])] if names else []

    def exists(self, name: str) -> bool:
        return bool(self._call(self.s.check, [self.k(name)]))

    def count(self, name: str, increment: int = 0) -> int:
        return int(self._call(self.s.add, self.k(name), increment))

    def current_round(self) -> int:
        value = self._call(self.s.compare_set, self.k(store_keys.next_round()), "", "0")
        return int(value)

    # -- joining -----------------------------------------------------------------------------
    def join(self, number: int, target: Optional[int] = None) -> Round:
        """Join round `number`; returns once it is closed and this agent knows its place.
        `target`: how many nodes a restart round expects back (a failover's survivors); else the
        target the verdict of the previous round left in the store, if any."""
        try:
            return self._join(number, target)
        except Stopped as exc:   # our signal anywhere in the join (its first call included) stops the others too
            if not exc.by_peer:
                self.abandon(number, exc.signum)
            raise

    def _join(self, number: int, target: Optional[int]) -> Round:
        me = dataclasses.replace(self.me)
        me.seq, raw = self._call(self.s.join_step, self.k(store_keys.records(number)), _record(me) + "\n",
                                 self.k(store_keys.joined(number)), self.k(store_keys.target(number)))   # one round trip
        _mark("joined_at")
        if target is None:
            target = int(raw) if raw else None
        need = self.needed_nodes
        start = time.monotonic()
        timer = None   # the last-call deadline, kept by the joiner that brought the round to its minimum
        # --elastic, a restart round: the nodes still missing are looked at every ELASTIC_LOOK s (dead,
        # agent.rounds.keepalive.Misses: refused, or unanswered over a window: the round closes on
        # those there, at once; too few left: one line, exit 1)
        elastic = self.elastic_rules.closes_on_the_living(target)
        if me.seq >= self.cfg.max_nodes or (target and me.seq >= max(target, need)):
            self._close(number, me.seq)
        elif elastic and self._elastic_close_due(number, me.seq, target):
            self._close(number, me.seq)
        elif me.seq == need:
            timer = start + self._last_call
        next_progress = start + 1.0  # the first line soon, then every PROGRESS_EVERY s
        join_timeout = self.cfg.conf("join_timeout")
        assigned = self.k(store_keys.assigned(number))
        closed_seen = False
        # at scale only the first joiner reads who joined for its lines; the others say theirs
        # between the slices of one wait, without a store call
        reads = self.cfg.max_nodes <= NAMES_UP_TO or me.seq == 1
        said = [start + 1.0]

        def line() -> None:
            now = time.monotonic()
            if now >= said[0]:
                said[0] = now + PROGRESS_EVERY
                self.store.say(f"rendezvous round {number}: waiting for nodes: joined as node {me.seq} of "
                               f"{self.cfg.min_nodes} needed [{now - start:.0f}s of join_timeout {join_timeout:g}s]")
        next_look = start + ELASTIC_LOOK
        while True:
            deadline = min(next_progress if reads else float("inf"), start + join_timeout, timer or float("inf"),
                           next_look if elastic else float("inf"))
            try:
                self._call(self.s.wait, [assigned], max(0.0, deadline - time.monotonic()), None if reads else line)
                break
            except StoreTimeout:
                pass
            now = time.monotonic()
            if elastic and now >= next_look:
                next_look = now + ELASTIC_LOOK
                joined = self._call(self.s.add, self.k(store_keys.joined(number)), 0)
                if self._elastic_close_due(number, joined, target):
                    self._close(number, joined)
                    continue
            if timer is not None and now >= timer:
                timer = None
                self._close(number, self._call(self.s.add, self.k(store_keys.joined(number)), 0))
                continue
            if reads and now >= next_progress:
                next_progress = now + PROGRESS_EVERY
                joined = self._call(self.s.add, self.k(store_keys.joined(number)), 0)
                self._check_join_stop(number)
                if self._call(self.s.check, [self.k(store_keys.closed(number))]):
                    if closed_seen:   # closed a tick ago and still not published: its closer died
                        self._publish(number)
                        continue
                    closed_seen = True
                self.store.say(self._join_progress(number, joined, target, now - start))
                if self._late_close_due(number, me.seq, joined, target, now - start):
                    self._close(number, joined)
                    continue
            if now - start > join_timeout:
                joined = self._call(self.s.add, self.k(store_keys.joined(number)), 0)
                nodes = self._records(number) if joined <= NAMES_UP_TO else []
                names = f" ({', '.join(n.label() for n in nodes)})" if nodes else ""
                raise RendezvousError(
                    f"rendezvous round {number} timed out after {join_timeout:g}s: "
                    f"{joined} of {self.cfg.min_nodes} needed nodes joined{names}; "
                    f"{self.cfg.min_nodes - joined} missing")
        return self._my_round(number, me)

    def _elastic_close_due(self, number: int, joined: int, target: int) -> bool:
        """--elastic, restart round `number` (expecting `target` nodes back) with `joined` in: True when
        at least the minimum joined and every node still missing is dead (the round goes on without
        them, at once); raises RendezvousError (exit 1) when the nodes alive are fewer than the
        minimum (--nnodes MIN): the job cannot go on."""
        expected = self._expected(number)
        if not expected:
            return False
        alive = self._alive(number, expected)
        need = self.needed_nodes
        if alive < need:
            self.abandon_with(number, {"kind": "stop", "what": f"too few nodes left: {alive} of the {need} needed"})
            raise RendezvousError(self.elastic_rules.too_few_to_go_on(alive, need))
        return joined >= need and alive <= joined

    def _late_close_due(self, number: int, seq: int, joined: int, target: Optional[int], waited: float) -> bool:
        """A round that nobody closed in time: the first joiner of a restart round finds that
        the nodes still missing are dead; or the minimum is there and the last-call timer's
        keeper is gone (any agent, after twice the last call)."""
        if joined < self.needed_nodes:
            return False
        expected = self._expected(number) if target and seq == 1 and joined < target else []
        if expected:
            return self._alive(number, expected) <= joined
        return waited > 2 * self._last_call + PROGRESS_EVERY

    def _alive(self, number: int, expected: List[NodeInfo]) -> int:
        """How many of the nodes restart round `number` expects are alive: those that joined, and
        those still missing that are not gone (agent.rounds.keepalive.Misses: a refused connect
        to their liveness port, or silent probes over a window; one slow answer is not enough)."""
        if self._misses[0] != number:
            self._misses = (number, Misses.of(self.cfg))
        misses = self._misses[1]
        joined = {n.node_id for n in self._records(number)}
        return len(expected) - sum(1 for n in expected if n.node_id not in joined and misses.gone(n.host, n.alive_port))

    def _expected(self, number: int) -> List[NodeInfo]:
        raw = self._call(self.s.get_now, self.k(store_keys.expect(number)))
        return [_node(d) for d in json.loads(raw)] if raw else []

    def _close(self, number: int, count: int) -> bool:
        """Close round `number` with `count` joiners (first closer wins) and publish every
        assignment. True when this agent closed it."""
        mine = f"{count}:{self.token}"
        if self._call(self.s.compare_set, self.k(store_keys.closed(number)), "", mine).decode() != mine:
            return False
        self._publish(number)
        return True

    def _publish(self, number: int) -> None:
        """Every assignment of closed round `number`, then `assigned` (idempotent: a closer that
        died before publishing is stood in for by whoever notices, from the same records)."""
        nodes = order(self._records(number))
        train = self.training_nodes
        active, spares = nodes[:train], nodes[train:]
        if self.cfg.ft.segment:   # whole NVLink-domain segments train (agent.rounds.segments)
            chosen = segments.split(nodes, train, self.cfg.ft.segment)
            if chosen is None:
                self.abandon_with(number, {"kind": "stop", "what": f"rendezvous round {number}: segment "
                                           f"{self.cfg.ft.segment}: " + segments.shortfall(nodes, train,
                                                                                            self.cfg.ft.segment)})
                return
            active, spares = chosen
        members = active + spares
        records = [dataclasses.asdict(n) for n in members]
        keys, values = [], []
        offset = 0
        for i, node in enumerate(members):
            peers = [records[(i + step) % len(members)] for step in range(1, min(WATCHED_PEERS, len(members) - 1) + 1)]
            place = {"g": i if i < len(active) else None, "o": offset, "p": peers}
            if i < len(active):
                offset += node.nproc
            keys.append(self.k(store_keys.place(number, node.node_id)))
            values.append(json.dumps(place, separators=(",", ":")))
        info = {"world": sum(n.nproc for n in active), "nnodes": len(active), "nspares": len(spares),
                "head": records[:HEAD]}
        keys += [self.k(store_keys.info(number)), self.k(store_keys.members(number))]
        values += [json.dumps(info, separators=(",", ":")),
                   json.dumps({"active": records[:len(active)], "spares": records[len(active):]}, separators=(",", ":"))]
        self._call(self.s.multi_set, keys, values)
        self._call(self.s.set, self.k(store_keys.assigned(number)), "ok")

    def abandon_with(self, number: int, reason: dict) -> None:
        """End round `number` before it trains: `reason` as its interrupt and verdict, and the
        joiners woken."""
        if self.claim_interrupt(number, reason) is not None:
            verdict = Verdict.from_report(reason)   # a shutdown or a stop: no decision to make
            verdict.next_round = number + 1
            self._call(self.s.set, self.k(store_keys.verdict(number)), verdict.to_json())
        self._call(self.s.set, self.k(store_keys.assigned(number)), "abandoned")

    def _my_round(self, number: int, me: NodeInfo) -> Round:
        """This agent's place in closed round `number`: one read of its assignment and the shape."""
        state, place, info = self._call(self.s.multi_get_now, [self.k(store_keys.assigned(number)),
                                                               self.k(store_keys.place(number, me.node_id)),
                                                               self.k(store_keys.info(number))])
        if state == b"abandoned":
            self._check_join_stop(number)
            raise RendezvousError(f"rendezvous round {number} was abandoned")
        info = json.loads(info)
        head = [_node(d) for d in info["head"]]

        def loader() -> Tuple[List[NodeInfo], List[NodeInfo]]:
            return self.members(number)

        if not place:   # joined after the round closed: a spare until the next round; the others hear of it
            self._call(self.s.append, self.k(store_keys.late(number)), _record(me) + "\n")
            self._call(self.s.add, self.k(store_keys.nlate(number)), 1)   # the head's watchers hear of it
            rnd = Round.assigned(number, me, None, 0, info["world"], info["nnodes"], info["nspares"],
                                 head[:WATCHED_PEERS], head, loader)
            rnd.late = True
        else:
            place = json.loads(place)
            rnd = Round.assigned(number, me, place["g"], place["o"], info["world"], info["nnodes"], info["nspares"],
                                 [_node(d) for d in place["p"]], head, loader)
        _mark("round_known_at")
        return rnd

    def members(self, number: int) -> Tuple[List[NodeInfo], List[NodeInfo]]:
        """Round `number`'s trainers and spares, in order (O(N): where a part needs the list; read
        once per round)."""
        if self._members[0] != number:
            # published before anyone knows its place
            raw = self._call(self.s.get_now, self.k(store_keys.members(number)))
            if not raw:
                raise RendezvousError(f"round {number} has no member list in the store")
            data = json.loads(raw)
            self._members = (number, ([_node(d) for d in data["active"]], [_node(d) for d in data["spares"]]))
        active, spares = self._members[1]
        return list(active), list(spares)

    def late_joiners(self, number: int) -> List[NodeInfo]:
        return _lines(self._call(self.s.get_now, self.k(store_keys.late(number))))

    def _records(self, number: int) -> List[NodeInfo]:
        return _lines(self._call(self.s.get_now, self.k(store_keys.records(number))))

    def _nodes(self, number: int, count: int = 0) -> List[NodeInfo]:
        """The nodes that joined round `number` (agent.recovery.no_restart)."""
        return self._records(number)

    @property
    def training_nodes(self) -> int:
        """How many nodes train in a round (the first in order); the others wait as hot spares.
        `--nnodes MIN:MAX`: MIN; with active_world_size: that many ranks' worth of nodes, the rest
        of the job's nodes being warm reserve nodes; --elastic: up to MAX."""
        fixed = min(self.cfg.active_nodes, self.cfg.min_nodes) if self.cfg.active_nodes else self.cfg.min_nodes
        return self.elastic_rules.trainers(fixed)

    @property
    def needed_nodes(self) -> int:
        """How many nodes a round needs before it may close: the training nodes, or with --elastic
        MIN (a round closes on fewer than MAX after the last call, or once the missing are dead)."""
        return self.elastic_rules.needed(self.training_nodes)

    def _check_join_stop(self, number: int) -> None:
        """Stopped if another joiner's signal abandoned the round; NoRestart if too few nodes can remain."""
        short = self.too_few_left(self.count(store_keys.excluded()))
        if short:
            raise NoRestart(f"the job cannot go on: {short}")
        if self._call(self.s.check, [self.k(store_keys.interrupt(number))]):
            verdict = self.verdict(number)
            if verdict.kind == "shutdown":
                self.mark_left(number)
                raise Stopped(int(verdict.signal or 15), by_peer=True)
            if verdict.kind == "stop":
                raise RendezvousError(verdict.what)

    def abandon(self, number: int, sig: int) -> None:
        """Stop joining round `number`: record a shutdown there so that the other joiners stop
        too; if this agent hosts the store, keep it up (at most 1 s) until they have read it."""
        reason = {"kind": "shutdown", "signal": sig, "node_id": self.me.node_id}
        try:   # a fresh connection: the signal ended a wait on the old one, whose state is suspect
            fresh = self.store.new_client("main", within=5.0, stop=False)
        except RendezvousError:
            fresh = None
        if fresh is not None:
            self.store.client.close()
            self.store.client = fresh
        client = self.s
        stop, client.stop = client.stop, None   # the signal being acted on ends none of these calls
        try:
            self.abandon_with(number, reason)
            self.mark_left(number)
            self.store.linger(lambda: self.left_count(number) >= self.count(store_keys.joined(number)), 1.0)
        except (RendezvousError, Stopped):
            pass
        finally:
            client.stop = stop

    def _join_progress(self, number: int, joined: int, target: Optional[int], waited: float) -> str:
        """One line: who joined round `number`, who is missing, how long it has waited (the
        names while few have joined: reading them is O(N))."""
        nodes = self._records(number) if joined <= NAMES_UP_TO else []
        need = self.cfg.min_nodes
        missing = ""
        expected = self._expected(number) if target and joined <= NAMES_UP_TO else []
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
        if not missing and target and joined < target:
            missing = f"; {target - joined} more expected back"
        names = f" ({', '.join(n.label() for n in nodes)})" if nodes else ""
        return (f"rendezvous round {number}: waiting for nodes: {joined} of {need} joined{names}{missing} "
                f"[{waited:.0f}s of join_timeout {self.cfg.conf('join_timeout'):g}s]")

    # -- the workers' store address --------------------------------------------------------
    def publish_worker_store(self, number: int, addr: str, port: int) -> None:
        self._call(self.s.set, self.k(store_keys.worker_store(number)), f"{addr}:{port}")

    def worker_store(self, number: int) -> tuple:
        key = self.k(store_keys.worker_store(number))
        if not self.store.wait_key(self.s, key, self.cfg.conf("read_timeout")):
            raise RendezvousError(f"round {number}: node 0 never published the workers' store")
        host, _, port = self._call(self.s.get_now, key).decode().rpartition(":")
        return host, int(port)

    # -- ending a round (the decision: agent.recovery.round_end) ----------------------------
    def claim_interrupt(self, number: int, reason: dict) -> Optional[dict]:
        """Report the end of round `number` (compare-and-set on its interrupt: the first report
        wins); the report as written when this one won, else None. The reporter's token makes the
        text unique: two agents with the same report (the same silent peer) must not both win."""
        report = dict(reason, reporter=self.token)
        text = json.dumps(report, sort_keys=True)
        won = self._call(self.s.compare_set, self.k(store_keys.interrupt(number)), "", text).decode() == text
        return report if won else None

    def declare_restartable(self, number: int) -> None:
        """This node's ranks all run under ft.restartable in round `number` (once per node)."""
        self.count(store_keys.restartable(number), 1)

    def verdict(self, number: int) -> Verdict:
        """The verdict of interrupted round `number`. Its decider writes it just after winning
        the interrupt; if that node dies in between, the wait ends after close_timeout with one
        line naming it (RendezvousError: exit 1)."""
        key = self.k(store_keys.verdict(number))
        timeout = self.cfg.conf("close_timeout")
        known = self._call(self.s.get_now, key)   # there already, when the interrupt woke us
        if known:
            return Verdict.from_json(known)
        if not self.store.wait_key(self.s, key, timeout):
            try:
                who = json.loads(self._call(self.s.get_now, self.k(store_keys.interrupt(number)))).get("node_id") \
                    or "another node"
            except (RendezvousError, ValueError, AttributeError):
                who = "another node"
            raise RendezvousError(
                f"round {number} was interrupted by {who}, but its verdict did not come within "
                f"close_timeout={timeout:g}s (the deciding node died before writing it?) -> exiting 1")
        return Verdict.from_json(self._call(self.s.get_now, key))

    def interrupted(self, number: int) -> bool:
        return bool(self._call(self.s.check, [self.k(store_keys.interrupt(number))]))

    def claim_fault(self) -> int:
        """Count one more simulated fault for the job; returns the new total."""
        return self.count(store_keys.faults_fired(), 1)

    def faults_fired(self) -> int:
        return self.count(store_keys.faults_fired())

    def restarts_used(self) -> int:
        return self.count(store_keys.restarts_used())

    def mark_done(self, number: int) -> int:
        return self.count(store_keys.done(number), 1)

    def mark_left(self, number: int) -> int:
        return self.count(store_keys.left(number), 1)

    def left_count(self, number: int) -> int:
        return self.count(store_keys.left(number))


# ---- optional call counting (bench/rendezvous_scale.py) ---------------------------------------
_STATS_DIR = os.environ.get("FT_LAUNCHER_STORE_STATS")
_MARKS: Dict[str, float] = {}


def mark(name: str, when: Optional[float] = None) -> None:
    """Remember when `name` first happened in this agent (only with FT_LAUNCHER_STORE_STATS)."""
    if _STATS_DIR:
        _MARKS.setdefault(name, time.time() if when is None else when)


_mark = mark


def _write_stats() -> None:
    _MARKS["exit_at"] = time.time()
    try:
        os.makedirs(_STATS_DIR, exist_ok=True)
        with open(os.path.join(_STATS_DIR, f"{os.getpid()}.json"), "w") as fh:
            json.dump({"calls": store_client.STATS, "marks": _MARKS}, fh)
    except OSError:
        pass


if _STATS_DIR:
    store_client.counting(True)
    atexit.register(_write_stats)
