"""What a round is and how a rendezvous fails: the node records, the round's membership and
rank layout, and the errors. Free of torch, so the agent can start its helper processes (orphan
watchdog, rank monitors) while torch is still being imported for the store.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional


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

    def label(self) -> str:
        order = "" if self.order_key is None else f" order={self.order_key}"
        return f"{self.host}{order}"


@dataclasses.dataclass
class Round:
    number: int
    me: NodeInfo
    active: List[NodeInfo]
    spares: List[NodeInfo]

    @property
    def group_rank(self) -> Optional[int]:
        for i, node in enumerate(self.active):
            if node.node_id == self.me.node_id:
                return i
        return None

    @property
    def world_size(self) -> int:
        return sum(node.nproc for node in self.active)

    @property
    def rank_offset(self) -> int:
        return sum(node.nproc for node in self.active[: self.group_rank])
