"""The interface every source of a recovering rank's state implements (issue 46, as torchft's
CheckpointTransport): a `Transport` moves some of the state the rank resumes with into an `Arrival`,
reading what it needs from the `RankRecovery` in progress. restore_transfer.arrive lets each
transport of its TRANSPORTS act, in order; a new source (an RDMA read, say) is one more class there,
not an edit of arrive. The sources themselves (kept state, a buddy copy, a live peer, the rank's own
record) are in restore_transfer.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from ft_launcher.rank_monitor.rank_side.live.live_plan import Plan


class Arrival:
    """What this rank's transfers gave: per object the state to load (`ready`), the bytes it
    received, the seconds it spent receiving, and what failed on it ("" while nothing)."""

    __slots__ = ("ready", "received", "seconds", "failed")

    def __init__(self) -> None:
        self.ready: Dict[str, Any] = {}
        self.received, self.seconds, self.failed = 0, 0.0, ""

    def fail(self, words: str) -> None:
        """The first failure's words stay (the one fallback line names it)."""
        self.failed = self.failed or words


class RankRecovery:
    """One rank's recovery while its state arrives: what the transports read, and share.

    `live`: the LiveState restoring; `plan`: who resumes where (live_plan); `rank`: this rank;
    `held`: the previous LiveState's record (live_registry.Held), or None; `offered`: the committed
    state this rank sends (its own, or once moved by a kept rank the new objects'), or None;
    `fresh`: the new objects as read once; `buddy`, `copies`: this cycle's buddy copies and their
    columns of the step exchange (None when off); `device`: the transfer device; `holding`: `live`
    already holds the state (a kept rank, once moved)."""

    __slots__ = ("live", "plan", "rank", "held", "offered", "fresh", "buddy", "copies", "device", "holding")

    def __init__(self, live, plan: Plan, rank: int, held, offered: Optional[dict], fresh: dict, buddy,
                 copies: Optional[list], device) -> None:
        self.live, self.plan, self.rank, self.held, self.offered = live, plan, rank, held, offered
        self.fresh, self.buddy, self.copies, self.device = fresh, buddy, copies, device
        self.holding = False


class Transport:
    """One source of a recovering rank's state. Its docstring says what it moves and over what."""

    def arrive(self, recovery: RankRecovery, got: Arrival) -> None:
        """Move what this source holds for `recovery`'s rank into `got` (nothing where the plan
        names it for none of this rank's state). What fails becomes words (`got.fail`), not an
        exception, so the ranks stay in step; a peer lost on the wire (live_wire.PeerLost) raises."""
        raise NotImplementedError
