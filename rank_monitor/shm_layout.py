"""The shared-memory record a rank and its monitor both map: word offsets, sizes, env var names.

One fixed-size file (under /dev/shm) per local rank slot, created by the monitor. Viewed as an
array of signed 64-bit words (`memoryview(mmap).cast('q')`) followed by a name table. The "client"
words (sections, heartbeats, timeout overrides, workload requests) have one writer, cleared when a
new incarnation attaches: the rank's own client (rank_side.sections), or, for NVRx's client talking
to the monitor's socket, the monitor in its stead (monitor_side.nvrx_peers; H_CLIENT_KIND says
which). Besides, the monitor writes only H_START_NS (0 while no rank runs), H_MONITOR_NS (its
liveness tick, which the agent watches) and, before it terminates a hung rank, the stop words;
the agent writes only H_STOP_REASON / H_STOP_DEADLINE_NS, just before it signals the rank to stop
(what ft_launcher.preempted() reads), and, for an in-process restart, H_IP_REQUEST / H_IP_GO (the
rank's words are H_IP_STATE, H_IP_SEEN, H_IP_FAIL_NS and the exception's text in the area after
the request's). Live state (rank_monitor.rank_side.live.live_state) is the rank's H_LIVE_* words and,
on global rank 0, its recovery summary in the live text area. A rank's workload control request
(NVRx's WorkloadControlRequest) is H_REQUEST_* plus its description in the request area after the
names. Word writes are single aligned 8-byte stores; readers tolerate torn multi-word views by
re-reading before acting.
"""
from __future__ import annotations

import mmap
import os
import time
from typing import Dict, Optional, Tuple

# ---- environment passed to the rank -------------------------------------------------------------
ENV_SHM = "FT_RANK_MONITOR_SHM"                # path of the shared-memory file
ENV_STACK_FILE = "FT_RANK_MONITOR_STACK_FILE"  # stack-dump file template, "{pid}" replaced
ENV_CONFIG = "FT_RANK_MONITOR_CONFIG"          # JSON: timeouts the rank was started with
ENV_LOCAL_RANK = "FT_RANK_MONITOR_LOCAL_RANK"
ENV_WARNED = "FT_LAUNCHER_WARNED"              # path prefix of the agent's said-once markers
# ---- environment passed to the rank monitor -------------------------------------------------------
ENV_HANG_VERDICT = "FT_LAUNCHER_HANG_VERDICT"  # "1": hold a hung rank for the agent's hang-blame verdict


def warned_prefix(agent_pid: int) -> str:
    """Where the ranks of agent `agent_pid` mark a warning as said (one empty file per warning),
    so that each is said once per agent, not once per rank process; under the records' name."""
    return os.path.join(default_shm_dir(), f"ft_launcher_{agent_pid}_warned_")

MAGIC = 0x46544C4D4F4E3031  # "FTLMON01"
VERSION = 6

# ---- header words -------------------------------------------------------------------------------
H_MAGIC = 0
H_VERSION = 1
H_CLIENT_PID = 2        # pid of the attached client (0: none)
H_CLIENT_STATE = 3      # 0 none, 1 attached, 2 shut down (monitoring off for this incarnation)
H_HANDLER_PID = 4       # pid whose stack-dump handler is installed (0: none)
H_HANDLER_SIG = 5       # the signal that handler is registered on
H_START_NS = 6          # rank start (monotonic ns) as told by the agent; written by the monitor
H_NSLOTS = 7            # section slots in use (published after the slot is filled)
H_OPEN = 8              # number of open sections
H_LAST_CLOSE_NS = 9     # when the open count last dropped to 0 (0: no section closed yet)
H_OOS_COUNT = 10        # out-of-section intervals observed (between sections)
H_OOS_MAX_NS = 11
H_OOS_LAST_NS = 12
H_HB_COUNT = 13
H_HB_FIRST_NS = 14
H_HB_LAST_NS = 15
H_HB_MAX_NS = 16        # max interval between heartbeats
H_HB_LAST_IV_NS = 17
H_TO_OOS = 18           # timeout overrides set by the client: 0 = use config, -1 = none, >0 ns
H_TO_HB_INIT = 19
H_TO_HB_SUB = 20
H_ATTACH_NS = 21
H_GEN = 22              # bumped on every (re)attach / clear: invalidates cached slot names
H_MONITOR_NS = 23       # the monitor's loop writes the time here at least once a second
H_REQUEST_ACTION = 24   # a workload control request: 0 none, else WorkloadAction value + 1 (written last)
H_REQUEST_SEQ = 25      # bumped per request
H_REQUEST_LEN = 26      # bytes of its description in the request area
H_STOP_REASON = 27      # written by the agent before it signals the rank: STOP_* below
H_STOP_DEADLINE_NS = 28 # monotonic ns at which the agent's SIGKILL follows
# In-process restart (rank_monitor.rank_side.inprocess, agent.ranks.inprocess_ranks). The client writes H_IP_STATE,
# H_IP_SEEN, H_IP_FAIL_NS and the text; the agent writes H_IP_REQUEST and H_IP_GO.
H_IP_STATE = 29         # IP_* below
H_IP_SEEN = 30          # the restart request (a cycle number) the rank last acted on
H_IP_FAIL_NS = 31       # when the rank's function raised (monotonic ns); 0: it did not
H_IP_REQUEST = 32       # agent: leave the function, to run again as this cycle (then IN_PLACE_SIGNAL)
H_IP_GO = 33            # agent: run the function again as this cycle (its environment: the env file)
H_IP_TEXT_LEN = 34      # bytes of the exception's one-line summary in the text area
H_FROZEN_NS = 35        # monitor: when it found this incarnation hung; its statistics are then those
                        # copied into the frozen area at that moment (0: live)
