"""How the state a rank resumes with arrives in a live recovery: steps 4 and 5 of `LiveState.restore`
(rank_monitor.rank_side.live.live_state), on this rank, from where the plan (live_plan) says. Each
source is a transport (the interface: rank_side.live.transport), and `arrive` lets each of
TRANSPORTS act, in this order:

- KeptState: its own committed state moves into the new objects (live_wire.move_state: copied into
  their own tensors, the rest handed over, nothing staged), and the LiveState holds it at once;
- BuddyCopyRead (buddy_copy.fetch): its own host copy or a buddy's, before the live transfers (a
  rank that sends one may receive a live state);
- PeerTransfer: the transfers in one global order (Plan.transfers): each object's skeleton and
  tensors (live_wire), a sender's DTensors first bound to this call's meshes
  (LiveState._sendable), a received DTensor placed on this rank's mesh (live_objects.Tracked.place);
- OwnRecord: its per-rank objects (`per_rank`) from its own host record, never a replica's
  (rank_record).

Whatever fails here on this rank becomes words (`failure`), not an exception: the rank still sends
what it holds and receives every object whole, so the ranks stay in step, and the next collective
carries the flag. A peer lost on the wire (live_wire.PeerLost) raises: the restart follows.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Dict, Optional

from ft_launcher.rank_monitor.rank_side.live import buddy_copy
from ft_launcher.rank_monitor.rank_side.live import live_wire as W
from ft_launcher.rank_monitor.rank_side.live.live_plan import Plan
from ft_launcher.rank_monitor.rank_side.live.transport import Arrival, RankRecovery, Transport


class KeptState(Transport):
    """A kept rank: its own committed state, in this process's memory, moves into the new objects
    (nothing crosses a wire); once all of it has, the LiveState holds it (the previous objects freed)
    and it is what this rank sends. What failed is said; it still sends what it holds."""

    def arrive(self, recovery: RankRecovery, got: Arrival) -> None:
        if not recovery.plan.kept(recovery.rank):
            return
        live, name = recovery.live, None
        try:
            for name in sorted(live.tracked):
                got.ready[name] = W.move_state(recovery.offered[name], recovery.fresh[name][0])
        except Exception as exc:  # noqa: BLE001 - said; it still sends what it holds
            got.fail(failure(name, "moving its kept state", exc))
        else:
            live._hold(recovery.plan.resume, got.ready, previous=recovery.held)
            recovery.holding = True
        if not got.failed:
            recovery.offered = got.ready


class BuddyCopyRead(Transport):
    """A rank that resumes from a buddy copy reads it from host memory (its own node's copy of its
    state, or its buddy's over the buddy copies' connections: buddy_copy.fetch): it replaces
    `got.ready`, its bytes and seconds; nothing where the plan names no copy for this rank, or
    buddy copies are off. Before the live transfers (a rank that sends one may receive a live state)."""

    def arrive(self, recovery: RankRecovery, got: Arrival) -> None:
        if recovery.buddy is None:
            return
        try:
            copied = buddy_copy.fetch(recovery.buddy, recovery.plan, recovery.copies, recovery.fresh,
                                      recovery.live._places())
        except W.ObjectFailed as exc:
            got.fail(failure(exc.name, "reading its copy", exc.error))
            copied = None
        if copied is not None:
            got.ready, got.received, got.seconds = copied


class PeerTransfer(Transport):
    """The live transfers over the process group (dist.send/recv, live_wire), in the plan's one
    global order: this rank sends each object of what it offers to the ranks that heal from it and
    receives each object whole from its source (also after one failed), into `got`."""

    def arrive(self, recovery: RankRecovery, got: Arrival) -> None:
        import torch.distributed as dist

        live, rank, device, offered, fresh = (recovery.live, recovery.rank, recovery.device, recovery.offered,
                                              recovery.fresh)
        names = sorted(live.tracked)
        t0 = time.perf_counter()
        for src, dst in recovery.plan.transfers():
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


class OwnRecord(Transport):
    """A rank that did not keep its state: its per-rank objects (`per_rank`, a loader's position)
    from its own host copy (a buddy slot of its own state: already in `got.ready`) or else from its
    record of the resume step in this node's host memory (rank_record, LiveState._records), never a
    replica's; nothing once something failed. Where neither holds them, why not (the job then
    falls back, with that line)."""

    def arrive(self, recovery: RankRecovery, got: Arrival) -> None:
        live, plan, rank = recovery.live, recovery.plan, recovery.rank
        if live.per_rank and not plan.kept(rank) and not got.failed:
            got.fail(self._read(live, plan, got.ready, recovery.fresh, rank))

    @staticmethod
    def _read(live, plan: Plan, ready: Dict[str, Any], fresh: dict, rank: int) -> str:
        """Its per-rank objects in place in `ready`. -> "" or why not."""
        src = plan.sources[rank]
        if buddy_copy.is_copy(src) and src.holder == rank and src.kind in ("slot0", "slot1"):
            return ""   # its own state's host copy: its own position with it
        names = sorted(live.per_rank)
        origin = f"buddy {src.holder}'s copy" if buddy_copy.is_copy(src) else f"peer rank {src.holder}"
        made = live._describe()
        record = live._records()
        slot, why = (record.find(plan.resume, made["own_identity"], made["own_layout"]) if record is not None
                     else (None, "it runs without ft_launcher's host records"))
        if slot is None and live.per_rank_fresh:   # (LiveState(per_rank_fresh=True): as it built them, said)
            ready.update({n: live.tracked[n].obj.state_dict() for n in names})
            print(f"ft_launcher: rank {rank}: its replicated state heals from {origin}; "
                  f"{', '.join(repr(n) for n in names)} {'starts' if len(names) == 1 else 'start'} as built "
                  f"(per_rank_fresh): {why}, none of step {plan.resume}", file=sys.stderr, flush=True)
            return ""
        if slot is None:
            return (f"its replicated state heals from {origin}, but {', '.join(repr(n) for n in names)} "
                    f"{'is' if len(names) == 1 else 'are'} its own (per_rank) and cannot come from a replica: "
                    f"{why}, none of step {plan.resume}")
        try:
            ready.update(record.read(slot, {n: fresh[n] for n in names}, live._places()))
        except W.ObjectFailed as exc:
            return failure(exc.name, "reading its per-rank record", exc.error)
        return ""



TRANSPORTS = (KeptState(), BuddyCopyRead(), PeerTransfer(), OwnRecord())   # in this order


def arrive(live, plan: Plan, held, holds: bool, fresh: dict, buddy, copies: Optional[list], device) -> Arrival:
    """This rank's state at `plan.resume` in `Arrival.ready`, and held by `live` (its previous
    LiveState `held` freed) unless something failed. `holds`: this rank offers its committed state
    (it held a clean one in the step exchange); `fresh`: the new objects as read once (step 1);
    `copies`: the buddy copies' columns of the step exchange."""
    import torch.distributed as dist

    got = Arrival()
    recovery = RankRecovery(live, plan, dist.get_rank(), held, held.committed() if holds else None, fresh, buddy,
                            copies, device)
    for transport in TRANSPORTS:
        transport.arrive(recovery, got)
    recovery.offered = None
    if not recovery.holding and not got.failed:
        live._hold(plan.resume, got.ready, previous=held)
    return got


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
