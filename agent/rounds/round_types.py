"""What a round is and how a rendezvous fails: the node records, the round's membership and
rank layout, and the errors. Free of torch.

A Round carries what this agent needs, O(1) in the job's size: its node rank, rank offset, the
world size, how many nodes train and wait, the few peers it watches and the head of the member
order (the store's successors). The full member lists (`active`, `spares`) are read from the
store only where a part needs them (`loader`: the decider of a verdict, node 0's extras).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Tuple


class RendezvousError(RuntimeError):
    """A rendezvous that cannot go on; the message is one line for the operator."""


class StoreLost(RendezvousError):
    """The store host is gone (or stopped answering): the survivors fail over to a successor
    (agent/rounds.store_failover.py), or the job ends when that is impossible."""


class StoreReplaced(RendezvousError):
    """This agent hosted the store, was unreachable for a while, and the other agents have
    moved the job to a successor store: it must stop its ranks and end (no split brain)."""


class Stopped(Exception):
    """A wait ended because a signal asked this agent to stop (`by_peer`: another node's
    signal, seen as a shutdown of the round being joined)."""

    def __init__(self, signum: int, by_peer: bool = False):
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum
        self.by_peer = by_peer


@dataclasses.dataclass
class NodeInfo:
    node_id: str
    host: str          # address the other nodes reach this node at
    order_key: Optional[int]
    nproc: int
    stable: int = 0    # drawn once per agent from the store: placement survives restarts
    seq: int = 0
    hosts_store: bool = False  # this node's agent hosts the job's store (the one a failover replaces)
    domain: Optional[str] = None  # its NVLink domain, with `segment` set (agent.rounds.segments)
    alive_port: int = 0           # its agent's liveness port (agent.rounds.keepalive); 0: none

    def label(self) -> str:
        order = "" if self.order_key is None else f" order={self.order_key}"
        return f"{self.host}{order}"


class Round:
    """One round as this agent knows it. Built from full lists (`Round(number, me, active,
    spares)`) or from the closer's assignment (`Round.assigned`), whose lists load on first use."""

    def __init__(self, number: int, me: NodeInfo, active: Optional[List[NodeInfo]] = None,
                 spares: Optional[List[NodeInfo]] = None):
        self.number = number
        self.me = me
        self._active, self._spares = active, spares
        self.loader: Optional[Callable[[], Tuple[List[NodeInfo], List[NodeInfo]]]] = None
        self.peers: List[NodeInfo] = []
        self.head: List[NodeInfo] = []
        self.late = False   # joined after the round closed: a spare until the next round
        if active is not None:
            ids = [n.node_id for n in active]
            self._group_rank = ids.index(me.node_id) if me.node_id in ids else None
            self._rank_offset = sum(n.nproc for n in active[: self._group_rank or 0])
            self._world_size = sum(n.nproc for n in active)
            self.nnodes, self.nspares = len(active), len(spares or [])
            members = list(active) + list(spares or [])
            self.head = members[:HEAD]

    @classmethod
    def assigned(cls, number: int, me: NodeInfo, group_rank: Optional[int], rank_offset: int, world_size: int,
                 nnodes: int, nspares: int, peers: List[NodeInfo], head: List[NodeInfo],
                 loader: Callable[[], Tuple[List[NodeInfo], List[NodeInfo]]]) -> "Round":
        rnd = cls(number, me)
        rnd._group_rank, rnd._rank_offset, rnd._world_size = group_rank, rank_offset, world_size
        rnd.nnodes, rnd.nspares, rnd.peers, rnd.head, rnd.loader = nnodes, nspares, peers, head, loader
        return rnd

    def _load(self) -> None:
        if self._active is None:
            active, spares = self.loader()
            if self.late and all(n.node_id != self.me.node_id for n in spares):
                spares = spares + [self.me]
            self._active, self._spares = active, spares

    @property
    def active(self) -> List[NodeInfo]:
        """The training nodes in rank order (read from the store on first use)."""
        self._load()
        return self._active

    @property
    def spares(self) -> List[NodeInfo]:
        self._load()
        return self._spares or []

    @property
    def group_rank(self) -> Optional[int]:
        return self._group_rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def rank_offset(self) -> int:
        return self._rank_offset

    @property
    def members(self) -> int:
        """How many nodes the round admitted (trainers and spares)."""
        return self.nnodes + self.nspares


HEAD = 5   # members at the head of the order every agent knows: the store host and its next successors
