"""Buddy copies: each rank's committed state also lives in the host memory of a rank on another
node, so a rank without a live replica (pure FSDP, TP, PP) and a whole lost node resume from
memory instead of the checkpoint. `ft.LiveState(..., buddy_every=K)`; the guide is
docs/live-state.md ("Buddy copies").

Every K steps, at the end of `LiveState.commit(step)` (after the step counts as completed):
1. the rank waits for its previous exchange (below) if it is still in flight: the only time a
   step waits for a buddy copy;
2. it copies its state (every object's `state_dict()`: a pickled description, then its tensors'
   bytes) into its own slot file in this node's shared memory (rank_monitor.buddy_store): the copy
   that outlives the rank's process;
3. a background thread sends that copy to its buddy (a rank on the next node, over a dedicated
   gloo group) and receives its source's copy into an inbound slot, then joins a job-wide barrier
   on that group: once it passes, every rank's copy of the step is complete at its buddy.
Each rank keeps its two newest snapshots and its source's two newest copies (4 slots: own state x
2 + buddy's x 2 in host memory), and a rank overwrites its older snapshot only after the barrier of
the newer one. So whenever a node is lost, one step exists for every rank on a surviving node:
the newest complete copy everywhere, which the survivors still hold in their own slots. A rank
whose process dies while its node lives restores from its own slot ("host copy").

`buddy_keep=1` halves that (one own snapshot + one copy of its source: 2 x the rank's state): each
rank then overwrites its only snapshot at the next copy, so from that moment until the exchange's
barrier a lost node finds no step that every rank holds (the survivors' own copies are of the new
step, the lost ranks' of the old or torn), and the job falls back to the checkpoint, saying so.
A rank whose process dies finds its own copy of its last commit (written inside the commit) as
before. Less cannot keep a lost node exact: the survivors must go back to the step whose copy the
lost ranks left on another node, so each needs its own state of that step (one copy) beside the
copy it holds for another rank (a second), unless copies are taken at every step and nothing
steps past them (the window is then the whole step).

Placement (`place`): ranks ordered by (node, local rank), each sends to the rank one node-size
further (a ring over the nodes: on 2+ nodes with the same number of ranks each, always another node).
On one node the buddy is the next local rank (the same host: it survives a rank, not the node).

Memory: at the first snapshot every rank measures its copy; the node needs keep x (own + source's)
per rank (keep: `buddy_keep`, 2 by default). When that exceeds `buddy_memory_limit_mb` (default: 80 % of what the node has available
in memory and in /dev/shm), every rank turns buddy copies off and rank 0 says so in one line.

A copy is each object's committed state written as live_wire would send it to a peer (message
after message into the slot), so reading it back is a peer transfer without the wire: the same
skeleton (unpickled without running code), the same layout checks, tensors landing in the new
objects' own tensors.

Restore (`holdings`, `offers`, `fetch`): LiveState.restore's step exchange also carries each rank's
complete slots (step, shard identity, layout, size), offered to the plan (live_plan) beside the
processes' committed states: the job resumes at the newest step every rank's need is met at; a
rank at that step keeps its state, one with its own copy of it loads that ("host copy"), one with a
live replica receives from it ("peer N"), any other receives the copy rank N holds ("buddy N": over
the buddy group into one of its own slots, then read like a host copy). A restore that falls back
to the checkpoint abandons every copy held (`abandon`): the job's timeline starts again at the
checkpoint, and a copy of a later step of the old one is never offered (it would resume the job
forward onto the timeline it left).

Trust: the slot files lie in the agent's own 0700 directory; one that is not this user's, a
symbolic link, or open to group or others is refused in one line and never loaded
(rank_monitor.buddy_store).
"""
from __future__ import annotations

import collections
import os
import sys
import threading
import time
from typing import Dict, List, Optional, Tuple

from ft_launcher.rank_monitor import buddy_store as S
from ft_launcher.rank_monitor.rank_side.live import live_wire as W

_ALIGN = 64
HEADER_WORDS = 8   # what an exchange says before the payload (see _Exchange)
SLOT_COLUMNS = 4   # per slot in the step exchange: step, identity, layout, bytes
DEFAULT_HOST_FRACTION = 0.8


