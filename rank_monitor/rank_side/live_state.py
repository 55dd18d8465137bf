"""Live state: after an in-place restart, healthy ranks keep their training state in memory and
replaced ranks heal from a data-parallel peer, so a failure costs the step in flight, not the work
since the last checkpoint. `ft_launcher.LiveState`; the user guide is docs/live-state.md.

    live = ft.LiveState(model=model, optimizer=opt, scheduler=sched)   # state_dict/load_state_dict
    start = live.restore()      # after init_process_group, BEFORE DDP is constructed
    if start is None: start = load_checkpoint()                        # no live state: as today
    for step in range(start + 1, steps + 1):
        ... forward / backward ...
        with live.commit(step):
            opt.step(); sched.step()

How it works:
- `commit(step)`: a restart signal that lands inside waits for its end (rank_monitor.rank_side.inprocess);
  on a clean exit `step` is completed: one word of the rank's record (H_LIVE_STEP), no syscall.
  An exception out of the body leaves the state suspect (it may be half-updated).
- Across calls of the restartable function the previous call's objects stay in a module-level
  registry; their tensors are at the last completed step, since only `commit` changes them.
- `restore()` (cycle > 0 only): one all_gather over the default process group of each rank's
  completed step and shard; -1 for a new process, a suspect rank, or one whose function raised by
  itself. plan_recovery: the job resumes at the highest completed step; each shard position
  needs a rank that holds it (else every rank returns None: the script's checkpoint, and global
  rank 0 prints one line saying why); a rank at that step keeps its state (copied from its
  previous objects into the new ones); the others receive it from a holder of the same shard,
  spread round robin over the holders. Transfer, per object: a pickled skeleton of its state
  dict (every non-tensor value), then its tensors in few messages: those under 1 MiB packed into
  one reused staging buffer of at most 16 MiB (as many fills as they need), each larger one sent by
  itself; received in place into the new object's own tensor where path, shape and dtype match (a
  DTensor's local shard), else into a new one; then `load_state_dict`. A second all_gather
  collects what each rank received and how long it
  took (`transfer_s`: the slowest receiver's; `restore_s`: the slowest rank's time from the step
  exchange to its state loaded); global rank 0 writes the summary (JSON) into its record for the agent, which says it as one
  `live_recovery` event and console line (agent.recovery.live_recovery).
- `buddy_every=K` (rank_monitor.rank_side.buddy_copy): every K steps the commit also copies the
  state into host memory, this node's and a buddy rank's on another node; the step exchange then
  also carries each rank's copies, and the plan resumes at the newest step every shard has, live or
  as a copy (a rank without a live replica, or on a spare node after a lost one, loads a copy).
- Outside ft_launcher, under torchrun or plain python, outside `ft.restartable`, or with
  `--restart-granularity job`: `restore()` returns None and `commit` only runs its body.

Limits: the state must be what `state_dict` returns; changes made outside `commit` (e.g. BatchNorm
running statistics updated by the step in flight's forward) are kept as they are. Data position:
pass a stateful sampler/dataloader, or derive the batch from the step.
"""
from __future__ import annotations

import collections
import json
import os
import pickle
import random
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

from ft_launcher.rank_monitor.rank_side import buddy_copy, inprocess
from ft_launcher.rank_monitor import buddy_store
from ft_launcher.rank_monitor import shm_layout as L

NOT_HELD = -1


class _Registry:
    """What survives between calls of the restartable function (this process only)."""

    def __init__(self) -> None:
        self.current: Optional["LiveState"] = None   # the running call's LiveState
        self.cycle: Optional[int] = None             # the cycle it was made in
        self.previous: Optional["LiveState"] = None  # the previous call's, until restore() used it
        self.step = NOT_HELD                         # the last step `commit` completed
        self.dirty = False                           # an exception left a commit: state suspect
        self.buddy = None                            # this cycle's buddy copies (rank_side.buddy_copy), if on
        self.said_job = False                        # the granularity-job line was said


_REG = _Registry()


def _cycle() -> int:
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    except ValueError:
        return 0


class _Rng:
    """The RNG state as of the last commit (torch's CPU and CUDA generators, Python's `random`)."""

    def __init__(self) -> None:
        self.saved: Optional[dict] = None

    def snapshot(self) -> None:
        import torch

        state = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        self.saved = state

    def state_dict(self) -> dict:
        if self.saved is None:
            self.snapshot()
        return self.saved

    def load_state_dict(self, state: dict) -> None:
        import torch

        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
        self.saved = state