# Live state (rank_monitor.rank_side.live.live_state), written by the rank only:
H_LIVE_STEP = 36        # the last completed step + 1 (0: none): `LiveState.commit` on exit, no syscall
H_LIVE_CYCLE = 37       # the cycle whose `restore()` wrote the words below (0: none); written last
H_LIVE_RESUME = 38      # that restore's resume step + 1 (0: no live state, the script's checkpoint)
H_LIVE_SOURCE = 39      # where this rank's state came from: LIVE_* below, LIVE_PEER + peer rank, LIVE_BUDDY - rank
H_LIVE_TEXT_LEN = 40    # global rank 0: bytes of the recovery summary (JSON, rank_monitor.live_summary) in the live text area
H_CLIENT_KIND = 41      # who writes the client words: CLIENT_OWN (the rank's own client) or CLIENT_NVRX
H_REQUEST_READ = 42     # the agent: the H_REQUEST_SEQ it last read (a writer of several requests awaits it)
HEADER_WORDS = 48

# ---- per-section slot words ---------------------------------------------------------------------
S_OPEN = 0
S_ENTER_NS = 1
S_ENTERS = 2            # enter count (also a sequence number for torn-read checks)
S_CLOSES = 3
S_MAX_NS = 4
S_LAST_NS = 5
S_TOTAL_NS = 6
S_TIMEOUT = 7           # override, same encoding as H_TO_*
S_NAMELEN = 8
# The checkpoint section's slot only (CHECKPOINT_SECTION): the `step` section's closes and total ns
# as this section last closed normally, i.e. the steps a restart from that checkpoint keeps
# (goodput), and how long that occurrence took; the same for its last occurrence that ended in an
# exception, with the section's enter count then (it is the latest occurrence when that count is
# still S_ENTERS), so that the agent can tell a checkpoint that failed from one that was done.
S_AT_STEP_CLOSES = 9
S_AT_STEP_TOTAL_NS = 10
S_AT_CLOSE_NS = 11
S_RAISED_STEP_CLOSES = 12
S_RAISED_STEP_TOTAL_NS = 13
S_RAISED_NS = 14
S_RAISED_ENTERS = 15
SLOT_WORDS = 16
CHECKPOINT_SECTION = "checkpointing"   # NVRx's name for the section that saves a checkpoint
STEP_SECTION = "step"
MAX_SLOTS = 64
NAME_BYTES = 128        # per slot, in the name table after the words

IP_NONE = 0             # not under ft.restartable
IP_RUNNING = 1          # running the restartable function
IP_FAILED = 2           # the function raised: reported, waiting for the agent's request
IP_READY = 3            # left the function, process group destroyed: waiting for H_IP_GO
IP_DONE = 4             # the function returned
IP_WORDS = (H_IP_STATE, H_IP_SEEN, H_IP_FAIL_NS, H_IP_REQUEST, H_IP_GO, H_IP_TEXT_LEN)

LIVE_DISK = 0           # H_LIVE_SOURCE: no live state (the checkpoint on disk, or a first start)
LIVE_KEPT = 1           # kept in this process's memory
LIVE_PEER = 2           # + N: received from global rank N
LIVE_HOST_COPY = -1     # loaded from its own copy in this node's host memory (rank_side.live.buddy_copy)
LIVE_BUDDY = -2         # - N: received the copy global rank N held in its node's host memory

