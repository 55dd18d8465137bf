"""Warm reserves of one node: per local rank slot, interpreters that have already imported what
the slot's rank imports (of it, by `reserve_preimport`: rank_monitor.rank_side.import_record;
agent.ranks.reserve_process runs inside them), so a restart activates one in
milliseconds instead of starting a cold interpreter.

The pool starts `warm_reserves` per slot once the slot's first rank has reached its first `step`
(so warming never competes with the job's launch, and the reserve imports what that rank
imported), or ARM_AFTER seconds after the agent started for a script without a `step` section,
or at once on a hot spare; it replaces each one that is used once the rank started in its place
has reached its first `step` too (so warming never competes with a restart either; at most
ARM_AFTER seconds later), and never waits for one: `take` hands out a ready
reserve, else (an early failure, before one is ready) the one still warming, unless a cold start
would be sooner, else nothing and the caller spawns cold. A warming reserve has done part of what
a cold process would do, and a cold process beside it would compete with it for the CPU; taken, it
is raised to the agent's priority at once and runs the script when its warm-up ends (the
activation waits in its socket). It is not taken, but reported, killed and replaced, when the
evidence says it is stuck: it has used STUCK_CPU times the CPU time this slot's last cold rank
took from its start to its first `step` (measured at launch; CPU time, not wall time: a reserve
warms at low priority, and on busy cores its wall time says nothing), or it has used no CPU for
STALLED seconds while not runnable (asleep in an import); nor (left warming) when the slot's last
reserve was lost or no cold start of the slot has been measured yet.
A taken reserve that is still not warm HANDED_LIMIT cold starts later is killed (its rank then
fails and restarts like any other), so a reserve stuck after it was taken costs a restart, never
the job. A reserve that dies or does not become ready within `warm_reserve_timeout` is killed,
reported and replaced, and is never activated; after three such losses in a row a slot stops
trying, with one line saying why.

A reserve is a rank-to-be like any other: its own session, a parent-death signal, registered
with the orphan watchdog from the moment it is started. What each slot's rank imported is
learned from the rank itself (rank_monitor.rank_side.import_record, written at its first `step`); when a
newer record asks for modules a reserve lacks, a current one is started and the older one is
dismissed once the new one is ready (a ready reserve is never disturbed, so it can always be
activated at once).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Dict, List, Optional

from ft_launcher.rank_monitor.rank_side.import_record import ENV_IMPORTS_FILE, modules_to_import, user_code_dir
from ft_launcher.rank_monitor.own_modules import code_command

from ft_launcher.agent.observation.events import EventLog
from ft_launcher.agent.launch_config import LaunchConfig
from ft_launcher.agent.ranks.orphan_watchdog import OrphanWatchdog
from ft_launcher.agent.ranks.reserve_process import ENV_ROOM, autogroup_nice, set_autogroup_nice
from ft_launcher.agent.ranks.workers import describe_exit, popen_rank_process, slot_env

_BOOT = "from ft_launcher.agent.ranks.reserve_process import main\nmain(sys.argv[1:])\n"
MAX_LOSSES_IN_A_ROW = 3
ENV_ROOM_BYTES = 32768  # room for the round's variables in the reserve's /proc environ
MAINTAIN_EVERY = 0.25
ARM_AFTER = 60.0  # seconds: start reserves for a slot whose rank never records its imports
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")   # /proc/<pid>/stat's CPU times are in these
STUCK_CPU = 2.0   # a warm-up that used this many cold starts' worth of CPU is stuck (a full one uses ~1.1x here)
STALLED = 1.0  # seconds without CPU, not runnable: a warming reserve that is asleep (stuck)
HANDED_LIMIT = 2.0  # a reserve taken while warming must be warm within this many cold starts (at least 10 s)


class Reserve:
    """The agent's handle on one warm interpreter."""

    def __init__(self, local_rank: int, proc: subprocess.Popen, sock: socket.socket, log_path: str,
                 record_mtime: Optional[int]):
        self.local_rank = local_rank
        self.proc = proc
        self.pid = proc.pid
        self.sock = sock
        self.log_path = log_path            # its stderr while warming (why it died, if it does)
        self.covered_path = log_path[:-4] + ".modules"
        self.started = time.monotonic()
        self.ready: Optional[dict] = None    # its ready message
        self.covered: frozenset = frozenset()  # module names it has loaded or tried
        self.record_mtime = record_mtime     # the import record it was started with
        self.cpu = -1                        # its CPU ticks when last looked at, and when they last moved
        self.progressed = self.started
        self.handed: Optional[float] = None  # when it was taken while still warming

    def look(self, now: float) -> str:
        """Note whether it has used CPU since the last look; returns its state letter (R, S, D...)."""
        try:
            with open(f"/proc/{self.pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            state, cpu = fields[0], int(fields[11]) + int(fields[12])   # utime + stime, every thread
        except (OSError, ValueError, IndexError):
            return "?"
        if cpu != self.cpu:
            self.cpu, self.progressed = cpu, now
        return state

    def poll(self) -> Optional[dict]:
        """Its ready message, the first time it is seen (non-blocking)."""
        if self.ready is not None:
            return None
        try:
            data = self.sock.recv(1 << 16, socket.MSG_DONTWAIT)
            msg = json.loads(data) if data else {}
        except (OSError, ValueError):  # nothing yet (BlockingIOError), or closed
            return None
        if msg.get("kind") != "ready":
            return None
        try:
            with open(self.covered_path) as fh:
                self.covered = frozenset(fh.read().split())
        except OSError:
            pass
        _remove(self.covered_path)
        self.ready = msg
        return msg

    def alive(self) -> bool:
        return self.proc.poll() is None

    def activate(self, env: Dict[str, str], stdout, stderr, title: str) -> Optional[subprocess.Popen]:
        """Hand it the rank's environment and output; returns its process, or None (then the
        caller spawns cold and this reserve is gone). A reserve still warming gets the agent's
        priority now and reads the activation once warm; its socket stays open until then (it
        exits if its ready message finds the socket closed): the pool closes it (`settle`)."""
        warming = self.ready is None
        if warming:
            _raise_priority(self.pid)
        fds, opened = [], []
        for fd, own in ((stdout, 1), (stderr, 2)):
            if fd is None:
                fds.append(own)                       # inherit the agent's console
            elif fd == subprocess.DEVNULL:
                opened.append(os.open(os.devnull, os.O_WRONLY))
                fds.append(opened[-1])
            else:
                fds.append(fd)
        try:
            if not self.alive():
                return None
            payload = json.dumps({"op": "activate", "env": env, "title": title}).encode()
            socket.send_fds(self.sock, [payload], fds)
            return self.proc
        except OSError:
            warming = False
            return None
        finally:
            for fd in opened:
                os.close(fd)
            if not warming:
                self.sock.close()
                _remove(self.log_path)

    def settle(self) -> bool:
        """An activated reserve that was warming: once it has said it is ready (and so read, or is
        about to read, its activation) or died, close our end. True when done."""
        if self.ready is None and self.alive():
            try:
                data = self.sock.recv(1 << 16, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return False
            except OSError:
                data = b""
            try:
                self.ready = json.loads(data) if data else {}
            except ValueError:
                self.ready = {}
        self.sock.close()
        _remove(self.log_path)
        _remove(self.covered_path)
        return True

    def last_words(self) -> str:
        try:
            with open(self.log_path, errors="replace") as fh:
                lines = [line.strip() for line in fh if line.strip()]
            return lines[-1][:300] if lines else ""
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL it and everything it started."""
        self.sock.close()
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def dismiss(self) -> None:
        """Kill it (if not yet) and reap it."""
        self.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        _remove(self.log_path)
        _remove(self.covered_path)


class ReservePool:
    def __init__(self, cfg: LaunchConfig, watchdog: OrphanWatchdog, events: EventLog):
        self.cfg = cfg
        self.watchdog = watchdog
        self.events = events
        self.per_slot = max(0, int(cfg.ft.warm_reserves))
        self.timeout = float(cfg.ft.warm_reserve_timeout)
        self.slots: Dict[int, List[Reserve]] = {i: [] for i in range(cfg.nproc_per_node)}
        self.losses: Dict[int, int] = {i: 0 for i in range(cfg.nproc_per_node)}
        self.disabled: set = set()
        self._wanted: Dict[int, tuple] = {}  # slot -> (record mtime, module names it asks for)
        self._next_check = 0.0
        self._arm_at = time.monotonic() + ARM_AFTER
        self._told_priority = False
        self._told_environ = False
        self.preimport: Dict[int, str] = {i: cfg.ft.reserve_preimport for i in range(cfg.nproc_per_node)}
        self._hurried: set = set()   # pids of reserves raised to the agent's priority (`hurry`)
        self._handed: List[Reserve] = []   # taken while warming: their sockets close once they are ready
        self._cold_from: Dict[int, float] = {}   # slot -> wall time its cold rank started (until it steps)
        self._hold: Dict[int, float] = {}        # slot -> wall time its rank started: no new reserve until it steps
        self.cold_start: Dict[int, float] = {}   # slot -> seconds its last cold rank took to its first step
        if self.per_slot and cfg.entry_kind == "program":
            events.say("warm reserves off: --no-python runs a program, not a Python script, so every "
                       "restart starts it cold")
            self.per_slot = 0
        self.dir = tempfile.mkdtemp(prefix=f"ft_launcher_reserves_{os.getpid()}_") if self.per_slot else None
        if self.dir:
            watchdog.remove_at_exit(self.dir)   # also when the agent is SIGKILLed

    @property
    def enabled(self) -> bool:
        return self.per_slot > 0

    def record_path(self, local_rank: int) -> str:
        return os.path.join(self.dir, f"imports_local{local_rank}.json")

    def rank_env(self, local_rank: int) -> Dict[str, str]:
        """What a rank needs to tell its slot's reserves what it imports."""
        return {ENV_IMPORTS_FILE: self.record_path(local_rank)} if self.enabled else {}

    def _is_current(self, reserve: Reserve) -> bool:
        """Started from the slot's newest import record, or holding all it asks for (a reserve
        still warming counts as current until it can be checked)."""
        record = self.record_path(reserve.local_rank)
        mtime = _mtime(record)
        if mtime == reserve.record_mtime or reserve.ready is None:
            return True
        cached = self._wanted.get(reserve.local_rank)
        if cached is None or cached[0] != mtime:
            names, _ = modules_to_import(record, user_code_dir(self.cfg.entry_kind, self.cfg.entry_target),
                                         self.preimport[reserve.local_rank])
            cached = self._wanted[reserve.local_rank] = (mtime, frozenset(names))
        return cached[1] <= reserve.covered

    def rank_started(self, local_rank: int, warm: bool) -> None:
        """A rank was started in this slot: no reserve is started for the slot until it has
        reached its first `step` (its import record's time); a cold one is timed to it, the
        yardstick of `take` for a reserve still warming."""
        if not self.enabled:
            return
        self._hold[local_rank] = time.time()
        if not warm:
            self._cold_from[local_rank] = self._hold[local_rank]

    def _held(self, local_rank: int) -> bool:
        began = self._hold.get(local_rank)
        if began is None:
            return False
        mtime = _mtime(self.record_path(local_rank))
        if (mtime is None or mtime / 1e9 < began) and time.time() < began + ARM_AFTER:
            return True
        del self._hold[local_rank]
        return False

    def _time_cold_starts(self) -> None:
        for local_rank, began in list(self._cold_from.items()):
            mtime = _mtime(self.record_path(local_rank))
            if mtime is not None and mtime / 1e9 >= began:
                self.cold_start[local_rank] = round(mtime / 1e9 - began, 3)
                del self._cold_from[local_rank]

    # ---- keeping the pool full ----------------------------------------------------------------
    def arm(self) -> None:
        """Start reserves from now on without waiting for a rank's import record (a hot spare)."""
        self._arm_at = time.monotonic()

    def fill(self) -> None:
        """Start what is missing: `warm_reserves` current reserves per armed slot. Call from the
        agent's main thread (the parent-death signal follows the thread that started it)."""
        armed = time.monotonic() >= self._arm_at
        for local_rank, reserves in self.slots.items():
            if not self.enabled or local_rank in self.disabled:
                continue
            if not armed and _mtime(self.record_path(local_rank)) is None or self._held(local_rank):
                continue
            for _ in range(self.per_slot - sum(1 for r in reserves if self._is_current(r))):
                reserves.append(self._start(local_rank))

    def _start(self, local_rank: int) -> Reserve:
        cfg = self.cfg
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        record = self.record_path(local_rank)
        fd, log_path = tempfile.mkstemp(prefix=f"reserve_local{local_rank}_", suffix=".log", dir=self.dir)
        cmd = code_command(_BOOT, [str(theirs.fileno()), str(local_rank), record, log_path[:-4] + ".modules",
                                   str(self.timeout * 0.8), self.preimport[local_rank], cfg.entry_kind,
                                   cfg.entry_target, *cfg.entry_args],
                           flags=["-u"])
        try:
            env = dict(slot_env(cfg, local_rank), **{ENV_ROOM: "." * ENV_ROOM_BYTES})
            proc = popen_rank_process(cmd, env, subprocess.DEVNULL, fd, pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()
            os.close(fd)
        self.watchdog.watch(proc.pid)
        self.events.event("reserve_started", None, local_rank=local_rank, pid=proc.pid,
                          preimport=self.preimport[local_rank])
        return Reserve(local_rank, proc, ours, log_path, _mtime(record))

    def maintain(self) -> None:
        """Read the reserves' news; replace the dead and the stalled; start reserves for a newer
        import record, dismissing the older ones once the new ones are ready. Cheap to call
        often: it looks at most every MAINTAIN_EVERY seconds."""
        now = time.monotonic()
        if not self.enabled or now < self._next_check:
            return
        self._next_check = now + MAINTAIN_EVERY
        self._handed = [r for r in self._handed if not self._settle(r, now)]
        self._check(now)
        self.fill()

    def _settle(self, reserve: Reserve, now: float) -> bool:
        """A reserve taken while warming: done once warm (or dead); killed when it is not warm
        HANDED_LIMIT cold starts after it was taken (its rank fails, the agent restarts it)."""
        if reserve.settle():
            if reserve.ready:   # it became the rank: how long its warm-up took in all
                self.losses[reserve.local_rank] = 0
                if reserve.ready.get("environ_conflict"):   # too late for this one: the next ones
                    self._no_preimport(reserve.local_rank, reserve.ready["environ_conflict"])
                self.events.event("reserve_ready", None, local_rank=reserve.local_rank, pid=reserve.pid, taken=True,
                                  **{k: reserve.ready.get(k) for k in ("seconds", "imported", "modules", "rss", "frozen")})
            return True
        limit = max(10.0, HANDED_LIMIT * self.cold_start.get(reserve.local_rank, 5.0))
        if now - reserve.handed < limit:
            return False
        words = reserve.last_words()
        self.events.event("reserve_lost", f"warm reserve for local rank {reserve.local_rank} (pid {reserve.pid}), "
                          f"taken while warming, was still not warm {now - reserve.handed:.1f}s later -> killed; "
                          f"its rank fails and restarts" + (f": {words}" if words else ""),
                          local_rank=reserve.local_rank, pid=reserve.pid, why="not warm after it was taken",
                          last_words=words, gave_up=False)
        reserve.kill()
        reserve.settle()
        return True

    def _check(self, now: float) -> None:
        self._time_cold_starts()
        for local_rank, reserves in self.slots.items():
            for reserve in list(reserves):
                if reserve.ready is None:
                    reserve.look(now)
                news = reserve.poll()
                if news is not None:
                    self._on_ready(reserve, news)
                    if reserve not in reserves:
                        continue
                if not reserve.alive():
                    self._lose(reserve, f"died while waiting ({describe_exit(reserve.proc.returncode)})")
                elif reserve.ready is None and now - reserve.started > self.timeout:
                    self._lose(reserve, f"was not warm after {self.timeout:g}s (warm_reserve_timeout)")
            current_ready = [r for r in reserves if r.ready is not None and self._is_current(r)]
            if len(current_ready) >= self.per_slot:
                for reserve in [r for r in reserves if not self._is_current(r)]:
                    reserves.remove(reserve)
                    self._dismiss(reserve)

    def _on_ready(self, reserve: Reserve, info: dict) -> None:
        self.losses[reserve.local_rank] = 0
        self.events.event("reserve_ready", None, local_rank=reserve.local_rank, pid=reserve.pid,
                          **{k: info.get(k) for k in ("seconds", "imported", "failed", "modules", "rss",
                                                       "low_priority", "cuda_device", "frozen", "environ_conflict")})
        if not info.get("low_priority") and not self._told_priority:
            self._told_priority = True
            self.events.say("note: warm reserves warm up at normal priority (this process may not raise a "
                            "lowered priority back at activation: no CAP_SYS_NICE, RLIMIT_NICE < 20)")
        if info.get("environ_conflict"):   # never activated: torch saw what the script may have set otherwise
            self.slots[reserve.local_rank].remove(reserve)
            self._dismiss(reserve)
            self._no_preimport(reserve.local_rank, info["environ_conflict"])

    def _no_preimport(self, local_rank: int, names: List[str]) -> None:
        """The slot's script set a variable torch reads at import, with a value a reserve that
        imported torch did not have: its reserves import nothing ahead from now on (one line, once)."""
        self.preimport[local_rank] = "none"
        if not self._told_environ:
            self._told_environ = True
            self.events.say(f"warm reserves import nothing ahead of the script from now on: local rank {local_rank}'s "
                            f"script sets {', '.join(names)} itself, which torch reads when it is imported (maybe "
                            f"before importing it); --ft-reserve-preimport recorded imports torch ahead anyway")

    def _lose(self, reserve: Reserve, why: str) -> None:
        local_rank = reserve.local_rank
        self.slots[local_rank].remove(reserve)
        words = reserve.last_words()
        self._dismiss(reserve)
        self.losses[local_rank] += 1
        gave_up = self.losses[local_rank] >= MAX_LOSSES_IN_A_ROW
        self.events.event("reserve_lost", f"warm reserve for local rank {local_rank} (pid {reserve.pid}) {why}"
                          + (f": {words}" if words else "")
                          + (f" -> no more reserves for this slot after {MAX_LOSSES_IN_A_ROW} losses in a row; "
                             f"its restarts start cold" if gave_up else " -> replacing it; it is never used"),
                          local_rank=local_rank, pid=reserve.pid, why=why, last_words=words, gave_up=gave_up)
        if gave_up:
            self.disabled.add(local_rank)

    def _dismiss(self, reserve: Reserve) -> None:
        reserve.dismiss()
        self.watchdog.forget(reserve.pid)

    def hurry(self) -> None:
        """The reserves still warming go on at the agent's priority (a spare about to train runs no
        ranks of its own that their low priority would protect)."""
        for reserves in self.slots.values():
            for reserve in reserves:
                if reserve.ready is None and reserve.pid not in self._hurried and reserve.alive():
                    self._hurried.add(reserve.pid)
                    _raise_priority(reserve.pid)

    def ready(self) -> bool:
        """Every slot has a warm reserve ready (True when reserves are off: nothing to wait for)."""
        if not self.enabled:
            return True
        self._check(time.monotonic())
        return all(local_rank in self.disabled or any(r.alive() and r.ready is not None for r in reserves)
                   for local_rank, reserves in self.slots.items())

    # ---- using one ----------------------------------------------------------------------------
    def take(self, local_rank: int) -> Optional[Reserve]:
        """A ready reserve of this slot (a current one first), else the one warming longest if
        it is not stuck (see the module docstring), removed from the pool; None otherwise: the
        caller starts cold, it never waits."""
        if not self.enabled:
            return None
        now = time.monotonic()
        self._check(now)  # no replacements started here: the caller fills after activating
        alive = [r for r in self.slots[local_rank] if r.alive()]
        ready = [r for r in alive if r.ready is not None]
        if ready:
            reserve = max(ready, key=self._is_current)
        elif alive:
            reserve = min(alive, key=lambda r: r.started)
            stuck = self._stuck(reserve, now)
            if stuck is not None:
                if stuck:
                    self._lose(reserve, stuck)
                return None
            reserve.handed = now
            self._handed.append(reserve)
            self.events.event("reserve_taken_warming", f"local rank {local_rank}: no warm reserve is ready yet; "
                              f"taking the one warming for {now - reserve.started:.1f}s (a cold start took "
                              f"{self.cold_start[local_rank]:.1f}s) at full priority rather than starting a "
                              f"second, cold process", local_rank=local_rank, pid=reserve.pid,
                              warming=round(now - reserve.started, 3), cold_start=self.cold_start[local_rank])
        else:
            return None
        self.slots[local_rank].remove(reserve)
        return reserve

    def _stuck(self, reserve: Reserve, now: float) -> Optional[str]:
        """None when a reserve still warming should be taken; why it is stuck (it is then
        discarded); or "" when it is not taken but left warming: no yardstick (no cold start of
        the slot measured yet), or the slot's last reserve was lost (died, or never warm)."""
        cold = self.cold_start.get(reserve.local_rank)
        if cold is None or self.losses[reserve.local_rank]:   # no yardstick; its predecessor was lost
            return ""
        state = reserve.look(now)
        used = max(reserve.cpu, 0) / CLOCK_TICKS   # CPU seconds: at nice +10 on busy cores, wall time says little
        if used >= STUCK_CPU * cold:
            return (f"has used {used:.1f}s of CPU warming ({now - reserve.started:.1f}s since its start), over "
                    f"{STUCK_CPU:g}x what a cold rank of this slot took to its first step ({cold:.1f}s): stuck, not taken")
        if state not in ("R", "D") and now - reserve.progressed >= STALLED:
            return (f"has used no CPU for {now - reserve.progressed:.1f}s while warming (asleep, state {state}): "
                    f"stuck, not taken")
        return None

    def close(self) -> None:
        for reserve in self._handed:   # ranks now: the group stops them
            if not reserve.settle():
                reserve.sock.close()
        self._handed = []
        everyone = [r for reserves in self.slots.values() for r in reserves]
        for reserve in everyone:  # all at once: each takes ~0.1 s to release its memory
            reserve.kill()
        for reserve in everyone:
            self._dismiss(reserve)
        for reserves in self.slots.values():
            reserves.clear()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def _raise_priority(pid: int) -> None:
    """Every thread of `pid` to the agent's own priority, and its session's autogroup to a new
    session's (a warming reserve runs at nice +10, both; agent.ranks.reserve_process)."""
    try:
        base = os.getpriority(os.PRIO_PROCESS, 0)
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, base)
        except OSError:
            pass
    if autogroup_nice(pid) not in (None, 0):
        set_autogroup_nice(pid, 0)   # else the reserve itself restores it once warm


def _mtime(path: str) -> Optional[int]:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