class _Commit:
    """The context manager `LiveState.commit(step)` returns (one per LiveState: no allocation)."""

    __slots__ = ("live", "step")

    def __init__(self, live: "LiveState") -> None:
        self.live, self.step = live, 0

    def __enter__(self):
        if self.live._words is not None:
            inprocess._STATE.in_commit = True
        return self

    def __exit__(self, exc_type, exc, tb):
        words = self.live._words
        if words is None:
            return False
        if exc_type is None:
            if self.live._rng is not None:
                self.live._rng.snapshot()
            _REG.step = self.step
            _REG.dirty = False
            words[L.H_LIVE_STEP] = self.step + 1
        else:
            _REG.dirty = True
        inprocess.commit_done()   # a restart signal that arrived inside: RestartInPlace now
        if exc_type is None and self.live._buddy is not None:
            self.live._buddy.after_commit(self.live, self.step)   # every K steps: the copy (it may wait)
        return False


class LiveState:
    """The training state that survives an in-place restart (see the module docstring).

    `LiveState(model=..., optimizer=..., scheduler=..., ...)`: any number of named objects with
    `state_dict()` / `load_state_dict()`. Keywords:
    - `shard`: which part of the state this rank holds, when ranks do not all hold the same (HSDP,
      FSDP with replication: the rank's position in its shard group, e.g.
      `mesh.get_local_rank("shard")`); ranks with the same `shard` are replicas of each other.
      None (default): every rank holds the same state (DDP).
    - `rng`: also keep the RNG state (torch CPU and CUDA, Python's `random`) as of each commit.
    - `buddy_every`: every that many steps, also copy the state into this node's host memory and
      a buddy rank's on another node (rank_side.buddy_copy), so a rank without a live replica
      and a lost node resume from memory; 0 (default): off.
    - `buddy_memory_limit_mb`: the most host memory the buddy copies of one node may take
      (default: 80 % of what it has available); above it, buddy copies are off, said in one line.
    """

    def __init__(self, *, shard: Optional[int] = None, rng: bool = False, buddy_every: int = 0,
                 buddy_memory_limit_mb: Optional[float] = None, **objects: Any) -> None:
        for name, obj in objects.items():
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(f"LiveState({name}=...): a {type(obj).__name__} has no state_dict/load_state_dict")
        if not objects:
            raise TypeError("LiveState(): name at least one object, e.g. LiveState(model=model, optimizer=opt)")
        self.objects: Dict[str, Any] = dict(objects)
        self._rng = _Rng() if rng else None
        if self._rng is not None:
            self.objects["_rng"] = self._rng
        self.shard = 0 if shard is None else int(shard)
        if int(buddy_every) < 0:
            raise ValueError(f"LiveState(buddy_every={buddy_every}): a number of steps, 0 for off")
        self._buddy_every = int(buddy_every)
        self._buddy_limit = None if buddy_memory_limit_mb is None else int(float(buddy_memory_limit_mb) * 1e6)
        self._buddy = None
        self._commit = _Commit(self)
        self._words = None
        self.last_recovery: Optional[dict] = None   # restore()'s summary (rank 0's view), for tests and logs
        rec = None
        if os.environ.get(inprocess.ENV_GRANULARITY, "job") != "job" and inprocess._STATE.active:
            rec = inprocess._record()
        if rec is None:
            return
        self._mm, self._words = rec
        cycle = _cycle()
        if _REG.cycle != cycle:   # the first LiveState of this call: the last call's is the previous
            _REG.previous, _REG.cycle = _REG.current, cycle
        _REG.current = self

    @property
    def active(self) -> bool:
        """True under ft_launcher inside `ft.restartable` with in-place restarts on."""
        return self._words is not None

    def buddy_stats(self) -> Optional[dict]:
        """This cycle's buddy-copy figures (snapshots, bytes, seconds copying, waiting, exchanging),
        or None when buddy copies are off."""
        return self._buddy.stats() if self._buddy is not None else None

    def commit(self, step: int) -> _Commit:
        """`with live.commit(step): opt.step()`: the body runs whole even if a restart signal
        arrives meanwhile; once it ends without an exception, `step` counts as completed."""
        self._commit.step = step
        return self._commit

    # ---- restore ----------------------------------------------------------------------------
    def restore(self) -> Optional[int]:
        """Load the state the job resumes at into this call's objects: the last completed step
        this rank now holds, or None when there is no live state (first start, a cold or job-level
        restart, no healthy copy of some shard): then load the checkpoint as without live state.
        Call it after init_process_group and before DDP is constructed (DDP broadcasts rank 0's
        parameters: they must already be the resumed ones). A collective: every rank calls it."""
        if self._words is None:
            if (_cycle() > 0 and os.environ.get("RANK") == "0" and os.environ.get(L.ENV_SHM)
                    and os.environ.get(inprocess.ENV_GRANULARITY, "job") == "job" and not _REG.said_job):
                _REG.said_job = True
                print("ft_launcher: no live state with --restart-granularity job (every rank restarts as a new "
                      "process): every rank loads its checkpoint", file=sys.stderr, flush=True)
            return None
        import torch
        import torch.distributed as dist

        words, cycle = self._words, _cycle()
        previous, _REG.previous = _REG.previous, None
        held, dirty = _REG.step, _REG.dirty or inprocess._STATE.failed_last
        _REG.step, _REG.dirty = NOT_HELD, False
        words[L.H_LIVE_STEP] = 0
        if not (dist.is_available() and dist.is_initialized()):
            if cycle == 0:
                return None
            raise RuntimeError("LiveState.restore() exchanges state over the process group: call it after "
                               "init_process_group (and before DDP is constructed)")
        buddy = self._start_buddy(cycle)
        if cycle == 0:   # a first start: nothing to exchange
            return None
        rank, world = dist.get_rank(), dist.get_world_size()
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
            else torch.device("cpu")
        usable = previous is not None and not dirty and set(previous.objects) == set(self.objects)
        mine = held if usable else NOT_HELD
        mine_raw = held if previous is not None else NOT_HELD
        row = [mine, self.shard, mine_raw] + (buddy_copy.holdings(buddy.slots, world, self.objects) if buddy else [])
        table = _all_gather(torch.tensor(row, dtype=torch.int64, device=device), world)
        steps, shards, raw = [int(r[0]) for r in table], [int(r[1]) for r in table], [int(r[2]) for r in table]
        started = time.perf_counter()   # every rank is here: what follows is the recovery's own time
        if buddy is not None:
            rows = [r[3:] for r in table]
            resume, sources, reason = buddy_copy.plan(steps, shards, buddy_copy.copies_of(rows))
        else:
            resume, sources, reason = plan_recovery(steps, shards)
        received, seconds = 0, 0.0
        if resume is not None:
            with torch.no_grad():
                if sources[rank] == rank:
                    _copy_objects(previous, self)
                    _REG.step = resume   # held now: a failure during the transfers keeps it
                del previous
                if buddy is not None:   # copies first: a rank that sends one may also receive a live one
                    received, seconds = buddy_copy.fetch(buddy, self.objects, sources, resume, rows,
                                                         self.shard, device)
                t0 = time.perf_counter()
                for dst in range(world):   # a source serves its receivers in rank order
                    if sources[dst] == rank and dst != rank:
                        _send_objects(self, dst, device)
                if isinstance(sources[rank], int) and sources[rank] != rank:
                    received = _recv_objects(self, sources[rank], device)
                    seconds = time.perf_counter() - t0
        else:
            del previous
        own = int((time.perf_counter() - started) * 1e9)
        stats = _all_gather(torch.tensor([received, int(seconds * 1e9), own], dtype=torch.int64, device=device), world)
        summary = {"cycle": cycle, "resume_step": resume, "steps_redone": None if resume is None
                   else max(0, max(raw) - resume),
                   "sources": {str(r): _source_name(r, sources[r]) for r in range(world)},
                   "bytes": sum(int(s[0]) for s in stats),
                   "transfer_s": round(max(int(s[1]) for s in stats) / 1e9, 6),
                   "restore_s": round(max(int(s[2]) for s in stats) / 1e9, 6)}
        if summary["bytes"] and summary["transfer_s"]:
            summary["mb_per_s"] = round(summary["bytes"] / 1e6 / summary["transfer_s"], 1)
        if reason:
            summary["reason"] = reason
        self.last_recovery = summary
        if rank == 0:
            if resume is None:
                print(f"ft_launcher: no live state to resume from ({reason}): every rank loads its checkpoint",
                      file=sys.stderr, flush=True)
            L.write_live_text(self._mm, words, json.dumps(summary, separators=(",", ":")))
        words[L.H_LIVE_RESUME] = 0 if resume is None else resume + 1
        words[L.H_LIVE_SOURCE] = _source_word(rank, sources[rank]) if resume is not None else L.LIVE_DISK
        words[L.H_LIVE_CYCLE] = cycle   # last: the agent reads the words above once it sees this
        if rank == 0:
            inprocess._wake_agent()
        if resume is None:
            return None
        _REG.step = resume
        words[L.H_LIVE_STEP] = resume + 1
        return resume


    def _start_buddy(self, cycle: int):
        """This cycle's buddy copies (a collective: a new gloo group and the placement), when asked
        for and under ft_launcher; the previous cycle's are closed."""
        if _REG.buddy is not None:
            _REG.buddy.close()
            _REG.buddy = None
        prefix = os.environ.get(buddy_store.ENV_PREFIX)
        if not self._buddy_every or not prefix:
            return None
        self._buddy = _REG.buddy = buddy_copy.BuddyCopy(self._buddy_every, self._buddy_limit, prefix)
        self._buddy.setup(cycle)
        _drain_before_destroy()
        return self._buddy


