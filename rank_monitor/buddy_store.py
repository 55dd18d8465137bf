"""Buddy copies in host memory: the files that hold them (one job: where a copy of a rank's
committed state lives, and what it says about itself).

Each local rank slot of an agent has four slot files in shared memory (/dev/shm), named after the
agent, so they outlive a rank process (a rank that dies finds them again in its next incarnation,
its replacement in the same slot too) and go with the agent: it removes them when it exits, its
orphan watchdog when it is killed (the pattern of its monitor records, `ft_launcher_<agent pid>_*`).

    <prefix>_own0, <prefix>_own1   this slot's rank's own state, the two newest snapshots
    <prefix>_in0,  <prefix>_in1    its buddy's state (another rank's, on another node), the two newest

A slot file is a header page of int64 words (below) and a payload: the snapshot as
rank_monitor.rank_side.live.buddy_copy writes it (each object's state as live_wire sends it to a peer,
message after message, each at a 64-byte boundary). A
writer marks the slot WRITING first and COMPLETE last, after every other word: a slot torn by a
death in the middle is never read as a copy. The payload's pages are reserved with
posix_fallocate when the slot grows, so a full /dev/shm is an error at that moment (ENOSPC), never
a SIGBUS in the middle of a copy.

Torch-free; the rank maps payloads as tensors (torch.frombuffer over `mm`).
"""
from __future__ import annotations

import mmap
import os
from typing import Dict, Optional

from ft_launcher.rank_monitor import shm_layout

ENV_PREFIX = "FT_LAUNCHER_BUDDY_PREFIX"   # the path prefix of a rank's slot files (set per local slot)
SLOT_NAMES = ("own0", "own1", "in0", "in1")
OWN, INBOUND = (0, 1), (2, 3)

MAGIC = 0x4654424444593031   # "FTBDDY01"
HEADER_BYTES = 4096
GROW = 1 << 20               # capacities are rounded up to this

# header words: the copy's step, the shard identity and layout digests of the state it is of
# (rank_side.live.live_state: what the step exchange compares), the world size and the rank it was taken on
W_MAGIC, W_STATE, W_STEP, W_IDENTITY, W_LAYOUT, W_WORLD, W_ORIGIN, W_CYCLE, W_NBYTES, W_CAPACITY = range(10)
EMPTY, WRITING, COMPLETE = 0, 1, 2


def prefix_for(agent_pid: int, local_rank: int) -> str:
    """The slot files' path prefix of local slot `local_rank` under agent `agent_pid` (under the
    agent's record pattern, shm_layout / MonitorHandle.record_pattern)."""
    return os.path.join(shm_layout.default_shm_dir(), f"ft_launcher_{agent_pid}_buddy_local{local_rank}")


def file_bytes(nbytes: int) -> int:
    """The size of a slot file that holds a payload of `nbytes` (what it takes in host memory)."""
    return HEADER_BYTES + max(GROW, -(-nbytes // GROW) * GROW)


def agent_files(agent_pid: int) -> str:
    """A glob of every slot file of agent `agent_pid`'s ranks."""
    return os.path.join(shm_layout.default_shm_dir(), f"ft_launcher_{agent_pid}_buddy_*")


class Slot:
    """One slot file, mapped. `header()` is its description when it holds a complete copy."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.mm: Optional[mmap.mmap] = None
        self.words: Optional[memoryview] = None
        self.capacity = 0
        self._open()

    def _open(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                return
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.words = memoryview(self.mm)[:HEADER_BYTES].cast("q")
        if self.words[W_MAGIC] != MAGIC:
            self.words[W_STATE] = EMPTY
        self.capacity = len(self.mm) - HEADER_BYTES

    def header(self) -> Optional[Dict[str, int]]:
        """{step, identity, layout, world, origin, cycle, nbytes} of a complete copy, else None."""
        w = self.words
        if w is None or w[W_MAGIC] != MAGIC or w[W_STATE] != COMPLETE or w[W_NBYTES] > self.capacity:
            return None
        out = {"step": w[W_STEP], "identity": w[W_IDENTITY], "layout": w[W_LAYOUT], "world": w[W_WORLD],
               "origin": w[W_ORIGIN], "cycle": w[W_CYCLE], "nbytes": w[W_NBYTES]}
        return out if w[W_STATE] == COMPLETE else None   # re-read last: not overwritten meanwhile

    def ensure(self, nbytes: int) -> None:
        """Room for a payload of `nbytes` (the file grows, its pages reserved; OSError ENOSPC when
        the host cannot hold it). Payload views handed out before a growth are invalid after it."""
        if self.mm is not None and nbytes <= self.capacity:
            return
        want = file_bytes(max(nbytes, self.capacity + self.capacity // 2))   # grows by half at least
        self.close()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, want)
            os.posix_fallocate(fd, 0, want)
            self.mm = mmap.mmap(fd, want, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.words = memoryview(self.mm)[:HEADER_BYTES].cast("q")
        self.words[W_STATE] = EMPTY
        self.words[W_MAGIC] = MAGIC
        self.capacity = want - HEADER_BYTES
        self.words[W_CAPACITY] = self.capacity

    def payload(self, nbytes: int, offset: int = 0):
        """`nbytes` of the payload from `offset` as a torch uint8 tensor (a view of the mapping:
        valid until the slot grows or closes)."""
        import torch

        if not nbytes:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self.mm, dtype=torch.uint8, count=nbytes, offset=HEADER_BYTES + offset)

    def begin(self) -> None:
        self.words[W_STATE] = WRITING

    def finish(self, step: int, identity: int, layout: int, world: int, origin: int, cycle: int,
               nbytes: int) -> None:
        w = self.words
        w[W_STEP], w[W_IDENTITY], w[W_LAYOUT], w[W_WORLD] = step, identity, layout, world
        w[W_ORIGIN], w[W_CYCLE], w[W_NBYTES] = origin, cycle, nbytes
        w[W_STATE] = COMPLETE

    def allocated(self) -> int:
        return HEADER_BYTES + self.capacity if self.mm is not None else 0

    def close(self) -> None:
        """Unmap (a payload view must not be used after: the owner closes a slot only when no copy
        into or out of it is running)."""
        if self.words is not None:
            self.words.release()
            self.words = None
        if self.mm is not None:
            self.mm.close()
            self.mm = None
        self.capacity = 0


class SlotSet:
    """The four slot files of one local rank slot."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.slots = [Slot(f"{prefix}_{name}") for name in SLOT_NAMES]

    def allocated(self) -> int:
        return sum(s.allocated() for s in self.slots)

    def close(self) -> None:
        for s in self.slots:
            s.close()


def remove(prefix: str) -> None:
    for name in SLOT_NAMES:
        try:
            os.unlink(f"{prefix}_{name}")
        except OSError:
            pass


def host_memory() -> Dict[str, int]:
    """What this host can still give to buddy copies: `available` (MemAvailable) and `shm_free`
    (free space of the shared-memory file system; the copies live there), in bytes."""
    available = 0
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    try:
        st = os.statvfs(shm_layout.default_shm_dir())
        shm_free = st.f_bavail * st.f_frsize
    except OSError:
        shm_free = 0
    return {"available": available, "shm_free": shm_free}
