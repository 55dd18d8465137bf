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

Placement (`place`): ranks ordered by (node, local rank), each sends to the rank one node-size
further (a ring over the nodes: on 2+ nodes with the same number of ranks each, always another node).
On one node the buddy is the next local rank (the same host: it survives a rank, not the node).

Memory: at the first snapshot every rank measures its copy; the node needs 2 x (own + source's)
per rank. When that exceeds `buddy_memory_limit_mb` (default: 80 % of what the node has available
in memory and in /dev/shm), every rank turns buddy copies off and rank 0 says so in one line.

Restore (`Holdings`, `plan`, `fetch`): LiveState.restore's step exchange also carries each rank's
complete slots (step, shard, size); `plan` picks the newest step that every shard has (live in a
process, in a slot on this node, or at a buddy); a rank at that step keeps its state, one with its
own slot at that step loads it ("host copy"), one with a live replica receives from it ("peer N"),
any other receives the copy that rank N holds ("buddy N"), into one of its own slots, then loads it.
"""
from __future__ import annotations

import collections
import io
import os
import pickle
import sys
import threading
import time
import zlib
from typing import Dict, List, Optional, Tuple

from ft_launcher.rank_monitor import buddy_store as S

_ALIGN = 64
HEADER_WORDS = 8   # what an exchange says before the payload (see _Exchange)
SLOT_COLUMNS = 4   # per slot in the step exchange: step, shard, bytes, names crc
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


# ---- packing a snapshot ---------------------------------------------------------------------------
def _names_crc(names) -> int:
    return zlib.crc32("\0".join(sorted(names)).encode())


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _offsets(meta_len: int, sizes: List[int]) -> Tuple[List[int], int]:
    at, out = _aligned(meta_len), []
    for n in sizes:
        out.append(at)
        at = _aligned(at + n)
    return out, at


class _Unpickler(pickle.Unpickler):
    """A snapshot's description comes from another rank's memory: only plain containers, numbers,
    strings, torch dtypes/sizes/devices and the skeleton's slots; nothing that runs code."""

    def find_class(self, module, name):
        import torch

        from ft_launcher.rank_monitor.rank_side import live_state

        if module == "builtins" and name in ("dict", "list", "tuple", "set", "frozenset", "int", "float", "str",
                                             "bytes", "bool", "complex", "slice", "NoneType", "range"):
            return getattr(__import__("builtins"), name)
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch" and (name in ("Size", "device") or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if module == live_state.__name__ and name == "_Slot":
            return live_state._Slot
        raise pickle.UnpicklingError(f"a {module}.{name} in the state's non-tensor values")


def _loads(data: bytes):
    return _Unpickler(io.BytesIO(data)).load()


def describe(objects: Dict[str, object]):
    """(meta bytes, tensors, offsets, payload bytes) of a snapshot of `objects`' state dicts."""
    from ft_launcher.rank_monitor.rank_side import live_state

    entries, tensors = [], []
    for name in sorted(objects):
        found, paths = [], []
        skeleton = live_state._split(objects[name].state_dict(), found, (), paths)
        entries.append((name, skeleton, paths, len(tensors), [t.numel() * t.element_size() for t in found]))
        tensors.extend(found)
    meta = pickle.dumps(entries, protocol=pickle.HIGHEST_PROTOCOL)
    offsets, total = _offsets(len(meta), [n for e in entries for n in e[4]])
    return meta, tensors, offsets, total


def write_snapshot(slot: S.Slot, objects: Dict[str, object], step: int, shard: int, world: int, rank: int,
                   cycle: int) -> int:
    """Copy `objects`' state into `slot` (complete when this returns); -> the payload's bytes."""
    import torch

    from ft_launcher.rank_monitor.rank_side import live_state

    meta, tensors, offsets, total = describe(objects)
    slot.ensure(total)
    slot.begin()
    buf = slot.payload(total)
    buf[:len(meta)].copy_(torch.frombuffer(bytearray(meta), dtype=torch.uint8))
    with torch.no_grad():
        for t, at in zip(tensors, offsets):
            if t.numel():
                live_state._packed(buf, at, t).copy_(t)
    slot.finish(step, shard, world, rank, cycle, total, len(meta), _names_crc(objects))
    return total


def load_snapshot(buf, meta_len: int, objects: Dict[str, object], device) -> int:
    """Load a snapshot's payload (`buf`, a uint8 tensor) into `objects` (their own tensors where
    path, shape and dtype match); -> the bytes loaded."""
    import torch

    from ft_launcher.rank_monitor.rank_side import live_state

    entries = _loads(buf[:meta_len].numpy().tobytes())
    if sorted(e[0] for e in entries) != sorted(objects):
        raise ValueError(f"the copy holds {sorted(e[0] for e in entries)}, this LiveState {sorted(objects)}")
    offsets, total = _offsets(meta_len, [n for e in entries for n in e[4]])
    live_state._DEVICE[0] = device
    with torch.no_grad():
        for name, skeleton, paths, first, _ in entries:
            def fill(dests, first=first):
                for i, d in enumerate(dests):
                    if d.numel():
                        d.copy_(live_state._packed(buf, offsets[first + i], d))
            live_state._load(objects[name], skeleton, paths, fill)
    return total


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
            step, shard, world, origin, nbytes, meta_len, crc, cycle = (int(v) for v in got.tolist())
            inbound = c.inbound_target()
            sent = self.own.payload(self.header[4]) if self.header[4] else None
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
                inbound.finish(step, shard, world, origin, cycle, nbytes, meta_len, crc)
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

    def __init__(self, every: int, limit_bytes: Optional[int], prefix: str) -> None:
        self.every, self.limit = every, limit_bytes
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
                meta, _, _, size = describe(live.objects)
                _loads(meta)   # a copy must read back without running code: refused now, not at a restore
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
        ok, total = True, 0
        try:
            total = write_snapshot(own, live.objects, step, live.shard, self.world, self.rank, self.cycle)
        except Exception as exc:  # noqa: BLE001 - the exchange still runs (empty): its barrier turns every rank off
            ok, total = False, 0
            self.note(f"rank {self.rank} cannot copy its state ({type(exc).__name__}: {exc})")
        t2 = time.perf_counter()
        header = [step, live.shard, self.world, self.rank, total, own.words[S.W_META] if ok else 0,
                  _names_crc(live.objects), self.cycle]
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

    def own_target(self) -> S.Slot:
        return _older([self.slots.slots[i] for i in S.OWN])

    def inbound_target(self) -> S.Slot:
        return _older([self.slots.slots[i] for i in S.INBOUND])

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
            need[node] += 2 * per_rank[r] + 2 * per_rank[self.source_of[r]]
            room[node] = min(room.get(node, min(table[r][2], table[r][3])), min(table[r][2], table[r][3]))
            held[node] += table[r][1]
        refusal = None
        for node in sorted(need):
            have = room[node] + held[node]
            allowed = self.limit if self.limit is not None else int(have * DEFAULT_HOST_FRACTION)
            if need[node] > min(allowed, have):
                why = ("buddy_memory_limit_mb" if self.limit is not None and self.limit <= have
                       else f"{int(DEFAULT_HOST_FRACTION * 100)} % of {_mb(have)} available in memory and /dev/shm")
                refusal = (f"node {node} would need {_mb(need[node])} of host memory for its ranks' copies (2 of "
                           f"each rank's own state + 2 of its buddy's), more than the {_mb(min(allowed, have))} it "
                           f"may use ({why})")
                break
        if self.rank == 0:
            if refusal is not None:
                _say(f"buddy copies off: {refusal}; a lost rank without a replica falls back to the checkpoint")
            else:
                node = self.nodes[0]
                where = ("the buddy is on the same node (one node: a copy survives its rank, not the node)"
                         if self.same_node else "each buddy on another node")
                _say(f"buddy copies every {self.every} step(s): {_mb(sizes[0])} of state on rank 0 (largest "
                     f"{_mb(max(sizes))}); host memory per rank: its 2 own copies + 2 of its buddy's; node {node} "
                     f"{_mb(need[node])} of {_mb(room[node] + held[node])} available; {where}")
        return refusal is None

    def stats(self) -> dict:
        return {"every": self.every, "snapshots": self.snapshots, "bytes": self.bytes,
                "copy_s": round(self.copy_s, 6), "wait_s": round(self.wait_s, 6),
                "exchange_s": round(self.exchange_s, 6), "on": self.on, "buddy": self.dst}

    def close(self, join_for: float = 0.0) -> None:
        """The cycle ends (a restart's teardown or the job's end): the exchange in flight, if any,
        is left to fail with the group (at most `join_for` s waited for); the mappings go with
        the thread's end."""
        ex, self.pending = self.pending, None
        self.on = False
        if ex is not None:
            ex.join(join_for)
            if ex.is_alive():
                return   # its slots stay mapped until the process ends (never unmapped under a copy)
        self.slots.close()


def _older(slots) -> S.Slot:
    """Of two slots, the one to write next: an empty or torn one, else the older copy."""
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
def holdings(slots: S.SlotSet, world: int, objects) -> List[int]:
    """This rank's part of the step exchange: per slot (own0, own1, in0, in1) the step, shard,
    payload bytes and description bytes of the complete copy it holds for a job of `world` ranks
    with these objects' names, else -1, -1, 0, 0."""
    crc = _names_crc(objects)
    row: List[int] = []
    for slot in slots.slots:
        h = slot.header()
        if h is None or h["world"] != world or h["names"] != crc:
            row += [-1, -1, 0, 0]
        else:
            row += [h["step"], h["shard"], h["nbytes"], h["meta"]]
    return row


def copies_of(rows: List[List[int]]) -> List[List[Tuple[int, int, int]]]:
    """Per rank, its complete copies as (slot index, step, shard), from the exchanged rows."""
    out = []
    for row in rows:
        out.append([(i, row[i * SLOT_COLUMNS], row[i * SLOT_COLUMNS + 1]) for i in range(len(S.SLOT_NAMES))
                    if row[i * SLOT_COLUMNS] >= 0])
    return out


def plan(steps: List[int], shards: List[int], copies: List[List[Tuple[int, int, int]]]):
    """Who resumes where, from each rank's completed step in memory (-1: none usable), its shard,
    and the copies in its node's memory (`copies_of`). The resume step is the newest step every
    shard has, live or as a copy. Per rank, its source: itself (kept), ("copy", itself, slot) (its
    host copy), a rank at that step of the same shard (a live replica, round robin), else
    ("copy", N, slot): the copy rank N holds (round robin over the holders).
    -> (resume step, sources, reason); (None, [None] * n, why) when no step is held by every shard."""
    n = len(steps)
    wanted = set(shards)
    live: Dict[int, Dict[int, List[int]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    held: Dict[int, Dict[int, List[Tuple[int, int]]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in range(n):
        if steps[r] >= 0:
            live[steps[r]][shards[r]].append(r)
        for slot, step, shard in copies[r]:
            held[step][shard].append((r, slot))
    candidates = sorted(set(live) | set(held), reverse=True)
    resume = next((c for c in candidates if wanted <= set(live[c]) | set(held[c])), None)
    if resume is None:
        return None, [None] * n, _why_not(wanted, live, held)
    sources: list = [None] * n
    turn: Dict[int, int] = collections.defaultdict(int)
    for r in range(n):
        shard = shards[r]
        mine = [slot for slot, step, sh in copies[r] if step == resume and sh == shard]
        if steps[r] == resume:
            sources[r] = r
        elif mine:
            sources[r] = ("copy", r, mine[0])
        elif live[resume][shard]:
            group = live[resume][shard]
            sources[r] = group[turn[shard] % len(group)]
            turn[shard] += 1
        else:
            group = [h for h in held[resume][shard] if h[0] != r]
            q, slot = group[turn[shard] % len(group)]
            sources[r] = ("copy", q, slot)
            turn[shard] += 1
    return resume, sources, ""


def _why_not(wanted, live, held) -> str:
    if not live and not held:
        return "no rank holds live state or a buddy copy (a cold or job-level restart, or a first start)"
    steps_of = {s: sorted({c for c in set(live) | set(held) if s in live[c] or s in held[c]}) for s in wanted}
    lost = sorted(s for s, at in steps_of.items() if not at)
    if lost:
        return (f"no rank holds shard {', '.join(map(str, lost))} in memory, live or as a buddy copy (its rank and "
                f"the rank holding its copy were both lost: a node and its buddy's node)")
    common = ", ".join(f"shard {s} at {at[0]}-{at[-1]}" for s, at in sorted(steps_of.items()))
    return f"no step is held by every shard ({common})"


def source_name(rank: int, source) -> Optional[str]:
    """'host copy' or 'buddy N' for a copy source; None for the others."""
    if isinstance(source, tuple):
        return "host copy" if source[1] == rank else f"buddy {source[1]}"
    return None


def fetch(copy: "BuddyCopy", objects, sources: list, resume: int, rows: List[List[int]], shard: int, device):
    """The copy sources of a restore plan, over the buddy group: every rank sends the slots others
    receive from it, a rank whose source is another rank's copy receives it into one of its own
    slots (one no other rank reads now, else a staging buffer), and a rank with a copy source
    loads it. -> (bytes this rank got, from a buddy or its host copy; seconds from the start to
    its state loaded)."""
    import torch
    import torch.distributed as dist

    rank, world = copy.rank, copy.world
    mine = sources[rank]
    sends = [(dst, src[2]) for dst, src in enumerate(sources)
             if isinstance(src, tuple) and src[1] == rank and dst != rank]
    t0 = time.perf_counter()
    works, target, into = [], None, None
    if isinstance(mine, tuple):
        q, j = mine[1], mine[2]
        nbytes, meta_len = rows[q][j * SLOT_COLUMNS + 2], rows[q][j * SLOT_COLUMNS + 3]
        if q == rank:
            into = copy.slots.slots[j].payload(nbytes)
        else:
            busy = {src[2] for src in sources if isinstance(src, tuple) and src[1] == rank}
            free = [i for i in S.OWN if i not in busy]
            if free:
                target = copy.slots.slots[free[0]]
                target.ensure(nbytes)
                target.begin()
                into = target.payload(nbytes)
            else:
                into = torch.empty(nbytes, dtype=torch.uint8)
            works.append(dist.irecv(into, q, group=copy.group))
    for dst, j in sends:
        works.append(dist.isend(copy.slots.slots[j].payload(rows[rank][j * SLOT_COLUMNS + 2]), dst, group=copy.group))
    for w in works:
        w.wait()
    if not isinstance(mine, tuple):
        return 0, 0.0
    if target is not None:   # the received copy is this rank's host copy of the resume step from now on
        target.finish(resume, shard, world, rank, copy.cycle, nbytes, meta_len, _names_crc(objects))
    load_snapshot(into, meta_len, objects, device)
    return nbytes, time.perf_counter() - t0