def _source_name(rank: int, source) -> str:
    if isinstance(source, tuple):
        return buddy_copy.source_name(rank, source)
    return "disk" if source is None else "kept" if source == rank else f"peer {source}"


def _source_word(rank: int, source) -> int:
    if isinstance(source, tuple):
        return L.LIVE_HOST_COPY if source[1] == rank else L.LIVE_BUDDY - source[1]
    return L.LIVE_KEPT if source == rank else L.LIVE_PEER + source


def _drain_before_destroy() -> None:
    """The script's own `destroy_process_group()` (at its end) first waits for the buddy exchange in
    flight: a group destroyed under it aborts the process."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if getattr(dist.destroy_process_group, "_ft_drains", False):
        return
    original = c10d.destroy_process_group

    def destroy_process_group(*args, **kwargs):
        if _REG.buddy is not None:
            _REG.buddy.close(join_for=60.0)
            _REG.buddy = None
        return original(*args, **kwargs)

    destroy_process_group._ft_drains = True
    destroy_process_group.__wrapped__ = original
    dist.destroy_process_group = c10d.destroy_process_group = destroy_process_group


def teardown_buddy(join_for: float = 0.0) -> None:
    """A restart's teardown (rank_side.inprocess): the buddy exchange in flight is abandoned (the
    group's destruction ends it; at most `join_for` s waited for)."""
    if _REG.buddy is not None:
        _REG.buddy.close(join_for)
        _REG.buddy = None