STOP_SHUTDOWN = 1       # the job is stopping (preemption, a signal to the launcher)
STOP_RESTART = 2        # the ranks are stopped for a restart

CLIENT_OWN = 0          # H_CLIENT_KIND: the rank's client writes the record (rank_side.sections)
CLIENT_NVRX = 1         # the monitor writes it for NVRx's client on its socket (monitor_side.nvrx_peers)

TIMEOUT_UNSET = 0
TIMEOUT_NONE = -1

WORDS = HEADER_WORDS + MAX_SLOTS * SLOT_WORDS
NAMES_OFFSET = WORDS * 8
REQUEST_OFFSET = NAMES_OFFSET + MAX_SLOTS * NAME_BYTES
REQUEST_BYTES = 512
IP_TEXT_OFFSET = REQUEST_OFFSET + REQUEST_BYTES
IP_TEXT_BYTES = 512
FROZEN_OFFSET = IP_TEXT_OFFSET + IP_TEXT_BYTES   # a copy of the words, taken when a hang is found
LIVE_TEXT_OFFSET = FROZEN_OFFSET + WORDS * 8
LIVE_TEXT_BYTES = 64 << 10   # the recovery summary: a compact one fits any world size (live_summary)
SIZE = LIVE_TEXT_OFFSET + LIVE_TEXT_BYTES


def slot_base(index: int) -> int:
    return HEADER_WORDS + index * SLOT_WORDS


def encode_timeout(seconds: Optional[float]) -> int:
    if seconds is None:
        return TIMEOUT_NONE
    return max(1, int(seconds * 1e9))


def decode_timeout(word: int, default: Optional[float]) -> Optional[float]:
    """Override word -> seconds (or None); TIMEOUT_UNSET gives the default."""
    if word == TIMEOUT_UNSET:
        return default
    if word < 0:
        return None
    return word / 1e9


def default_shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else "/tmp"


def create(path: str) -> Tuple[mmap.mmap, memoryview]:
    """Create (or truncate) the file at `path`, map it, write the header. Monitor side."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, SIZE)
        mm = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    words = memoryview(mm).cast("q")
    words[H_VERSION] = VERSION
    words[H_MAGIC] = MAGIC
    return mm, words


def attach(path: str, writable: bool = True) -> Tuple[mmap.mmap, memoryview]:
    """Map an existing record; raises ValueError when it is not ours."""
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        if os.fstat(fd).st_size < SIZE:
            raise ValueError(f"{path}: too small for a rank monitor record")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        mm = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, prot)
    finally:
        os.close(fd)
    words = memoryview(mm).cast("q")
    if words[H_MAGIC] != MAGIC or words[H_VERSION] != VERSION:
        words.release()
        mm.close()
        raise ValueError(f"{path}: not a rank monitor record (version {VERSION} expected)")
    return mm, words


def clear_client_state(words: memoryview, same_process: bool = False) -> None:
    """Zero every client-written word (a new incarnation starts from nothing), and the agent's
    stop words (they were about the previous incarnation). `same_process`: an in-process restart,
    which keeps the stack-dump handler and the in-process restart words."""
    words[H_CLIENT_STATE] = 0
    words[H_CLIENT_PID] = 0
    words[H_NSLOTS] = 0
    keep = {H_START_NS, H_GEN, H_NSLOTS, H_MONITOR_NS}
    if same_process:
        keep.update((H_HANDLER_PID, H_HANDLER_SIG) + IP_WORDS)
    for i in range(H_HANDLER_PID, WORDS):
        if i not in keep:
            words[i] = 0
    words[H_GEN] = words[H_GEN] + 1


def env_file(shm_path: str) -> str:
    """Where the agent writes the environment of a rank's next in-process cycle."""
    return shm_path + ".restart.json"


def wake_pipe(shm_path: str) -> str:
    """The named pipe the rank's restart watcher blocks on; the agent writes a byte into it after
    it writes H_IP_REQUEST (rank_monitor.rank_side.restart_watcher)."""
    return shm_path + ".wake"


