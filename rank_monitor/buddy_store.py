"""Buddy copies in host memory: the files that hold them (one job: where a copy of a rank's
committed state lives, and what it says about itself).

Each local rank slot of an agent has four slot files in shared memory (/dev/shm), in a directory of
the agent's own, so they outlive a rank process (a rank that dies finds them again in its next
incarnation, its replacement in the same slot too) and go with the agent: it removes them when it
exits, its orphan watchdog when it is killed (the pattern of its monitor records,
`ft_launcher_<agent pid>_*`).

    <dir>/local<k>_own0, _own1   slot k's rank's own state, the two newest snapshots
    <dir>/local<k>_in0,  _in1    its buddy's state (another rank's, on another node), the two newest

Nothing another local user put there is ever loaded: `<dir>` is made by the agent with mkdtemp
(mode 0700, a name nobody can guess or take first: `ft_launcher_<agent pid>_buddy_<random>`), a
rank refuses a directory that is not this user's alone, a slot file is created with
O_EXCL|O_NOFOLLOW (mode 0600) and opened with O_NOFOLLOW, and one that is not a regular file of this
user's with no permission for group or others is refused with one line (`trusted`): it is never
mapped, so never offered to a restore (the restore goes on without it, as without any copy).

A fallback to the checkpoint abandons every copy held (`SlotSet.abandon`): the slots are emptied
and each keeps the cycle of the fallback as a floor; a copy written in an earlier cycle (an
exchange of the abandoned timeline that completes late) is no copy. So a later restore never
resumes the job *forward* onto the timeline the checkpoint replaced.

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
import shutil
import stat
import sys
import tempfile
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
# W_FLOOR: the cycle of the last fallback to the checkpoint (SlotSet.abandon): a copy of an earlier cycle is none
W_MAGIC, W_STATE, W_STEP, W_IDENTITY, W_LAYOUT, W_WORLD, W_ORIGIN, W_CYCLE, W_NBYTES, W_CAPACITY, W_FLOOR = range(11)
EMPTY, WRITING, COMPLETE = 0, 1, 2
_DIRS: Dict[tuple, str] = {}   # (shm dir, agent pid) -> the agent's slot directory (agent side, agent_dir)
_SAID = set()                  # the refusals said by this process (one line per path)


def agent_dir(agent_pid: int) -> str:
    """Agent `agent_pid`'s directory for its ranks' slot files, made at the first call (mkdtemp:
    mode 0700, a fresh unguessable name under the agent's record pattern, MonitorHandle.record_pattern,
    so the orphan watchdog removes it with the agent's records)."""
    key = (shm_layout.default_shm_dir(), agent_pid)
    if key not in _DIRS:
        _DIRS[key] = tempfile.mkdtemp(prefix=f"ft_launcher_{agent_pid}_buddy_", dir=key[0])
    return _DIRS[key]


def remove_agent_dir(agent_pid: int) -> None:
    """The agent's end: its slot directory and every copy in it go (only the one it made)."""
    path = _DIRS.pop((shm_layout.default_shm_dir(), agent_pid), None)
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def prefix_for(agent_pid: int, local_rank: int) -> str:
    """The slot files' path prefix of local slot `local_rank` under agent `agent_pid` (in its
    directory, agent_dir: made at the first call)."""
    return os.path.join(agent_dir(agent_pid), f"local{local_rank}")


def file_bytes(nbytes: int) -> int:
    """The size of a slot file that holds a payload of `nbytes` (what it takes in host memory)."""
    return HEADER_BYTES + max(GROW, -(-nbytes // GROW) * GROW)


def trusted(st: os.stat_result, kind: str = "file") -> Optional[str]:
    """Why a slot file (or, kind 'directory', the slot directory) with this lstat/fstat must not be
    used, else None: it must be this user's, of its kind, with no permission for group or others."""
    is_kind = stat.S_ISDIR if kind == "directory" else stat.S_ISREG
    if not is_kind(st.st_mode):
        return f"not a {'directory' if kind == 'directory' else 'regular file'}"
    if st.st_uid != os.getuid():
        return f"owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & 0o077:
        return f"mode {stat.S_IMODE(st.st_mode):04o} lets other users in (a slot is 0600 in a 0700 directory)"
    return None


def _refuse(path: str, why: str, what: str = "buddy copy", never: str = "it is never loaded") -> None:
    """One line per refused path and process (a refused slot is looked at again at each restart)."""
    if path not in _SAID:
        _SAID.add(path)
        print(f"ft_launcher: {what} {path} refused: {why}; {never}", file=sys.stderr, flush=True)


class Slot:
    """One slot file, mapped. `header()` is its description when it holds a complete copy. A file
    that `trusted` refuses is never mapped (said once, in one line); writing replaces it."""

    def __init__(self, path: str, refused: Optional[str] = None) -> None:
        self.path = path
        self.refused = refused   # the directory's refusal (SlotSet): nothing is read or written here
        self.fd: Optional[int] = None
        self.planted = False     # a file _open refused: the next write replaces it
        self.mm: Optional[mmap.mmap] = None
        self.words: Optional[memoryview] = None
        self.capacity = 0
        if refused is None:
            self._open()

    def _open(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            return
        except OSError as exc:   # ELOOP: a symbolic link; EACCES: another user's file
            self.planted = True
            _refuse(self.path, exc.strerror or str(exc))
            return
        try:
            st = os.fstat(fd)
            why = trusted(st)
            if why is not None:
                self.planted = True
                _refuse(self.path, why)
                return
            if st.st_size < HEADER_BYTES:
                return
            self.mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self.fd, fd = fd, None
        finally:
            if fd is not None:
                os.close(fd)
        self.words = memoryview(self.mm)[:HEADER_BYTES].cast("q")
        if self.words[W_MAGIC] != MAGIC:
            self.words[W_STATE] = EMPTY
        self.capacity = len(self.mm) - HEADER_BYTES

    def header(self) -> Optional[Dict[str, int]]:
        """{step, identity, layout, world, origin, cycle, nbytes} of a complete copy, else None
        (also for a copy of a cycle before the slot's floor: a timeline a fallback abandoned)."""
        w = self.words
        if w is None or w[W_MAGIC] != MAGIC or w[W_STATE] != COMPLETE or w[W_NBYTES] > self.capacity \
                or w[W_CYCLE] < w[W_FLOOR]:
            return None
        out = {"step": w[W_STEP], "identity": w[W_IDENTITY], "layout": w[W_LAYOUT], "world": w[W_WORLD],
               "origin": w[W_ORIGIN], "cycle": w[W_CYCLE], "nbytes": w[W_NBYTES]}
        return out if w[W_STATE] == COMPLETE else None   # re-read last: not overwritten meanwhile

    def ensure(self, nbytes: int) -> None:
        """Room for a payload of `nbytes` (the file grows, its pages reserved; OSError ENOSPC when
        the host cannot hold it). Payload views handed out before a growth are invalid after it."""
        if self.mm is not None and nbytes <= self.capacity:
            return
        if self.refused is not None:
            raise OSError(f"{self.path}: {self.refused}")
        want = file_bytes(max(nbytes, self.capacity + self.capacity // 2))   # grows by half at least
        fd = self.fd   # a file of ours, mapped: it grows (its header, the floor included, stays)
        self._unmap()
        if fd is None:
            fd = self._create()
        try:
            os.ftruncate(fd, want)
            os.posix_fallocate(fd, 0, want)
            self.mm = mmap.mmap(fd, want, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.words = memoryview(self.mm)[:HEADER_BYTES].cast("q")
        self.words[W_STATE] = EMPTY
        self.words[W_MAGIC] = MAGIC
        self.capacity = want - HEADER_BYTES
        self.words[W_CAPACITY] = self.capacity

    def _create(self) -> int:
        """The slot's file, made by this process (O_EXCL|O_NOFOLLOW, 0600); one refused at _open is
        replaced (it lies in the agent's own 0700 directory). Where another mapping in this process
        (an exchange a restart left running) made it meanwhile, that file, checked as at _open."""
        if self.planted:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.planted = False
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        why = trusted(os.fstat(fd))
        if why is not None:
            os.close(fd)
            raise OSError(f"{self.path}: {why}")
        return fd

    @classmethod
    def anonymous(cls, nbytes: int) -> "Slot":
        """A slot in this process's memory alone (no file): where a copy is received when the slot
        directory was refused."""
        slot = cls("<anonymous>", "anonymous")
        size = file_bytes(nbytes)
        slot.mm = mmap.mmap(-1, size)
        slot.words = memoryview(slot.mm)[:HEADER_BYTES].cast("q")
        slot.words[W_MAGIC] = MAGIC
        slot.capacity = size - HEADER_BYTES
        return slot

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

    def abandon(self, cycle: int) -> None:
        """A fallback to the checkpoint in `cycle`: the copy here is of a timeline the job left
        (emptied; one written later by an exchange of an earlier cycle is none either)."""
        if self.words is not None:
            self.words[W_FLOOR] = max(self.words[W_FLOOR], cycle)
            self.words[W_STATE] = EMPTY

    def _unmap(self) -> None:
        if self.words is not None:
            self.words.release()
            self.words = None
        if self.mm is not None:
            self.mm.close()
            self.mm = None
        self.capacity = 0

    def close(self) -> None:
        """Unmap (a payload view must not be used after: the owner closes a slot only when no copy
        into or out of it is running)."""
        self._unmap()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class SlotSet:
    """The four slot files of one local rank slot, in a directory that must be this user's alone
    (else every slot is refused, said in one line: nothing is read or written there)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        where = os.path.dirname(prefix) or "."
        try:
            self.refused = trusted(os.lstat(where), "directory")
        except OSError as exc:
            self.refused = exc.strerror or str(exc)
        if self.refused is not None:
            _refuse(where, self.refused, "buddy copy directory", "no copy in it is loaded or written")
        self.slots = [Slot(f"{prefix}_{name}", self.refused) for name in SLOT_NAMES]

    def allocated(self) -> int:
        return sum(s.allocated() for s in self.slots)

    def abandon(self, cycle: int) -> None:
        """Every copy held here is of an abandoned timeline (a fallback to the checkpoint in `cycle`)."""
        for s in self.slots:
            s.abandon(cycle)

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