def plan_recovery(steps: List[int], shards: List[int]) -> Tuple[Optional[int], List[Optional[int]], str]:
    """Who resumes where, from each rank's completed step (-1: holds nothing usable) and shard.

    Returns (resume step, source per rank, reason). The resume step is the highest completed
    step; a rank at it keeps its state (its source is itself); any other receives from a rank
    of the same shard at the resume step, spread round robin over them. When no rank holds
    anything, or some shard has no rank at the resume step: (None, [None] * n, why)."""
    n = len(steps)
    resume = max(steps, default=NOT_HELD)
    if resume < 0:
        return None, [None] * n, "no rank holds live state (a cold or job-level restart, or a first start)"
    holders: Dict[int, List[int]] = collections.defaultdict(list)
    for r in range(n):
        if steps[r] == resume:
            holders[shards[r]].append(r)
    missing = sorted(s for s in set(shards) if not holders[s])
    if missing:
        lost = ", ".join(map(str, missing))
        return None, [None] * n, (f"no rank holds shard {lost} at step {resume} (every replica of it was lost "
                                  f"or is behind)")
    sources: List[Optional[int]] = [None] * n
    turn: Dict[int, int] = collections.defaultdict(int)
    for r in range(n):
        if steps[r] == resume:
            sources[r] = r
        else:
            group = holders[shards[r]]
            sources[r] = group[turn[shards[r]] % len(group)]
            turn[shards[r]] += 1
    return resume, sources, ""