def _say(text: str) -> None:
    print(f"ft_launcher: {text}", file=sys.stderr, flush=True)


def _mb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


# ---- placement ----------------------------------------------------------------------------------
def place(nodes: List[int], local_ranks: List[int]) -> List[int]:
    """Each rank's buddy (the rank that holds its copy), from each rank's node and local rank:
    ranks ordered by (node, local rank) and shifted by the size of the largest node (by one on a
    single node), a permutation. A rank is its own buddy only in a job of one rank."""
    world = len(nodes)
    order = sorted(range(world), key=lambda r: (nodes[r], local_ranks[r], r))
    sizes = collections.Counter(nodes)
    shift = max(sizes.values()) if len(sizes) > 1 else 1
    dst = [0] * world
    for i, r in enumerate(order):
        dst[r] = order[(i + shift) % world]
    return dst


# ---- a snapshot in a slot ---------------------------------------------------------------------------
def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class _Stream:
    """live_wire's messages (send_state/recv_state) written into or read from a slot's payload, one
    after the other, each at a 64-byte boundary: a snapshot is what a peer would be sent."""

    def __init__(self, slot: S.Slot) -> None:
        self.slot, self.at = slot, 0

    def send(self, t) -> None:
        n = t.numel() * t.element_size()
        if self.at + n > self.slot.capacity:
            self.slot.ensure(self.at + n)   # (the data so far stays: the file only grows)
        if n:
            self.slot.payload(n, self.at).copy_(t.reshape(-1).view(_uint8()))
        self.at = _aligned(self.at + n)

    def recv(self, t) -> None:
        n = t.numel() * t.element_size()
        if self.at + n > self.slot.capacity:
            raise ValueError(f"a copy in {self.slot.path} ends before its last message")
        if n:
            t.view(-1).view(_uint8()).copy_(self.slot.payload(n, self.at))
        self.at = _aligned(self.at + n)


def _uint8():
    import torch

    return torch.uint8


def estimate(states: Dict[str, dict]) -> int:
    """An upper bound of a snapshot's payload bytes (without copying a tensor)."""
    total = 0
    for name in sorted(states):
        skeleton, tensors, paths = W.split(states[name])
        total += 2 * _ALIGN + _aligned(len(W.dumps(skeleton, paths)))
        total += sum(_aligned(t.numel() * t.element_size()) + _ALIGN for t in tensors)
    return total


def write_snapshot(slot: S.Slot, states: Dict[str, dict], step: int, identity: int, layout: int, world: int,
                   rank: int, cycle: int) -> int:
    """Copy committed `states` (name -> state dict) into `slot`, complete when this returns; ->
    the payload's bytes."""
    import torch

    slot.ensure(estimate(states))
    slot.begin()
    stream = _Stream(slot)
    with torch.no_grad():
        for name in sorted(states):
            W.send_state(states[name], torch.device("cpu"), stream.send)
    slot.finish(step, identity, layout, world, rank, cycle, stream.at)
    return stream.at


def read_snapshot(slot: S.Slot, fresh: Dict[str, tuple], device, places: Optional[dict] = None
                  ) -> Tuple[Dict[str, dict], int]:
    """A snapshot's states, each tensor written into the new object's own tensor of its path
    (fresh[name][0], as from a peer: live_wire.recv_state, its layout checked; a DTensor's placed
    by places[name], live_objects.Tracked.place). Raises live_wire.ObjectFailed (which object, its
    error) where one cannot be read. -> (name -> state dict, bytes)."""
    import torch

    stream, ready, total = _Stream(slot), {}, 0
    with torch.no_grad():
        for name in sorted(fresh):
            try:
                ready[name], nbytes = W.recv_state(fresh[name][0], torch.device("cpu"), stream.recv,
                                                   (places or {}).get(name))
            except Exception as exc:  # noqa: BLE001 - a copy that does not fit: the caller falls back
                raise W.ObjectFailed(name, exc) from exc
            total += nbytes
    return ready, total


