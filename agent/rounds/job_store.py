"""The job's store: torch's `TCPStore` hosted by this agent, or reached as a client of it.

One agent hosts the store at the rendezvous endpoint (`JobStore`: the agent asked to, or the one
whose host is the endpoint's and that binds its port first; under `--standalone`, this one); every
agent, the host included, talks to it through its own client of that wire protocol
(agent.rounds.store_client: no torch in a non-host agent, slow told from dead). `host_store` starts
torch's server (libuv) on a listening socket of ours; two agents of one host never both host
(`_host_guard`). The same `host_store` serves a cycle's workers' store (agent.rounds.job_rounds) and
a successor store after the host is lost (agent.rounds.store_failover, which then calls
`JobStore.adopt`). A store host that leaves keeps the store up until the others have read what
they need (`JobStore.linger`).

A client that finds nothing listening at the endpoint waits for it (up to join_timeout); an
endpoint name that does not resolve is said, and looked up again, while it waits: a name can
appear late. A port held by a program that is not a store is said in one line. Every wait asks the
agent's `stop` callable between local slices (no store traffic), so a signal ends any wait within
a second with `Stopped`. All keys live under `ft/<run_id>/` (`JobStore.key`); the round protocol on
this store is agent.rounds.rendezvous's.
"""
from __future__ import annotations

import errno
import socket
import time
import weakref
from typing import Callable, Optional

from ft_launcher.agent.launch_config import LaunchConfig
from ft_launcher.agent.rounds import store_client
from ft_launcher.agent.rounds.round_types import RendezvousError, Stopped, StoreLost
from ft_launcher.agent.rounds.store_client import NotAStore, StoreClient, StoreTimeout, StoreUnreachable

LINGER_POLL = 0.02   # seconds between looks while a leaving store host keeps the store up
WAIT_SLICE = store_client.SLICE   # seconds: the longest a wait goes without looking for a signal
# An endpoint host name that does not resolve: said at once, then again after these gaps (the
# last one repeats); looked up again once a second meanwhile (a name can appear late: a
# Kubernetes service, a DNS record still propagating)
UNRESOLVED_SAY_GAPS = (5.0, 10.0, 20.0, 30.0)
UNRESOLVED_RETRY = 1.0


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
