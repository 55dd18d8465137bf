"""How the state a rank resumes with arrives in a live recovery: steps 4 and 5 of `LiveState.restore`
(rank_monitor.rank_side.live.live_state), on this rank, from where the plan (live_plan) says:

- kept: its own committed state moves into the new objects (live_wire.move_state: copied into their
  own tensors, the rest handed over, nothing staged), and the LiveState holds it at once;
- a buddy copy (buddy_copy.fetch): its own host copy or a buddy's, before the live transfers (a rank
  that sends one may receive a live state);
- a peer: the transfers in one global order (Plan.transfers): each object's skeleton and tensors
  (live_wire), a sender's DTensors first bound to this call's meshes (LiveState._sendable), a
  received DTensor placed on this rank's mesh (live_objects.Tracked.place);
- its per-rank objects (`per_rank`) from its own host record, never a replica's (LiveState._own_part).

Whatever fails here on this rank becomes words (`failure`), not an exception: the rank still sends
what it holds and receives every object whole, so the ranks stay in step, and the next collective
carries the flag. A peer lost on the wire (live_wire.PeerLost) raises: the restart follows.
"""
from __future__ import annotations

import time
from typing import Any, Dict, Optional

from ft_launcher.rank_monitor.rank_side.live import buddy_copy
from ft_launcher.rank_monitor.rank_side.live import live_wire as W
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


def arrive(live, plan: Plan, held, holds: bool, fresh: dict, buddy, copies: Optional[list], device) -> Arrival:
    """This rank's state at `plan.resume` in `Arrival.ready`, and held by `live` (its previous
    LiveState `held` freed) unless something failed. `holds`: this rank offers its committed state
    (it held a clean one in the step exchange); `fresh`: the new objects as read once (step 1);
    `copies`: the buddy copies' columns of the step exchange."""
    import torch.distributed as dist

    rank = dist.get_rank()
    got = Arrival()
    offered = held.committed() if holds else None
    if plan.kept(rank):   # 4: the committed state into the new objects
        _keep(live, plan, held, offered, fresh, got)
        if not got.failed:
            offered = got.ready
    if buddy is not None:   # copies first (a rank that sends one may receive a live state)
        _fetch_copy(live, buddy, plan, copies, fresh, got)
    _send_and_receive(live, plan, offered, fresh, device, rank, got)   # 5
    del offered
    if live.per_rank and not plan.kept(rank) and not got.failed:   # its own part: never a replica's
        got.fail(live._own_part(plan, got.ready, fresh, rank))
    if not plan.kept(rank) and not got.failed:
        live._hold(plan.resume, got.ready, previous=held)
    return got


def _keep(live, plan: Plan, held, offered: dict, fresh: dict, got: Arrival) -> None:
    """A kept rank: its committed state moves into the new objects; once all of it has, the
    LiveState holds it (the previous objects freed). What failed is said; it still sends what it holds."""
    name = None
    try:
        for name in sorted(live.tracked):
            got.ready[name] = W.move_state(offered[name], fresh[name][0])
    except Exception as exc:  # noqa: BLE001 - said; it still sends what it holds
        got.fail(failure(name, "moving its kept state", exc))
    else:
        live._hold(plan.resume, got.ready, previous=held)


def _fetch_copy(live, buddy, plan: Plan, copies: Optional[list], fresh: dict, got: Arrival) -> None:
    """A rank that resumes from a buddy copy (its own host copy or its buddy's) reads it: it replaces
    `got.ready`, its bytes and seconds; nothing where the plan names no copy for this rank."""
    try:
        copied = buddy_copy.fetch(buddy, plan, copies, fresh, live._places())
    except W.ObjectFailed as exc:
        got.fail(failure(exc.name, "reading its copy", exc.error))
        copied = None
    if copied is not None:
        got.ready, got.received, got.seconds = copied


def _send_and_receive(live, plan: Plan, offered: Optional[dict], fresh: dict, device, rank: int,
                      got: Arrival) -> None:
    """The live transfers, in the plan's one global order: this rank sends each object of `offered`
    to the ranks that heal from it and receives each object whole from its source (also after one
    failed), into `got`."""
    import torch.distributed as dist

    names = sorted(live.tracked)
    t0 = time.perf_counter()
    for src, dst in plan.transfers():
        if src == rank:
            for name in names:
                try:
                    W.send_state(live._sendable(name, offered[name]), device, _wire(dist.send, dst))
                except W.PeerLost:
                    raise
                except Exception as exc:  # noqa: BLE001 - the receiver was told (live_wire); said
                    got.fail(failure(name, f"sending its state to rank {dst}", exc))
        if dst == rank:
            for name in names:   # every object is received whole, also after one failed
                try:
                    got.ready[name], nbytes = W.recv_state(fresh[name][0], device, _wire(dist.recv, src),
                                                           live.tracked[name].place)
                    got.received += nbytes
                except W.PeerLost:
                    raise
                except Exception as exc:  # noqa: BLE001 - said; every rank falls back
                    got.fail(failure(name, f"receiving its state from rank {src}", exc))
            got.seconds = time.perf_counter() - t0


def _wire(fn, peer: int):
    """dist.send/recv to `peer` as live_wire's `send`/`recv`: its errors are PeerLost (a peer gone or
    the group broken mid-transfer: a restart follows), told apart from a state that does not fit."""
    def go(t):
        try:
            fn(t, peer)
        except Exception as exc:  # noqa: BLE001 - whatever the backend raises
            raise W.PeerLost(f"the transfer with rank {peer} failed: {type(exc).__name__}: {exc}") from exc
    return go


def failure(name: Optional[str], what: str, exc: BaseException) -> str:
    """What failed on this rank, in words for the one fallback line: the object, the call, the error
    (its message on one line, at most ~300 characters)."""
    error = exc.error if isinstance(exc, W.ObjectFailed) else exc
    message = " ".join(str(error).split())
    if len(message) > 300:
        message = message[:297] + "..."
    return f"{what} of '{name}' raised {type(error).__name__}" + (f": {message}" if message else "")
