"""What a round is and how it ends: the node records, the round's membership and rank layout, the
Verdict every agent applies when a round ends early (decided by agent.recovery.restart_policy,
published by agent.recovery.round_end), and the errors. Free of torch.

A Round carries what this agent needs, O(1) in the job's size: its node rank, rank offset, the
world size, how many nodes train and wait, the few peers it watches and the head of the member
order (the store's successors). The full member lists (`active`, `spares`) are read from the
store only where a part needs them (`loader`: the decider of a verdict, node 0's extras).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Dict, List, Optional, Set, Tuple


class RendezvousError(RuntimeError):
    """A rendezvous that cannot go on; the message is one line for the operator."""


class StoreLost(RendezvousError):
    """The store host is gone (or stopped answering): the survivors fail over to a successor
    (agent/rounds.store_failover.py), or the job ends when that is impossible."""


class StoreReplaced(RendezvousError):
    """This agent hosted the store, was unreachable for a while, and the other agents have
    moved the job to a successor store: it must stop its ranks and end (no split brain)."""


class NoRestart(Exception):
    """The job (or this node's part in it) ends here: exit with the no-restart code
    (agent.recovery.no_restart)."""

    def __init__(self, reason: str, node_only: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.node_only = node_only   # only this node leaves; the job may go on without it


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


NAMED_UP_TO = 256   # a round of at most this many nodes names them in its events (reading the list is O(N))
HEAD = 5   # members at the head of the order every agent knows: the store host and its next successors


@dataclasses.dataclass
class Verdict:
    """What every agent does after round `next_round - 1` ended early."""

    kind: str                               # failure | complete | shutdown | stop
    what: str = ""                          # one line for the operator
    restart: bool = False
    next_round: int = 0
    restarts_used: int = 0
    rung: str = "job"                       # in_process | job: how the healthy ranks restart
    replace_ranks: List[int] = dataclasses.field(default_factory=list)
    replace_nodes: List[str] = dataclasses.field(default_factory=list)
    exclude: List[str] = dataclasses.field(default_factory=list)
    dead_nodes: List[dict] = dataclasses.field(default_factory=list)
    node_id: Optional[str] = None           # the reporting node
    rank: Optional[int] = None              # the rank where the failure began, when known
    signal: Optional[int] = None            # kind shutdown: the signal
    origin: Optional[dict] = None           # where the failure began ({rank, node_id}), kept for later rounds
    # a rank's exit 16 (agent.recovery.rerun_exits): {cycle, rank, suspect {node_id, host, device},
    # iteration, swap {node_id, slots [a, b]} or None, rotate}: where the next cycle's ranks run
    rerun: Dict[str, Any] = dataclasses.field(default_factory=dict)
    detail: Dict[str, Any] = dataclasses.field(default_factory=dict)  # the rest of the report

    _FIELDS = ("kind", "what", "rank", "node_id", "exclude", "dead_nodes", "signal")

    @classmethod
    def from_report(cls, report: dict) -> "Verdict":
        """A verdict that says what `report` says, not yet decided (no restart)."""
        known = {k: report[k] for k in cls._FIELDS if k in report}
        detail = {k: v for k, v in report.items() if k not in cls._FIELDS}
        return cls(**known, detail=detail)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text) -> "Verdict":
        data = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def event_fields(self) -> dict:
        """The verdict as event fields (events.jsonl)."""
        out = dict(self.detail)
        out.update({k: v for k, v in dataclasses.asdict(self).items() if k != "detail" and v not in (None, [], {})})
        return out

    @property
    def in_process(self) -> bool:
        return self.restart and self.rung == "in_process"

    def keeps(self, global_rank: int, node_id: str) -> bool:
        """Does the healthy rank `global_rank` on node `node_id` restart in its own process?"""
        return (self.in_process and global_rank not in self.replace_ranks
                and node_id not in self.replace_nodes and node_id not in self.exclude)

    def stays(self, ranks, node_id: str, stopped_as_hung: Set[int]) -> list:
        """This node's ranks that restart in their own process: alive, kept by the verdict, and not
        stopped as hung (agent.recovery.hang_blame.settle). The in-place carrier asks these."""
        if not self.in_process:
            return []
        return [rank for rank in ranks if rank.exitcode is None and rank.local_rank not in stopped_as_hung
                and self.keeps(rank.rank, node_id)]

    def rung_words(self) -> str:
        """How the restart happens, for the operator's line."""
        return rung_words(self.restart, self.rung, self.replace_nodes, self.replace_ranks, moved=bool(self.rerun))


def rung_words(restart: bool, rung: str, replace_nodes=(), replace_ranks=(), done: bool = False,
               moved: bool = False) -> str:
    """How a verdict restarts the job, in the words of the console's line (`done`: as the report
    tells it afterwards; `moved`: the replaced ranks swap slots for a re-run after an exit 16)."""
    if not restart:
        return "no restart"
    if rung != "in_process":
        return "restarted every rank" if done else "restarting all ranks"
    parts = ["healthy ranks kept their processes" if done else "healthy ranks restart in place"]
    if replace_nodes:
        many = len(replace_nodes) > 1
        parts.append(f"node{'s' if many else ''} " + ", ".join(map(str, replace_nodes))
                     + (" restarted all their ranks" if done and many else " restarted all its ranks" if done
                        else f" restart{'' if many else 's'} all ranks"))
    if replace_ranks and moved:
        parts.append("rank " + ", ".join(map(str, replace_ranks))
                     + (" swapped devices" if done else " swap devices") + " for the re-run after exit 16")
    elif replace_ranks:
        parts.append("rank " + ", ".join(map(str, replace_ranks))
                     + (" replaced after failing again at once" if done else " replaced (failed again at once)"))
    return f"restarted in place ({'; '.join(parts)})" if done else "; ".join(parts)