# ---- the exchange with the buddies ----------------------------------------------------------------
class _Exchange(threading.Thread):
    """One snapshot's exchange: this rank's own slot to its buddy, its source's into an inbound slot,
    then the job-wide barrier (an all_reduce that also says whether every rank could hold its copies)."""

    def __init__(self, copy: "BuddyCopy", own: S.Slot, header: List[int], ok: bool) -> None:
        super().__init__(name="ft-buddy-copy", daemon=True)
        self.copy, self.own, self.header, self.ok = copy, own, header, ok
        self.error: Optional[BaseException] = None
        self.all_ok = True
        self.seconds = 0.0

    def run(self) -> None:
        import torch
        import torch.distributed as dist

        c = self.copy
        t0 = time.perf_counter()
        try:
            out = torch.tensor(self.header, dtype=torch.int64)
            got = torch.empty(HEADER_WORDS, dtype=torch.int64)
            _pair(dist, out, got, c.dst, c.src, c.group)
            step, identity, layout, world, origin, nbytes, cycle, _ = (int(v) for v in got.tolist())
            inbound = c.inbound_target()
            sent = self.own.payload(self.header[5]) if self.header[5] else None
            if nbytes:
                try:
                    inbound.ensure(nbytes)
                    inbound.begin()
                    into = inbound.payload(nbytes)
                except OSError as exc:
                    self.ok = False
                    c.note(f"rank {c.rank} cannot hold rank {c.src}'s copy ({exc})")
                    inbound = None
                    into = torch.empty(nbytes, dtype=torch.uint8)   # drained, then dropped
            else:
                inbound, into = None, None
            _pair(dist, sent, into, c.dst, c.src, c.group)
            if inbound is not None:
                inbound.finish(step, identity, layout, world, origin, cycle, nbytes)
            flag = torch.tensor([1 if self.ok else 0], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=c.group)
            self.all_ok = bool(flag.item())
        except BaseException as exc:  # noqa: BLE001 - a peer gone (a restart follows) or the group destroyed
            self.error = exc
        self.seconds = time.perf_counter() - t0


def _pair(dist, out, into, dst: int, src: int, group) -> None:
    """Send `out` to dst and receive `into` from src at once (either may be None: nothing that way)."""
    works = []
    if into is not None:
        works.append(dist.irecv(into, src, group=group))
    if out is not None:
        works.append(dist.isend(out, dst, group=group))
    for w in works:
        w.wait()