# ---- moving state -------------------------------------------------------------------------------
class _Slot:
    """A tensor's place in a pickled skeleton."""

    def __init__(self, index: int, shape: tuple, dtype) -> None:
        self.index, self.shape, self.dtype = index, shape, dtype


def _local(t):
    """A tensor's own data: a DTensor's local shard, else the tensor."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None and type(t).__name__ == "DTensor" else t


def _split(value, tensors: list, path: tuple, paths: list):
    """The skeleton of a state dict (tensors replaced by _Slot) and its tensors (local data)."""
    import torch

    if isinstance(value, torch.Tensor):
        local = _local(value)
        tensors.append(local)
        paths.append(path)
        return _Slot(len(tensors) - 1, tuple(local.shape), local.dtype)
    if isinstance(value, dict):
        out = type(value)() if type(value) in (dict, collections.OrderedDict) else {}
        for k, v in value.items():
            out[k] = _split(v, tensors, path + (k,), paths)
        if hasattr(value, "_metadata"):
            out._metadata = value._metadata
        return out
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_split(v, tensors, path + (i,), paths) for i, v in enumerate(value))
    return value


def _flat(value, path: tuple = (), out: Optional[dict] = None) -> dict:
    """path -> tensor (the original object: a DTensor stays one) of a state dict."""
    import torch

    out = {} if out is None else out
    if isinstance(value, torch.Tensor):
        out[path] = value
    elif isinstance(value, dict):
        for k, v in value.items():
            _flat(v, path + (k,), out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _flat(v, path + (i,), out)
    return out


def _fill(skeleton, values: dict):
    if isinstance(skeleton, _Slot):
        return values[skeleton.index]
    if isinstance(skeleton, dict):
        out = type(skeleton)()
        for k, v in skeleton.items():
            out[k] = _fill(v, values)
        if hasattr(skeleton, "_metadata"):
            out._metadata = skeleton._metadata
        return out
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_fill(v, values) for v in skeleton)
    return skeleton


def _load(obj, skeleton, paths: list, fill) -> int:
    """Fill `obj`'s state from a skeleton: fill(destinations) writes tensor i into destinations[i]
    (the object's own tensor where path, shape and dtype match, else a new one)."""
    import torch

    mine = _flat(obj.state_dict())
    dests: list = [None] * len(paths)
    values = {}

    def visit(node):
        if isinstance(node, _Slot):
            own = mine.get(paths[node.index])
            dest = _local(own) if own is not None else None
            if dest is None or tuple(dest.shape) != node.shape or dest.dtype != node.dtype or not dest.is_contiguous():
                dest, own = torch.empty(node.shape, dtype=node.dtype, device=_DEVICE[0]), None
            dests[node.index] = dest
            values[node.index] = own if own is not None else dest
        elif isinstance(node, dict):
            for v in node.values():
                visit(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                visit(v)

    visit(skeleton)
    fill(dests)
    obj.load_state_dict(_fill(skeleton, values))
    return sum(d.numel() * d.element_size() for d in dests)


_DEVICE = [None]   # where tensors without a destination of their own are made (restore sets it)


def _copy_objects(previous: "LiveState", live: "LiveState") -> None:
    """A kept rank: the previous call's objects into this call's."""
    _DEVICE[0] = None
    for name in sorted(live.objects):
        tensors, paths = [], []
        skeleton = _split(previous.objects[name].state_dict(), tensors, (), paths)
        _DEVICE[0] = tensors[0].device if tensors else None
        _load(live.objects[name], skeleton, paths, lambda dests: [d.copy_(t) for d, t in zip(dests, tensors)])


# The tensors of one object go over the wire in few messages: every tensor smaller than
# _DIRECT_BYTES packed, in skeleton order, into chunks of at most _CHUNK_BYTES (each tensor whole in
# one, at an _ALIGN-byte offset), one staging buffer filled and sent (received and unpacked) per
# chunk; then every larger tensor by itself (it needs no staging copy). Any dtype (a tensor's bytes
# are viewed in the buffer as its dtype and shape: non-contiguous ones pack without a copy of
# their own), any device (the buffer is on the transfer device). Both sides plan the same messages
# from the skeleton's shapes and dtypes.
_CHUNK_BYTES = 16 << 20    # the most a staging buffer holds (one, reused: bounded memory, pages touched once)
_DIRECT_BYTES = 1 << 20    # a tensor at least this big (or than _CHUNK_BYTES) is sent by itself
_ALIGN = 64


def _plan(sizes: List[int]) -> Tuple[List[List[Tuple[int, int]]], List[int], List[int]]:
    """The messages for tensors of `sizes` bytes: (chunks, each a list of (tensor index, byte
    offset); each chunk's length; the indices of the tensors sent by themselves). 0-byte tensors
    are in neither."""
    cap = max(1, _CHUNK_BYTES)
    alone = min(_DIRECT_BYTES, cap)
    chunks: List[List[Tuple[int, int]]] = []
    lengths: List[int] = []
    direct: List[int] = []
    used = cap + 1   # no chunk open
    for i, n in enumerate(sizes):
        if n <= 0:
            continue
        if n >= alone:
            direct.append(i)
            continue
        at = -(-used // _ALIGN) * _ALIGN
        if at + n > cap:
            chunks.append([])
            lengths.append(0)
            at = 0
        chunks[-1].append((i, at))
        used = lengths[-1] = at + n
    return chunks, lengths, direct


def _packed(buf, at: int, t):
    """The bytes of `buf` from `at` seen as a tensor of t's shape and dtype."""
    return buf[at:at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)


def _send_tensors(tensors: list, device, send) -> None:
    import torch

    chunks, lengths, direct = _plan([t.numel() * t.element_size() for t in tensors])
    if chunks:
        buf = torch.empty(max(lengths), dtype=torch.uint8, device=device)
        for chunk, length in zip(chunks, lengths):
            for i, at in chunk:
                _packed(buf, at, tensors[i]).copy_(tensors[i])
            send(buf[:length])
    for i in direct:
        t = tensors[i]
        send(t if t.device == device and t.is_contiguous() else t.to(device).contiguous())


def _recv_tensors(dests: list, device, recv) -> None:
    import torch

    chunks, lengths, direct = _plan([d.numel() * d.element_size() for d in dests])
    if chunks:
        buf = torch.empty(max(lengths), dtype=torch.uint8, device=device)
        for chunk, length in zip(chunks, lengths):
            recv(buf[:length])
            for i, at in chunk:
                dests[i].copy_(_packed(buf, at, dests[i]))
    for i in direct:
        d = dests[i]
        if d.device == device and d.is_contiguous():
            recv(d)
        else:
            staged = torch.empty(d.shape, dtype=d.dtype, device=device)
            recv(staged)
            d.copy_(staged)


def _send_objects(live: "LiveState", dst: int, device, send=None) -> None:
    """Every object's skeleton (pickled) and then its tensors (_send_tensors) to rank `dst`;
    `send(tensor)` is the wire (default: dist.send to dst)."""
    import torch
    import torch.distributed as dist

    send = send or (lambda t: dist.send(t, dst))
    for name in sorted(live.objects):
        tensors, paths = [], []
        skeleton = _split(live.objects[name].state_dict(), tensors, (), paths)
        blob = pickle.dumps((skeleton, paths), protocol=pickle.HIGHEST_PROTOCOL)
        send(torch.tensor([len(blob)], dtype=torch.int64, device=device))
        send(torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device))
        _send_tensors(tensors, device, send)


def _recv_objects(live: "LiveState", src: int, device, recv=None) -> int:
    """What _send_objects sent, loaded into `live`'s objects; -> the bytes received.
    `recv(tensor)` is the wire (default: dist.recv from src)."""
    import torch
    import torch.distributed as dist

    recv = recv or (lambda t: dist.recv(t, src))
    _DEVICE[0] = device
    total = 0
    for name in sorted(live.objects):
        size = torch.empty(1, dtype=torch.int64, device=device)
        recv(size)
        raw = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        recv(raw)
        skeleton, paths = pickle.loads(raw.cpu().numpy().tobytes())
        total += raw.numel() + _load(live.objects[name], skeleton, paths,
                                     lambda dests: _recv_tensors(dests, device, recv))
    return total


def _all_gather(t, world: int) -> list:
    import torch
    import torch.distributed as dist

    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t)
    return [o.cpu().tolist() for o in out]