def write_request(mm: mmap.mmap, words: memoryview, action: int, description: str) -> None:
    """A workload control request (NVRx's WorkloadAction value) and its description, published
    last; the agent reads it once per H_REQUEST_SEQ (agent_side.monitor_handle.control_request)."""
    data = description.encode("utf-8", "replace")[:REQUEST_BYTES]
    words[H_REQUEST_ACTION] = 0
    mm[REQUEST_OFFSET:REQUEST_OFFSET + len(data)] = data
    words[H_REQUEST_LEN] = len(data)
    words[H_REQUEST_SEQ] += 1
    words[H_REQUEST_ACTION] = action + 1   # publish last


def await_request_read(words: memoryview, timeout: float = 1.0) -> bool:
    """Wait (at most `timeout` s) until the agent has read the last request, so that a request
    written now does not overwrite one it has not seen (the step guard's lines come in bursts).
    -> whether it was read."""
    import time

    end = time.monotonic() + timeout
    while words[H_REQUEST_SEQ] and words[H_REQUEST_READ] != words[H_REQUEST_SEQ]:
        if time.monotonic() >= end:
            return False
        time.sleep(0.002)
    return True


def write_ip_text(mm: mmap.mmap, words: memoryview, text: str) -> None:
    data = text.encode("utf-8", "replace")[:IP_TEXT_BYTES]
    mm[IP_TEXT_OFFSET:IP_TEXT_OFFSET + len(data)] = data
    words[H_IP_TEXT_LEN] = len(data)


def write_live_text(mm: mmap.mmap, words: memoryview, text) -> None:
    data = (text if isinstance(text, bytes) else text.encode("utf-8", "replace"))[:LIVE_TEXT_BYTES]
    mm[LIVE_TEXT_OFFSET:LIVE_TEXT_OFFSET + len(data)] = data
    words[H_LIVE_TEXT_LEN] = len(data)


def read_live_text(mm: mmap.mmap, words: memoryview) -> str:
    n = max(0, min(words[H_LIVE_TEXT_LEN], LIVE_TEXT_BYTES))
    return bytes(mm[LIVE_TEXT_OFFSET:LIVE_TEXT_OFFSET + n]).decode("utf-8", "replace")


def read_ip_text(mm: mmap.mmap, words: memoryview) -> str:
    n = max(0, min(words[H_IP_TEXT_LEN], IP_TEXT_BYTES))
    return bytes(mm[IP_TEXT_OFFSET:IP_TEXT_OFFSET + n]).decode("utf-8", "replace")


def read_name(mm: mmap.mmap, words: memoryview, index: int) -> str:
    n = words[slot_base(index) + S_NAMELEN]
    n = max(0, min(n, NAME_BYTES))
    off = NAMES_OFFSET + index * NAME_BYTES
    return bytes(mm[off:off + n]).decode("utf-8", "replace")


def add_slot(mm: mmap.mmap, words: memoryview, data: bytes) -> Optional[int]:
    """Give section name `data` (at most NAME_BYTES) the next slot, zeroed, and publish it; its
    index, or None when every slot is taken. The client words' one writer calls it."""
    idx = words[H_NSLOTS]
    if idx >= MAX_SLOTS:
        return None
    b = slot_base(idx)
    for i in range(SLOT_WORDS):
        words[b + i] = 0
    write_name(mm, words, idx, data)
    words[H_NSLOTS] = idx + 1          # publish last
    return idx


def write_name(mm: mmap.mmap, words: memoryview, index: int, data: bytes) -> None:
    off = NAMES_OFFSET + index * NAME_BYTES
    mm[off:off + len(data)] = data
    words[slot_base(index) + S_NAMELEN] = len(data)


def freeze_stats(mm: mmap.mmap, words: memoryview) -> None:
    """Monitor side, when it finds the rank hung and before it resumes or signals it: from now on
    read_stats gives this incarnation's statistics as they are at this moment. Nothing the rank
    does after (the hung occurrence closing when a SIGSTOPped rank is resumed for its stack dump,
    a SIGTERM handler closing sections, a last heartbeat) is ever an observation."""
    mm[FROZEN_OFFSET:FROZEN_OFFSET + WORDS * 8] = mm[0:WORDS * 8]
    words[H_FROZEN_NS] = time.monotonic_ns()   # after the copy: a reader that sees it reads a whole copy


