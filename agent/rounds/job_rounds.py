"""This node's side of the job's rounds, as one part: its liveness port (agent.rounds.keepalive),
who it is (its NodeInfo, with its NVLink domain under --ft-segment: agent.rounds.segments), the job's
store, hosted here or reached (agent.rounds.job_store.JobStore), the round protocol on it, the round
watcher (agent.rounds.round_watcher), the failover to the successor store when the store's host is
lost (agent.rounds.store_failover), and the cycle's workers' store on group rank 0.

The store's modules are imported when the agent reaches the store (`reach`), not with this module:
the agent times its imports, and only an agent that hosts a store imports torch.
"""
from __future__ import annotations

import importlib
import os
import secrets
import socket
import warnings
from typing import Callable, Optional, Tuple

from ft_launcher.agent.rounds import segments, store_threads
from ft_launcher.agent.rounds.keepalive import AliveListener
from ft_launcher.agent.rounds.round_types import NodeInfo, RendezvousError, StoreLost


class JobRounds:
    def __init__(self, cfg, say: Callable[[str], None], events, wake: Callable[[], None],
                 unhandled_signal: Callable[[], Optional[int]]) -> None:
        self.cfg = cfg
        self.say = say
        self.events = events
        self.wake = wake
        self.unhandled_signal = unhandled_signal
        self.alive: Optional[AliveListener] = None
        self.store = None       # agent.rounds.job_store.JobStore
        self.me: Optional[NodeInfo] = None
        self.proto = None       # agent.rounds.rendezvous.RoundProtocol
        self.failover = None    # agent.rounds.store_failover.StoreFailover
        self.watcher = None     # agent.rounds.round_watcher.RoundWatcher, per store

    @staticmethod
    def load() -> Callable[[str, float], None]:
        """Import the store's modules now (the agent times it as a start-up phase); returns the
        start-up marker (agent.rounds.rendezvous.mark). No torch here: the store's client is ours
        (agent.rounds.store_client); only an agent that hosts the job's store, or a round's workers'
        store (node 0), imports torch."""
        with warnings.catch_warnings():  # torch's import-time warnings say nothing about this job
            warnings.simplefilter("ignore")
            for name in ("rendezvous", "round_watcher", "store_failover"):
                importlib.import_module(f"ft_launcher.agent.rounds.{name}")
        from ft_launcher.agent.rounds.rendezvous import mark

        return mark

    def listen(self) -> None:
        """This node's liveness port (its peers' watchers connect to it)."""
        self.alive = AliveListener("127.0.0.1" if self.cfg.standalone else "")

    def reach(self, learner) -> None:
        """Reach (or host) the job's store and make the round protocol and the failover on it
        (`learner`: the computed timeouts a new store host seeds). Raises RendezvousError."""
        from ft_launcher.agent.rounds.job_store import JobStore
        from ft_launcher.agent.rounds.rendezvous import RoundProtocol
        from ft_launcher.agent.rounds.store_failover import StoreFailover

        self.store = JobStore(self.cfg, self.say, self.unhandled_signal)
        self.me = self._node_info()
        self.me.hosts_store = self.store.is_host
        self.proto = RoundProtocol(self.store, self.cfg, self.me)
        self.failover = StoreFailover(self.cfg, self.store, self.proto, self.me, self.say, learner)

    def _node_info(self) -> NodeInfo:
        cfg = self.cfg
        host = cfg.local_addr or ("127.0.0.1" if cfg.standalone else socket.getfqdn())
        node_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        domain = None
        if cfg.ft.segment:   # NVLink-domain segments (agent.rounds.segments)
            domain, why = segments.node_domain()
            if domain is None:
                raise RendezvousError(f"segment {cfg.ft.segment}: this node's NVLink domain is unknown ({why}); "
                                      f"without --ft-segment the job trains on any nodes")
        return NodeInfo(node_id=node_id, host=host, order_key=cfg.order_key, nproc=cfg.nproc_per_node,
                        domain=domain, alive_port=self.alive.port)

    def start_watcher(self) -> None:
        """A round watcher on the current store (the previous one, if any, stopped). Raises
        StoreLost when the store went away before the watcher could reach it."""
        from ft_launcher.agent.rounds.round_watcher import RoundWatcher

        if self.watcher is not None:
            self.watcher.stop()
        try:
            self.watcher = RoundWatcher(self.store, self.cfg, self.me, self.wake, self.failover.find_successor,
                                        lambda node: self.events.event("spare_joined", None, spare=node.label(),
                                                                       node_id=node.node_id), self.alive)
        except RendezvousError as exc:
            raise StoreLost(str(exc)) from None
        self.watcher.late_joiners = self.failover.memory.late
        self.watcher.start()

    def take_over(self, lost: StoreLost) -> Tuple[int, Optional[int]]:
        """The store's host is lost: move to its successor and watch there. Returns the next
        round's number and how many nodes it expects (agent.rounds.store_failover)."""
        number, target = self.failover.take_over(lost)
        self.start_watcher()
        return number, target

    def workers_store(self, rnd):
        """The cycle's workers' store (MASTER_ADDR, MASTER_PORT): group rank 0 hosts it (torch's, on
        an IPv4 socket of ours) and publishes where; the others read it. Returns (store or None,
        (host, port))."""
        if rnd.group_rank != 0:
            return None, self.proto.worker_store(rnd.number)
        from ft_launcher.agent.rounds.job_store import host_store

        worker_store = host_store("0.0.0.0", 0, self.cfg.conf("read_timeout"))
        master = (self._master_host(), worker_store.port)
        self.proto.publish_worker_store(rnd.number, *master)
        return worker_store, master

    def _master_host(self) -> str:
        """MASTER_ADDR the ranks get from this node (round rank 0): with the static backend, the
        --master-addr the user gave when it names this node (torchrun passes it through), else this
        node's address (torchrun: --local-addr or the FQDN)."""
        from ft_launcher.agent.rounds.job_store import is_local_address

        cfg = self.cfg
        if cfg.rdzv_backend == "static" and not cfg.standalone and is_local_address(cfg.rdzv_host):
            return cfg.rdzv_host
        return self.me.host

    def close(self) -> None:
        """The watcher stopped; this watcher's, a failover's and abandoned connects' threads joined
        (agent.rounds.store_threads)."""
        if self.watcher is not None:
            self.watcher.stop()
        store_threads.join_all(self.cfg.conf("keep_alive_interval") + 1.0)