class BuddyCopy:
    """The buddy copies of this process's LiveState for one cycle (see the module docstring)."""

    def __init__(self, every: int, limit_bytes: Optional[int], prefix: str, keep: int = 2) -> None:
        self.every, self.limit, self.keep = every, limit_bytes, keep
        self.prefix = prefix
        self.slots = S.SlotSet(prefix)
        self.on = False
        self.group = None
        self.rank = self.world = self.dst = self.src = 0
        self.cycle = 0
        self.same_node = False
        self.measured = False
        self.pending: Optional[_Exchange] = None
        self.notes: List[str] = []
        # figures (bench/live_recovery.py reads them through LiveState.buddy_stats)
        self.snapshots, self.copy_s, self.wait_s, self.exchange_s, self.bytes = 0, 0.0, 0.0, 0.0, 0

    def note(self, text: str) -> None:
        self.notes.append(text)

    # ---- set-up (a collective: LiveState.restore on every rank) ----------------------------------
    def setup(self, cycle: int) -> None:
        import torch
        import torch.distributed as dist

        self.cycle = cycle
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.group = dist.new_group(backend="gloo")
        node, local = int(os.environ.get("GROUP_RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
        table = _gather(torch.tensor([node, local], dtype=torch.int64), self.world, self.group)
        self.nodes = [r[0] for r in table]
        self.buddy_of = place(self.nodes, [r[1] for r in table])
        self.source_of = [0] * self.world
        for r, d in enumerate(self.buddy_of):
            self.source_of[d] = r
        self.dst, self.src = self.buddy_of[self.rank], self.source_of[self.rank]
        self.same_node = self.nodes[self.dst] == self.nodes[self.rank]
        self.on = self.world > 1
        if not self.on and self.rank == 0:
            _say("buddy copies off: a job of one rank has no buddy")

    # ---- every K steps ----------------------------------------------------------------------------
    def after_commit(self, live, step: int) -> None:
        if not self.on or step % self.every:
            return
        t0 = time.perf_counter()
        self.wait()
        if not self.on:
            return
        if not self.measured:   # the first copy: every rank's size against what its node has
            self.measured = True
            try:
                size = estimate(live.committed_states())
            except Exception as exc:  # noqa: BLE001 - whatever the state holds: said, and the copies go off
                size = -1
                _say(f"buddy copies off: rank {self.rank} cannot copy its state: {type(exc).__name__}: {exc}")
            if not self._measure(size):
                self.on = False
                self.slots.close()
                S.remove(self.prefix)   # nothing of it is kept: the memory goes back now
                return
        t1 = time.perf_counter()
        own = self.own_target()
        made = live.described()
        ok, total = True, 0
        try:
            total = write_snapshot(own, live.committed_states(), step, made["identity"], made["layout"], self.world,
                                   self.rank, self.cycle)
        except Exception as exc:  # noqa: BLE001 - the exchange still runs (empty): its barrier turns every rank off
            ok, total = False, 0
            self.note(f"rank {self.rank} cannot copy its state ({type(exc).__name__}: {exc})")
        t2 = time.perf_counter()
        header = [step, made["identity"], made["layout"], self.world, self.rank, total, self.cycle, 0]
        self.pending = _Exchange(self, own, header, ok)
        self.pending.start()
        self.snapshots += 1
        self.bytes = total
        self.wait_s += t1 - t0
        self.copy_s += t2 - t1

    def wait(self) -> None:
        """Until the exchange in flight is done (its copies complete everywhere)."""
        ex, self.pending = self.pending, None
        if ex is None:
            return
        ex.join()
        self.exchange_s += ex.seconds
        if ex.error is not None:
            self.on = False   # a peer is gone: a restart is on its way; the next cycle sets up again
        elif not ex.all_ok:
            self.on = False
            for text in self.notes:
                _say(f"buddy copies off: {text}")
            if self.rank == 0:
                _say("buddy copies off from now on: a rank could not hold its copies (its line says why); "
                     "a lost rank without a replica falls back to the checkpoint")

    def abandon(self) -> None:
        """A fallback to the checkpoint (LiveState.restore returns None on every rank): every copy
        this rank holds is of the timeline the job leaves, and is never offered again (the exchange
        in flight, if any, first: a re-run's; buddy_store.SlotSet.abandon)."""
        self.wait()
        self.slots.abandon(self.cycle)

    def own_target(self) -> S.Slot:
        return _older([self.slots.slots[i] for i in S.OWN[:self.keep]])

    def inbound_target(self) -> S.Slot:
        return _older([self.slots.slots[i] for i in S.INBOUND[:self.keep]])

    def _measure(self, total: int) -> bool:
        """The first snapshot: every rank's copy size and what its node has; every rank decides
        the same (buddy copies on or off); rank 0 says it in one line."""
        import torch

        mem = S.host_memory()
        mine = [total, self.slots.allocated(), mem["available"], mem["shm_free"]]
        table = _gather(torch.tensor(mine, dtype=torch.int64), self.world, self.group)
        sizes = [row[0] for row in table]
        if min(sizes) < 0:
            if self.rank == 0:
                _say("buddy copies off: a rank cannot copy its state (its line says why); a lost rank without a "
                     "replica falls back to the checkpoint")
            return False
        per_rank = [S.file_bytes(n) for n in sizes]
        need: Dict[int, int] = collections.defaultdict(int)
        room: Dict[int, int] = {}
        held: Dict[int, int] = collections.defaultdict(int)   # the node's slot files already there count as room
        for r in range(self.world):
            node = self.nodes[r]
            need[node] += self.keep * (per_rank[r] + per_rank[self.source_of[r]])
            room[node] = min(room.get(node, min(table[r][2], table[r][3])), min(table[r][2], table[r][3]))
            held[node] += table[r][1]
        refusal = None
        for node in sorted(need):
            have = room[node] + held[node]
            allowed = self.limit if self.limit is not None else int(have * DEFAULT_HOST_FRACTION)
            if need[node] > min(allowed, have):
                why = ("buddy_memory_limit_mb" if self.limit is not None and self.limit <= have
                       else f"{int(DEFAULT_HOST_FRACTION * 100)} % of {_mb(have)} available in memory and /dev/shm")
                refusal = (f"node {node} would need {_mb(need[node])} of host memory for its ranks' copies "
                           f"({self._kept_words()}), more than the {_mb(min(allowed, have))} it may use ({why})")
                break
        if self.rank == 0:
            if refusal is not None:
                _say(f"buddy copies off: {refusal}; a lost rank without a replica falls back to the checkpoint")
            else:
                node = self.nodes[0]
                where = ("the buddy is on the same node (one node: a copy survives its rank, not the node)"
                         if self.same_node else "each buddy on another node")
                _say(f"buddy copies every {self.every} step(s): {_mb(sizes[0])} of state on rank 0 (largest "
                     f"{_mb(max(sizes))}); host memory per rank: {self._kept_words()}; node {node} "
                     f"{_mb(need[node])} of {_mb(room[node] + held[node])} available; {where}")
        return refusal is None

    def _kept_words(self) -> str:
        return ("its 2 own copies + 2 of its buddy's" if self.keep == 2 else
                "its own copy + 1 of its buddy's (buddy_keep=1)")

    def window_words(self) -> str:
        """What a fallback's line adds with buddy_keep=1 (the copy window, module docstring), else ''."""
        return ("; with buddy_keep=1 a node lost while a copy is being replaced finds no step every rank holds "
                "(buddy_keep=2 keeps one)" if self.keep == 1 else "")

    def stats(self) -> dict:
        return {"every": self.every, "keep": self.keep, "snapshots": self.snapshots, "bytes": self.bytes,
                "copy_s": round(self.copy_s, 6), "wait_s": round(self.wait_s, 6),
                "exchange_s": round(self.exchange_s, 6), "on": self.on, "buddy": self.dst,
                "held_bytes": self.slots.allocated()}   # the slot files this rank maps (own + its source's)

    def close(self, join_for: float = 0.0) -> None:
        """The cycle ends (a restart's teardown or the job's end): the exchange in flight, if any,
        is left to fail with the group (at most `join_for` s waited for); the mappings go with
        the thread's end. One still running is kept in LEFT: the rank's end waits for it (join_left)."""
        ex, self.pending = self.pending, None
        self.on = False
        if ex is not None:
            ex.join(join_for)
            if ex.is_alive():
                LEFT.append(ex)
                return   # its slots stay mapped until the process ends (never unmapped under a copy)
        self.slots.close()


LEFT: List[_Exchange] = []   # exchanges a cycle's end left running (close): their threads are inside torch


def join_left(timeout: float) -> None:
    """Wait, at most `timeout` s in all, for the exchanges a cycle's end left running."""
    deadline = time.monotonic() + timeout
    while LEFT:
        LEFT[0].join(max(0.0, deadline - time.monotonic()))
        if LEFT[0].is_alive():
            return
        LEFT.pop(0)


def _older(slots) -> S.Slot:
    """Of the slots kept (one or two), the one to write next: an empty or torn one, else the older copy."""
    if len(slots) == 1:
        return slots[0]
    a, b = slots
    ha, hb = a.header(), b.header()
    if ha is None:
        return a
    if hb is None:
        return b
    return a if (ha["cycle"], ha["step"]) <= (hb["cycle"], hb["step"]) else b


def _gather(t, world: int, group) -> list:
    import torch.distributed as dist
    import torch

    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t, group=group)
    return [o.tolist() for o in out]


# ---- restore -------------------------------------------------------------------------------------
def holdings(slots: S.SlotSet, world: int) -> List[int]:
    """This rank's part of the step exchange: per slot (own0, own1, in0, in1) the step, shard
    identity and layout digests and payload bytes of the complete copy it holds for a job of
    `world` ranks, else -1, 0, 0, 0."""
    row: List[int] = []
    for slot in slots.slots:
        h = slot.header()
        row += [-1, 0, 0, 0] if h is None or h["world"] != world else \
            [h["step"], h["identity"], h["layout"], h["nbytes"]]
    return row


def offers(rows: List[List[int]]) -> list:
    """The copies every rank holds, as offers to the plan (live_plan.Offer of kind 'slot<i>')."""
    from ft_launcher.rank_monitor.rank_side.live.live_plan import Offer

    out = []
    for r, row in enumerate(rows):
        for i in range(len(S.SLOT_NAMES)):
            step, identity, layout = row[i * SLOT_COLUMNS:i * SLOT_COLUMNS + 3]
            if step >= 0:
                out.append(Offer(r, step, identity, layout, f"slot{i}"))
    return out


def is_copy(offer) -> bool:
    return offer is not None and offer.kind.startswith("slot")


def source_name(rank: int, offer) -> str:
    """'host copy' (this rank's own copy on its node) or 'buddy N' (the copy rank N holds)."""
    return "host copy" if offer.holder == rank else f"buddy {offer.holder}"


def unmet_text(needs, offers_, ranks_text) -> str:
    """The fallback's words when buddy copies were on: the ranks whose shard no rank holds at any
    step, live or as a copy (a node and its buddy's node lost), else ''."""
    have = {o.identity for o in offers_}
    lost = [r for r, need in enumerate(needs) if need.identity not in have]
    if not lost:
        return ""
    return (f"no rank holds the shard {ranks_text(lost)} need{'s' if len(lost) == 1 else ''} in memory at any step, "
            f"live or as a buddy copy (its rank and the rank holding its copy were both lost: a node and its "
            f"buddy's node)")


def fetch(copy: "BuddyCopy", plan, rows: List[List[int]], fresh: Dict[str, tuple], places: Optional[dict] = None):
    """The copy sources of a restore plan, over the buddy group: every rank sends the slots others
    receive from it, a rank whose source is another rank's copy receives it into one of its own
    slots (one no other rank reads now, else a staging file) and reads it like its host copy
    (read_snapshot: ObjectFailed where an object's copy does not fit; live_wire.PeerLost where the
    transfer failed). -> (name -> state dict, bytes, seconds) for a rank whose source is a copy,
    else None."""
    import torch.distributed as dist

    rank = copy.rank
    mine = plan.sources[rank]
    t0 = time.perf_counter()
    works, source = [], None
    if is_copy(mine):
        j = int(mine.kind[4:])
        nbytes = rows[mine.holder][j * SLOT_COLUMNS + 3]
        if mine.holder == rank:
            source = copy.slots.slots[j]
        else:
            busy = {int(o.kind[4:]) for o in plan.sources if is_copy(o) and o.holder == rank}
            free = [i for i in S.OWN[:copy.keep] if i not in busy] if copy.slots.refused is None else []
            source = copy.slots.slots[free[0]] if free else S.Slot(copy.prefix + "_staging") \
                if copy.slots.refused is None else S.Slot.anonymous(nbytes)   # (no file in a refused directory)
            source.ensure(nbytes)
            source.begin()
            works.append(dist.irecv(source.payload(nbytes), mine.holder, group=copy.group))
    for dst, o in enumerate(plan.sources):
        if is_copy(o) and o.holder == rank and dst != rank:
            j = int(o.kind[4:])
            works.append(dist.isend(copy.slots.slots[j].payload(rows[rank][j * SLOT_COLUMNS + 3]), dst,
                                    group=copy.group))
    try:
        for w in works:
            w.wait()
    except Exception as exc:  # noqa: BLE001 - whatever the backend raises
        raise W.PeerLost(f"a buddy copy's transfer failed: {type(exc).__name__}: {exc}") from exc
    if source is None:
        return None
    if mine.holder != rank:   # what it received is its host copy of the resume step from now on
        source.finish(mine.step, mine.identity, mine.layout, copy.world, rank, copy.cycle, nbytes)
    try:
        ready, total = read_snapshot(source, fresh, None, places)
    finally:
        if source not in copy.slots.slots:
            source.close()
            if source.refused is None:
                os.unlink(source.path)
    return ready, total, time.perf_counter() - t0