def read_stats(mm: mmap.mmap, words: memoryview) -> Dict[str, dict]:
    """This incarnation's observations (seconds): {"sections": {name: {count, max, ...}},
    "out_of_section": {count, max}, "heartbeat": {"initial": {count, max}, "subsequent": {...}}}.

    Empty while the record holds no current data: no rank is running (the monitor zeroes
    H_START_NS when the rank stops), or the new incarnation's client has not attached yet (the
    words still hold the previous incarnation's numbers, which were already collected). Once the
    monitor has found the rank hung, the numbers of that moment (freeze_stats): the live words are
    read first and H_FROZEN_NS after, so a read that finds it 0 was taken before the hang's
    detection, when the rank could not yet have been resumed."""
    start = words[H_START_NS]
    if not start or words[H_ATTACH_NS] < start:
        return {}
    stats = _stats(mm, words, words, start)
    if words[H_FROZEN_NS]:
        frozen = memoryview(bytes(mm[FROZEN_OFFSET:FROZEN_OFFSET + WORDS * 8])).cast("q")   # a copy: no export
        stats = _stats(mm, words, frozen, start)
    return stats


def _stats(mm: mmap.mmap, names: memoryview, w: memoryview, start: int) -> Dict[str, dict]:
    sections: Dict[str, dict] = {}
    for i in range(max(0, min(w[H_NSLOTS], MAX_SLOTS))):
        b = slot_base(i)
        sections[read_name(mm, names, i)] = {
            "count": w[b + S_CLOSES],
            "max": w[b + S_MAX_NS] / 1e9,
            "last": w[b + S_LAST_NS] / 1e9,
            "total": w[b + S_TOTAL_NS] / 1e9,
            "open": bool(w[b + S_OPEN]),
        }
    first, beats = w[H_HB_FIRST_NS], w[H_HB_COUNT]
    return {
        "sections": sections,
        "out_of_section": {"count": w[H_OOS_COUNT], "max": w[H_OOS_MAX_NS] / 1e9},
        "heartbeat": {
            "initial": {"count": 1 if first else 0, "max": max(0, first - start) / 1e9 if first else 0.0},
            "subsequent": {"count": max(0, beats - 1), "max": w[H_HB_MAX_NS] / 1e9},
        },
    }


def read_live(mm: mmap.mmap, words: memoryview) -> Optional[dict]:
    """What a rank is doing now, for the agent's status and metrics (read-only, never on the rank's
    path): {"start_ns", "hb_last_ns" (0: none yet), "open": [(name, enter_ns), ...] innermost last,
    "sections": {name: {"enters", "closes", "enter_ns", "total", "max"}}} (monotonic ns, seconds);
    the checkpoint section's entry also has "at_close": {"steps", "step_total", "took"}, the `step`
    section's closes and total seconds when it last closed normally and how long that took, or
    None; "open": whether it is open now; "raised": {"steps", "step_total", "took"} when its latest
    occurrence ended in an exception, else None; "live_step": the last step committed
    under live state (rank_monitor.rank_side.live.live_state), -1 when none.
    None while no incarnation's data is current (see read_stats)."""
    start = words[H_START_NS]
    if not start or words[H_ATTACH_NS] < start:
        return None
    sections: Dict[str, dict] = {}
    opened = []
    for i in range(max(0, min(words[H_NSLOTS], MAX_SLOTS))):
        b = slot_base(i)
        name = read_name(mm, words, i)
        enter_ns = words[b + S_ENTER_NS]
        sections[name] = {"enters": words[b + S_ENTERS], "closes": words[b + S_CLOSES], "enter_ns": enter_ns,
                          "total": words[b + S_TOTAL_NS] / 1e9, "max": words[b + S_MAX_NS] / 1e9}
        if name == CHECKPOINT_SECTION:
            took = words[b + S_AT_CLOSE_NS]
            sections[name]["at_close"] = {"steps": words[b + S_AT_STEP_CLOSES],
                                          "step_total": words[b + S_AT_STEP_TOTAL_NS] / 1e9,
                                          "took": took / 1e9} if took else None
            sections[name]["open"] = bool(words[b + S_OPEN])
            raised = words[b + S_RAISED_ENTERS]
            sections[name]["raised"] = {"steps": words[b + S_RAISED_STEP_CLOSES],
                                        "step_total": words[b + S_RAISED_STEP_TOTAL_NS] / 1e9,
                                        "took": words[b + S_RAISED_NS] / 1e9} \
                if raised and raised == words[b + S_ENTERS] and not words[b + S_OPEN] else None
        if words[b + S_OPEN]:
            opened.append((name, enter_ns))
    opened.sort(key=lambda item: item[1])
    return {"start_ns": start, "hb_last_ns": words[H_HB_LAST_NS], "open": opened, "sections": sections,
            "live_step": words[H_LIVE_STEP] - 1}
