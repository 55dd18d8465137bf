"""The rank side of hang detection: sections, heartbeats and NVRx's RankMonitorClient.

Owns the hot path. Entering or leaving a section and sending a heartbeat write a few integers
(time.monotonic_ns(), counters) into the shared-memory record the rank's monitor created
(see shm_layout): no syscall, no socket, no lock, nothing that waits on the monitor.
Everything else (attaching, registering a section name, warnings, computed timeouts) is the slow
path and happens once per name or on explicit calls.

All clients in one process share one attachment. Without the monitor's environment variable
(plain python, torchrun) every call is a cheap no-op after one warning. Misuse (ending a section
that is not open, nesting a section in itself, a name with no configured timeout, an unusable
state dict) warns once per name and never raises.

Also owns NVRx's client surface (nvidia_resiliency_ext.fault_tolerance 0.4.1): RankMonitorClient
with NVRx's attributes, HeartbeatTimeouts and SectionTimeouts with NVRx's fields, and
RankMonitorClientError, raised only where NVRx raises it (a second init_workload_monitoring, a
timeout calculation without data unless skip_if_not_ready). send_workload_control_request
hands NVRx's WorkloadControlRequest to the launcher through the shared-memory record:
ShutdownWorkload stops the job (no restart), ExcludeThisNode takes this node out of the job.

Also owns preemption for the rank: preempted() / on_preemption(fn) install (on first call, never
on the hot path) a SIGTERM handler that records the signal and the grace the launcher announced
(the agent writes its SIGKILL deadline into the record before it signals). A SIGTERM that stops the
ranks for a restart is not a preemption: the handler then lets it end the rank as before.
"""
from __future__ import annotations

import faulthandler
import functools
import hashlib
import json
import os
import signal
import sys
import time
import warnings
from typing import Any, Dict, Iterable, Mapping, Optional

from ft_launcher.rank_monitor import flight_recorder

from ft_launcher.rank_monitor.rank_side import exit_settle, import_record
from ft_launcher.rank_monitor import shm_layout as L
from ft_launcher.rank_monitor.workload_requests import WorkloadAction, WorkloadControlRequest

_mono = time.monotonic_ns

DUMP_SIGNAL = int(signal.SIGUSR2)


class FtSectionWarning(RuntimeWarning):
    """Misuse of sections or heartbeats, or hang detection being off; never fatal."""


_warned: set = set()


def _warn(key, message: str) -> None:
    """One warning per key, as one line (`FtSectionWarning: ft_launcher: ...`, no source line);
    the warnings filters still decide whether it shows, and -W error never crashes the rank."""
    if key in _warned:
        return
    _warned.add(key)
    prefix = os.environ.get(L.ENV_WARNED)
    if prefix:   # once per agent: the first of its ranks (any cycle) to create the marker says it
        marker = prefix + hashlib.sha1(repr(key).encode()).hexdigest()[:16]
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            return
        except OSError:
            pass
    try:
        with warnings.catch_warnings(record=True) as caught:  # the filters stay the caller's
            warnings.warn(message, FtSectionWarning, stacklevel=4)
        for warning in caught:
            sys.stderr.write(f"{warning.category.__name__}: {warning.message}\n")
    except Exception:  # -W error must not turn a monitoring remark into a crash
        try:
            sys.stderr.write(f"FtSectionWarning: {message}\n")
        except Exception:
            pass


# ---------------------------------------------------------------------------------------------
# The process-wide attachment
# ---------------------------------------------------------------------------------------------
class _Attachment:
    """The one mapping of this process's monitor record, shared by all clients."""

    def __init__(self) -> None:
        self.mode = "unattached"        # unattached | attached | noop | shutdown
        self.mm = None
        self.words: Optional[memoryview] = None
        self.slots: Dict[str, int] = {}
        self.sections: Dict[str, "_Section"] = {}
        self.config: Dict[str, Any] = {}
        self.stack_file = None
        self.stack_path: Optional[str] = None
        # Timeouts computed in this process (or loaded from a state dict), seconds.
        self.calc_sections: Dict[str, Optional[float]] = {}
        self.calc_oos: Optional[float] = None
        self.calc_oos_set = False
        self.calc_hb: Dict[str, Optional[float]] = {}    # "initial" / "subsequent": computed only
        self.pending_state: Optional[Mapping[str, Any]] = None

    # ---- attach / detach ----------------------------------------------------------------
    def ensure(self) -> bool:
        """Attach on first use; True when the hot path is live."""
        if self.mode == "unattached":
            self._attach()
            if self.pending_state is not None:   # loaded before the attach; attached or not
                state, self.pending_state = self.pending_state, None
                self.apply_state(state)
        return self.mode == "attached"

    def _attach(self) -> None:
        path = os.environ.get(L.ENV_SHM)
        if not path:
            self._go_noop(("noenv",), f"ft_launcher: {L.ENV_SHM} is not set (not running under ft_launcher); "
                                      "sections and heartbeats are no-ops and hangs are not detected")
            return
        try:
            mm, words = L.attach(path)
        except (OSError, ValueError) as exc:
            self._go_noop(("attach",), f"ft_launcher: cannot attach to the rank monitor ({exc}); "
                                       "sections and heartbeats are no-ops")
            return
        me = os.getpid()
        owner = words[L.H_CLIENT_PID]
        if words[L.H_CLIENT_KIND] == L.CLIENT_NVRX and words[L.H_CLIENT_STATE] == 1 and _pid_alive(owner):
            words.release()
            mm.close()
            self._go_noop(("nvrx_owner",), f"ft_launcher: NVRx's RankMonitorClient (pid {owner}) already reports "
                                           f"to this rank's monitor; ft_launcher's own sections, heartbeats and "
                                           f"live state in pid {me} are no-ops")
            return
        if owner and owner != me and words[L.H_CLIENT_STATE] == 1 and _pid_alive(owner):
            words.release()
            mm.close()
            self._go_noop(("owner",), f"ft_launcher: the rank monitor is already attached by pid {owner}; "
                                      f"sections and heartbeats in pid {me} are no-ops")
            return
        try:
            self.config = json.loads(os.environ.get(L.ENV_CONFIG) or "{}")
        except ValueError:
            self.config = {}
        L.clear_client_state(words)
        words[L.H_ATTACH_NS] = _mono()
        self.mm, self.words = mm, words
        self.slots.clear()
        self._install_stack_handler(me)
        words[L.H_CLIENT_PID] = me
        words[L.H_CLIENT_STATE] = 1
        self.mode = "attached"
        flight_recorder.start_from_env(block=(DUMP_SIGNAL,))   # the job-wide flight-recorder dump on a hang
        exit_settle.install()   # the rank's end: torch's threads finish with Python before it finalizes
        for sec in self.sections.values():   # objects made before attaching (none usually)
            sec._bind(self)
        os.register_at_fork(after_in_child=_after_fork_in_child)

    def new_cycle(self) -> None:
        """An in-process restart (rank_monitor.rank_side.inprocess): this process is the rank's next
        incarnation. Its section, heartbeat and timeout words start from nothing, as a new
        process's would; the stack-dump handler and the restart words stay."""
        if self.mode != "attached":
            return
        global _HB_WORDS
        _HB_WORDS = None   # re-armed by the next heartbeat's slow path
        try:
            self.config = json.loads(os.environ.get(L.ENV_CONFIG) or "{}")
        except ValueError:
            self.config = {}
        w = self.words
        L.clear_client_state(w, same_process=True)
        w[L.H_ATTACH_NS] = _mono()
        self.slots.clear()
        w[L.H_CLIENT_PID] = os.getpid()
        w[L.H_CLIENT_STATE] = 1
        for sec in self.sections.values():
            sec._depth = 0
            sec._bind(self)

    def _install_stack_handler(self, pid: int) -> None:
        template = os.environ.get(L.ENV_STACK_FILE)
        if not template:
            return
        try:
            path = template.replace("{pid}", str(pid))
            f = open(path, "w")
            prev = signal.getsignal(DUMP_SIGNAL)
            chain = prev not in (signal.SIG_DFL, signal.SIG_IGN, None)
            faulthandler.register(DUMP_SIGNAL, file=f, all_threads=True, chain=chain)
        except (OSError, ValueError, RuntimeError) as exc:
            _warn(("stack",), f"ft_launcher: cannot install the stack-dump handler ({exc}); "
                              "a hang will be reported without a stack")
            return
        self.stack_file, self.stack_path = f, path
        self.words[L.H_HANDLER_SIG] = DUMP_SIGNAL
        self.words[L.H_HANDLER_PID] = pid

    def _go_noop(self, key, message: str) -> None:
        self.mode = "noop"
        _warn(key, message)
        for sec in self.sections.values():
            sec._w = None

    def shutdown(self) -> None:
        if self.mode == "attached":
            self.words[L.H_CLIENT_STATE] = 2
        self.mode = "shutdown"
        self._unbind_all()

    def _unbind_all(self) -> None:
        global _HB_WORDS
        _HB_WORDS = None
        for sec in self.sections.values():
            sec._w = None

    # ---- sections -----------------------------------------------------------------------
    def section(self, name: str) -> "_Section":
        sec = self.sections.get(name)
        if sec is None:
            if not isinstance(name, str):
                name = str(name)
                sec = self.sections.get(name)
                if sec is not None:
                    return sec
            self.ensure()
            sec = (_CheckpointSection if name == L.CHECKPOINT_SECTION else _Section)(name)
            self.sections[name] = sec
            sec._bind(self)
            if name == "step":  # once: what this rank imported, for the warm reserve of its slot
                import_record.record()
        return sec

    def slot(self, name: str) -> Optional[int]:
        idx = self.slots.get(name)
        if idx is not None:
            return idx
        w = self.words
        data = name.encode("utf-8")
        if len(data) > L.NAME_BYTES:
            _warn(("long", name), f"ft_launcher: section name {name[:40]!r}... is longer than "
                                  f"{L.NAME_BYTES} bytes; it is not monitored")
            return None
        idx = L.add_slot(self.mm, w, data)
        if idx is None:
            _warn(("full", name), f"ft_launcher: more than {L.MAX_SLOTS} section names; "
                                  f"section {name!r} is not monitored")
            return None
        if name in self.calc_sections:
            w[L.slot_base(idx) + L.S_TIMEOUT] = L.encode_timeout(self.calc_sections[name])
        self.slots[name] = idx
        configured = self.config.get("sections", {})
        # Only when some sections have timeouts (a likely typo), and once per job (rank 0): with
        # none configured, the launcher says once that hang detection is off.
        if (configured and name not in configured and name not in self.calc_sections
                and os.environ.get("RANK", "0") == "0"):
            _warn(("unconfigured", name), f"ft_launcher: section {name!r} has no configured timeout (sections with "
                                          f"one: {', '.join(sorted(configured))}); it is timed but not enforced")
        return idx

    def close_all(self) -> None:
        for sec in list(self.sections.values()):
            sec._depth = 0
            w = sec._w
            if w is not None and w[sec._b]:
                sec.__exit__(None, None, None)

    # ---- timeouts -----------------------------------------------------------------------
    def safety_factor(self) -> float:
        return float(self.config.get("safety_factor") or 5.0)

    def computed(self, observed_ns: int) -> float:
        """Observed max -> timeout: x safety_factor, never below the configured floor (a 4 ms
        sample must not become a 20 ms timeout)."""
        return max(observed_ns / 1e9 * self.safety_factor(), float(self.config.get("floor") or 0.0))

    def set_section_timeout(self, name: str, seconds: Optional[float]) -> None:
        self.calc_sections[name] = seconds
        if self.mode == "attached":
            idx = self.slot(name)
            if idx is not None:
                self.words[L.slot_base(idx) + L.S_TIMEOUT] = L.encode_timeout(seconds)

    def set_oos_timeout(self, seconds: Optional[float]) -> None:
        self.calc_oos, self.calc_oos_set = seconds, True
        if self.mode == "attached":
            self.words[L.H_TO_OOS] = L.encode_timeout(seconds)

    def set_hb_timeout(self, kind: str, seconds: Optional[float]) -> None:
        self.calc_hb[kind] = seconds
        if self.mode == "attached":
            self.words[L.H_TO_HB_INIT if kind == "initial" else L.H_TO_HB_SUB] = L.encode_timeout(seconds)

    def computed_timeouts(self) -> Dict[str, Optional[float]]:
        """What this process computed or loaded as computed, under timeout_calc's uniform keys."""
        out = {f"section:{k}": v for k, v in self.calc_sections.items()}
        if self.calc_oos_set:
            out["out_of_section"] = self.calc_oos
        out.update({f"heartbeat:{k}": v for k, v in self.calc_hb.items()})
        return out

    def configured_timeouts(self) -> Dict[str, Optional[float]]:
        cfg = self.config
        out = {f"section:{k}": v for k, v in (cfg.get("sections") or {}).items()}
        out.update({"out_of_section": cfg.get("out_of_section"), "heartbeat:initial": cfg.get("hb_initial"),
                    "heartbeat:subsequent": cfg.get("hb_subsequent")})
        return out

    def apply_state(self, state: Mapping[str, Any]) -> None:
        """Apply the computed timeouts of a state dict: NVRx's `{"current_timeouts": ...}` (from
        its state_dict() or ours, or an ft_state.json), or ft_launcher 0.1's client form. Only
        values marked calculated are applied; a malformed state is one warning and changes nothing."""
        from ft_launcher.rank_monitor import ft_state_file as F

        try:
            if not isinstance(state, Mapping):
                raise F.StateFormatError(f"not a mapping but {type(state).__name__}")
            if F.CURRENT_TIMEOUTS in state:
                if "format_version" in state:   # a whole ft_state.json
                    computed = F.parse(dict(state)).timeouts
                else:
                    computed, _ = F.from_current_timeouts(state[F.CURRENT_TIMEOUTS])
            elif isinstance(state.get("calculated"), Mapping):
                computed = _legacy_client_state(state)
            else:
                raise F.StateFormatError(f"no {F.CURRENT_TIMEOUTS!r} key (keys: {', '.join(map(str, state)) or 'none'})")
        except (F.StateFormatError, TypeError, ValueError, AttributeError) as exc:
            _warn(("badstate", str(exc)), f"ft_launcher: load_state_dict: unusable state ({exc}); "
                                          "running on the configured timeouts")
            return
        for key, value in computed.items():
            kind, _, name = key.partition(":")
            if kind == "section":
                self.set_section_timeout(name, value)
            elif kind == "out_of_section":
                self.set_oos_timeout(value)
            else:
                self.set_hb_timeout(name, value)


def _legacy_client_state(state: Mapping[str, Any]) -> Dict[str, Optional[float]]:
    """ft_launcher 0.1's state_dict(): {section, out_of_section, heartbeat, calculated}."""
    calculated = state["calculated"]
    out: Dict[str, Optional[float]] = {}
    for name in calculated.get("section") or ():
        out[f"section:{name}"] = _secs((state.get("section") or {}).get(name))
    if calculated.get("out_of_section"):
        out["out_of_section"] = _secs(state.get("out_of_section"))
    if calculated.get("heartbeat"):
        hb = state.get("heartbeat") or {}
        out["heartbeat:initial"], out["heartbeat:subsequent"] = _secs(hb.get("initial")), _secs(hb.get("subsequent"))
    return out


def _secs(value) -> Optional[float]:
    return None if value is None else float(value)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_ATT = _Attachment()
_HB_WORDS: Optional[memoryview] = None   # set once the default path is attached: the fast heartbeat
_HB_NOOP = False


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) must not write into its parent's record."""
    global _HB_NOOP
    _ATT.mode = "noop"
    _ATT._unbind_all()
    _HB_NOOP = True


# ---------------------------------------------------------------------------------------------
# The hot path
# ---------------------------------------------------------------------------------------------
class _Section:
    """A named section: context manager and decorator. One object per name per process."""

    __slots__ = ("name", "_w", "_b", "_depth", "__weakref__")

    def __init__(self, name: str) -> None:
        self.name = name
        self._w = None
        self._b = 0
        self._depth = 0

    def _bind(self, att: _Attachment) -> None:
        if att.mode != "attached":
            self._w = None
            return
        idx = att.slot(self.name)
        if idx is None:
            self._w = None
            return
        self._b = L.slot_base(idx)
        self._w = att.words

    def __enter__(self):
        w = self._w
        if w is None:
            return self
        b = self._b
        if w[b]:
            self._depth += 1
            _warn(("reopen", self.name), f"ft_launcher: section {self.name!r} started while already open; "
                                         "the inner start/end pair is ignored")
            return self
        now = _mono()
        w[b + 1] = now             # S_ENTER_NS
        w[b + 2] += 1              # S_ENTERS
        w[b] = 1                   # S_OPEN
        n = w[8]                   # H_OPEN
        if n <= 0:
            last = w[9] or w[6]    # H_LAST_CLOSE_NS, else H_START_NS: start-up counts as out of section
            if last:
                d = now - last
                w[12] = d          # H_OOS_LAST_NS
                w[10] += 1         # H_OOS_COUNT
                if d > w[11]:      # H_OOS_MAX_NS
                    w[11] = d
            n = 0
        w[8] = n + 1
        return self

    def __exit__(self, exc_type=None, exc=None, tb=None):
        w = self._w
        if w is None:
            return False
        if self._depth:
            self._depth -= 1
            return False
        b = self._b
        if not w[b]:
            _warn(("notopen", self.name), f"ft_launcher: section {self.name!r} ended but it is not open; ignored")
            return False
        now = _mono()
        w[b] = 0                   # S_OPEN
        d = now - w[b + 1]
        w[b + 5] = d               # S_LAST_NS
        w[b + 6] += d              # S_TOTAL_NS
        if d > w[b + 4]:           # S_MAX_NS
            w[b + 4] = d
        w[b + 3] += 1              # S_CLOSES
        n = w[8] - 1
        if n <= 0:
            w[9] = now             # H_LAST_CLOSE_NS before the open count drops to 0
            n = 0
        w[8] = n
        return False

    def __call__(self, fn):
        sec = self

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with sec:
                return fn(*args, **kwargs)
        return wrapper

    def __repr__(self) -> str:
        return f"<ft_launcher section {self.name!r}>"


class _CheckpointSection(_Section):
    """The checkpoint section (`checkpointing`): as it closes, it also notes how many `step`
    sections had closed and their total time, the work a restart from this checkpoint keeps (the
    launcher's goodput), and how long it took; a close by an exception is noted apart (that
    checkpoint may not exist). Only this section pays for it; every other section is a plain
    _Section."""

    __slots__ = ("_slots",)

    def _bind(self, att: _Attachment) -> None:
        self._slots = att.slots
        _Section._bind(self, att)

    def __exit__(self, exc_type=None, exc=None, tb=None):
        w = self._w
        if w is None or self._depth:
            return _Section.__exit__(self, exc_type, exc, tb)
        b = self._b
        closes = w[b + 3]
        _Section.__exit__(self, exc_type, exc, tb)
        step = self._slots.get(L.STEP_SECTION)
        if w[b + 3] != closes:
            s = L.slot_base(step) if step is not None else None
            if exc_type is None:
                w[b + L.S_AT_STEP_TOTAL_NS] = w[s + 6] if s is not None else 0   # the step slot's S_TOTAL_NS
                w[b + L.S_AT_STEP_CLOSES] = w[s + 3] if s is not None else 0     # ... and S_CLOSES
                w[b + L.S_AT_CLOSE_NS] = w[b + 5]                              # this one's S_LAST_NS
            else:
                w[b + L.S_RAISED_STEP_TOTAL_NS] = w[s + 6] if s is not None else 0
                w[b + L.S_RAISED_STEP_CLOSES] = w[s + 3] if s is not None else 0
                w[b + L.S_RAISED_NS] = w[b + 5]
                w[b + L.S_RAISED_ENTERS] = w[b + 2]                            # S_ENTERS: this occurrence
        return False


def bound_section(name: str, words: memoryview, index: int, slots: Dict[str, int]) -> _Section:
    """A section object writing into `words` at slot `index` (`slots`: that record's name ->
    slot): the same writes as the rank's own, for a writer that is not the rank's attachment
    (the monitor, for NVRx's client on its socket: monitor_side.nvrx_peers)."""
    sec = (_CheckpointSection if name == L.CHECKPOINT_SECTION else _Section)(name)
    sec._w, sec._b = words, L.slot_base(index)
    if isinstance(sec, _CheckpointSection):
        sec._slots = slots
    return sec


assert (L.S_OPEN, L.S_ENTER_NS, L.S_ENTERS, L.S_CLOSES, L.S_MAX_NS, L.S_LAST_NS, L.S_TOTAL_NS) == (0, 1, 2, 3, 4, 5, 6)
assert (L.H_OPEN, L.H_LAST_CLOSE_NS, L.H_OOS_COUNT, L.H_OOS_MAX_NS, L.H_OOS_LAST_NS) == (8, 9, 10, 11, 12)
assert (L.H_HB_COUNT, L.H_HB_FIRST_NS, L.H_HB_LAST_NS, L.H_HB_MAX_NS, L.H_HB_LAST_IV_NS) == (13, 14, 15, 16, 17)


def _beat(w: memoryview) -> None:
    now = _mono()
    last = w[15]                   # H_HB_LAST_NS
    if last:
        iv = now - last
        w[17] = iv                 # H_HB_LAST_IV_NS
        if iv > w[16]:             # H_HB_MAX_NS
            w[16] = iv
    else:
        w[14] = now                # H_HB_FIRST_NS
    w[15] = now
    w[13] += 1                     # H_HB_COUNT, after the time it publishes


def heartbeat() -> None:
    """Tell the monitor this rank is alive (module-level form, default client)."""
    w = _HB_WORDS
    if w is None:
        if _HB_NOOP:
            return
        _slow_heartbeat()
        return
    now = _mono()
    last = w[15]
    if last:
        iv = now - last
        w[17] = iv
        if iv > w[16]:
            w[16] = iv
    else:
        w[14] = now
    w[15] = now
    w[13] += 1


def _slow_heartbeat() -> None:
    global _HB_WORDS, _HB_NOOP
    if _ATT.ensure():
        _HB_WORDS = _ATT.words
        _beat(_HB_WORDS)
    elif _ATT.mode in ("noop", "shutdown"):
        _HB_NOOP = True


_sections = _ATT.sections


def section(name: str) -> _Section:
    """`with ft_launcher.section("step"): ...` or `@ft_launcher.section("step")`."""
    sec = _sections.get(name)
    if sec is None:
        sec = _ATT.section(name)
    return sec


_section_of = section   # for the methods whose parameter (NVRx's name) hides it


# ---------------------------------------------------------------------------------------------
# NVRx's client surface (nvidia_resiliency_ext.fault_tolerance 0.4.1): same names and fields
# ---------------------------------------------------------------------------------------------
class RankMonitorClientError(Exception):
    """Raised where NVRx's client raises: init_workload_monitoring twice, or a timeout calculation
    without enough data (unless skip_if_not_ready)."""


def _all_ranks_max(local: Dict[str, int]) -> Dict[str, int]:
    """Job-wide maxima when the script has a torch.distributed process group (NVRx's calculations
    are collective: every rank calls them); otherwise this rank's own."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return local
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    out: Dict[str, int] = {}
    for part in parts:
        for key, value in (part or {}).items():
            out[key] = max(out.get(key, 0), value)
    return out


class RankMonitorClient:
    """NVRx's RankMonitorClient over the shared-memory record. All instances share one attachment.

    Attributes as in NVRx: `is_initialized`, `cfg` (the job's FaultToleranceConfig), `hb_timeouts`
    (HeartbeatTimeouts) and `section_timeouts` (SectionTimeouts) in effect (rank_monitor.nvrx_types), `rank_info`,
    `loaded_hb_timeouts` / `loaded_section_timeouts` (from load_state_dict), `logger`.

    Computed timeouts are the observed maximum (over all ranks when a process group exists) x
    safety_factor, at least calc_timeout_floor; a new computation never lowers a timeout computed
    (or loaded) earlier in this process. They take effect at once (the monitor reads them from
    shared memory) and travel across restarts through state_dict/load_state_dict, in NVRx's
    `{"current_timeouts": ...}` shape; only values marked calculated are taken on load.
    Without ft_launcher every call is a no-op (is_initialized stays False, calculations return
    False) instead of NVRx's error.
    """

    CURRENT_TIMEOUTS_STATE_KEY = "current_timeouts"

    def __init__(self) -> None:
        import logging   # the slow path: kept out of `import ft_launcher` (start-up time)

        self._att = _ATT
        self._initialized = False
        self.rank_info = None               # nvrx_types.RankInfo once initialized
        self.loaded_hb_timeouts = None      # nvrx_types.HeartbeatTimeouts from load_state_dict
        self.loaded_section_timeouts = None
        self.logger = logging.getLogger("RankMonitorClient")

    # ---- lifecycle ----------------------------------------------------------------------
    def init_workload_monitoring(self, num_warmup_iters: Optional[int] = None) -> None:
        """Attach to the rank's monitor. `num_warmup_iters` (NVRx 0.7) is accepted and kept in
        `self.num_warmup_iters`: timeouts apply from the first step here. With the job's
        install_exception_hook on, an uncaught exception is reported at raise time
        (rank_monitor.rank_side.excepthook)."""
        if self.is_initialized:
            raise RankMonitorClientError("RankMonitorClient is already initialized")
        import socket

        from ft_launcher.rank_monitor.nvrx_types import RankInfo

        self.num_warmup_iters = num_warmup_iters
        self._initialized = self._att.ensure()
        if self._initialized and self._att.config.get("cfg", {}).get("install_exception_hook"):
            from ft_launcher.rank_monitor.rank_side import excepthook

            excepthook.install()
        self.rank_info = RankInfo(int(os.environ.get("RANK", -1)), int(os.environ.get("LOCAL_RANK", -1)),
                                  socket.gethostname(), os.getpid())

    def shutdown_workload_monitoring(self) -> None:
        self._att.shutdown()
        self._initialized = False

    @property
    def is_initialized(self) -> bool:
        return self._initialized and self._att.mode == "attached"

    @property
    def cfg(self):
        """The job's configuration (rank_monitor.config.FaultToleranceConfig, NVRx's fields)."""
        from ft_launcher.rank_monitor.config import FaultToleranceConfig

        self._att.ensure()
        return FaultToleranceConfig(**self._att.config.get("cfg", {}))

    # ---- sections and heartbeats ---------------------------------------------------------
    def section(self, name: str) -> _Section:
        return section(name)

    def start_section(self, section: str) -> None:   # NVRx's parameter name (start_section(section="step"))
        _section_of(section).__enter__()

    def end_section(self, section: str) -> None:
        sec = _sections.get(section)
        if sec is None:
            sec = _section_of(section)
        sec.__exit__(None, None, None)

    def end_all_sections(self) -> None:
        self._att.close_all()

    def send_heartbeat(self, state: Any = None) -> None:
        heartbeat()

    def send_workload_control_request(self, req: WorkloadControlRequest) -> None:
        """Ask the launcher for a workload action (NVRx's request, or ours of the same names):
        ShutdownWorkload stops the job on every node with the no-restart exit code (93);
        ExcludeThisNode takes this node out and restarts the job on the others (or a spare) when
        enough remain, else stops it the same way; Continue is logged. The agent acts at once."""
        send_workload_control_request(req)

    # ---- computed timeouts ---------------------------------------------------------------
    def _not_ready(self, skip: bool, what: str) -> bool:
        if skip:
            return False
        raise RankMonitorClientError(f"Not enough data to compute timeouts ({what}).")

    def calculate_and_set_section_timeouts(self, selected_sections: Optional[Iterable[str]] = None,
                                           calc_out_of_section: bool = True,
                                           skip_if_not_ready: bool = False) -> bool:
        """Compute and set the timeouts of `selected_sections` (None: every section that has
        completed on some rank; NVRx requires every configured one) and of the time out of
        section. Without an observation for one of them: RankMonitorClientError, or False with
        skip_if_not_ready."""
        att = self._att
        if not att.ensure():
            return False
        w = att.words
        names = sorted(att.slots) if selected_sections is None else list(selected_sections)
        local: Dict[str, int] = {}
        for name in names:
            idx = att.slots.get(name)
            if idx is not None and w[L.slot_base(idx) + L.S_CLOSES]:
                local[f"section:{name}"] = w[L.slot_base(idx) + L.S_MAX_NS]
        oos = w[L.H_OOS_MAX_NS] if w[L.H_OOS_COUNT] else 0
        last = w[L.H_LAST_CLOSE_NS] or w[L.H_START_NS]
        if w[L.H_OPEN] <= 0 and last:          # the span since the last section counts too
            oos = max(oos, _mono() - last)
        if oos:
            local["out_of_section"] = oos
        observed = _all_ranks_max(local)
        if selected_sections is None:   # every section seen so far, on any rank
            names = sorted(k[len("section:"):] for k in observed if k.startswith("section:"))
            if not names:
                return self._not_ready(skip_if_not_ready, "no section has completed yet")
        missing = [n for n in names if f"section:{n}" not in observed]
        if calc_out_of_section and "out_of_section" not in observed:
            missing.append("out of section")
        if missing:
            return self._not_ready(skip_if_not_ready, "nothing observed for " + ", ".join(missing))
        for name in names:
            new, prev = att.computed(observed[f"section:{name}"]), att.calc_sections.get(name)
            att.set_section_timeout(name, max(new, prev) if prev else new)
        if calc_out_of_section:
            new, prev = att.computed(observed["out_of_section"]), att.calc_oos
            att.set_oos_timeout(max(new, prev) if prev else new)
        return True

    def calculate_and_set_hb_timeouts(self, skip_if_not_ready: bool = False) -> bool:
        att = self._att
        if not att.ensure():
            return False
        w = att.words
        local: Dict[str, int] = {}
        if w[L.H_HB_COUNT] >= 1:
            local["initial"] = max(1, w[L.H_HB_FIRST_NS] - (w[L.H_START_NS] or w[L.H_ATTACH_NS]))
        if w[L.H_HB_COUNT] >= 2:
            local["subsequent"] = max(1, w[L.H_HB_MAX_NS])
        observed = _all_ranks_max(local)
        if len(observed) < 2:
            return self._not_ready(skip_if_not_ready, "fewer than 2 heartbeats observed")
        for kind in ("initial", "subsequent"):
            new, prev = att.computed(observed[kind]), att.calc_hb.get(kind)
            att.set_hb_timeout(kind, max(new, prev) if prev else new)
        return True

    calculate_and_set_timeouts = calculate_and_set_hb_timeouts   # NVRx's older name

    # ---- views --------------------------------------------------------------------------
    @property
    def section_timeouts(self):
        """Section timeouts in effect (seconds, None = not enforced): configured, then computed;
        an nvrx_types.SectionTimeouts."""
        from ft_launcher.rank_monitor.nvrx_types import SectionTimeouts

        att = self._att
        att.ensure()
        sections = dict(att.config.get("sections", {}))
        sections.update(att.calc_sections)
        oos = att.calc_oos if att.calc_oos_set else att.config.get("out_of_section")
        return SectionTimeouts(sections, oos, set(att.calc_sections), att.calc_oos_set)

    @property
    def hb_timeouts(self):
        """Heartbeat timeouts in effect: an nvrx_types.HeartbeatTimeouts."""
        from ft_launcher.rank_monitor.nvrx_types import HeartbeatTimeouts

        att = self._att
        att.ensure()
        calc = att.calc_hb
        return HeartbeatTimeouts(calc["initial"] if "initial" in calc else att.config.get("hb_initial"),
                                 calc["subsequent"] if "subsequent" in calc else att.config.get("hb_subsequent"),
                                 "initial" in calc and "subsequent" in calc)

    def state_dict(self) -> Dict[str, Any]:
        """NVRx's shape: {"current_timeouts": {"section": SectionTimeouts fields, "heartbeat":
        HeartbeatTimeouts fields}}, each present only when something in it was computed."""
        from ft_launcher.rank_monitor import ft_state_file as F

        att = self._att
        att.ensure()
        computed = att.computed_timeouts()
        others = {k: v for k, v in att.configured_timeouts().items() if k not in computed}
        return {self.CURRENT_TIMEOUTS_STATE_KEY: F.to_current_timeouts(computed, others)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore computed timeouts; before init_workload_monitoring they wait for the attach."""
        att = self._att
        if not state:
            return
        current = state.get(self.CURRENT_TIMEOUTS_STATE_KEY) if isinstance(state, Mapping) else None
        if isinstance(current, Mapping):
            from ft_launcher.rank_monitor.nvrx_types import HeartbeatTimeouts, SectionTimeouts

            try:   # a malformed state is reported (once) by apply_state
                if isinstance(current.get("heartbeat"), Mapping):
                    self.loaded_hb_timeouts = HeartbeatTimeouts(**current["heartbeat"])
                if isinstance(current.get("section"), Mapping):
                    self.loaded_section_timeouts = SectionTimeouts(**current["section"])
            except TypeError:
                pass
        if att.mode == "unattached":
            att.pending_state = state
        else:  # attached, or no monitor: remember for state_dict
            att.apply_state(state)


def send_workload_control_request(req) -> None:
    """Write `req` (a WorkloadControlRequest, ours or NVRx's: anything with `.action.name` and
    `.description`) into this rank's record; without ft_launcher, one warning and nothing else."""
    name = getattr(getattr(req, "action", None), "name", None)
    if name not in WorkloadAction.__members__:
        _warn(("workload_bad", repr(req)), f"ft_launcher: send_workload_control_request: not a workload "
                                           f"control request: {req!r}; ignored")
        return
    if not _ATT.ensure():
        _warn(("workload",), f"ft_launcher: send_workload_control_request({req}) has no launcher to go to "
                             "(not running under ft_launcher); ignored")
        return
    L.write_request(_ATT.mm, _ATT.words, WorkloadAction[name].value, str(getattr(req, "description", "") or ""))


# ---------------------------------------------------------------------------------------------
# Preemption
# ---------------------------------------------------------------------------------------------
class Preemption:
    """What preempted() returns once SIGTERM has arrived: `signal`, `received` (time.monotonic()
    when it arrived) and `deadline` (time.monotonic() at which the launcher's SIGKILL follows, or
    None where the signal did not come through the launcher); `grace_left` is seconds until then."""

    __slots__ = ("signal", "received", "deadline")

    def __init__(self, signum: int, received: float, deadline: Optional[float]) -> None:
        self.signal, self.received, self.deadline = signum, received, deadline

    @property
    def grace_left(self) -> Optional[float]:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        left = self.grace_left
        return f"<Preemption {signal.Signals(self.signal).name}, " + (
            "grace unknown>" if left is None else f"{left:.1f}s of grace left>")


_PREEMPTION: Optional[Preemption] = None
_preempt_callbacks: list = []
_preempt_prev: Any = None
_preempt_installed = False


def _install_preemption_handler() -> bool:
    global _preempt_prev, _preempt_installed
    if _preempt_installed:
        return True
    try:
        prev = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:   # not the main thread
        _warn(("preempt_thread",), "ft_launcher: preempted()/on_preemption() must first be called from the "
                                   "main thread (it installs a SIGTERM handler); preemption is not reported")
        return False
    _ATT.ensure()
    _preempt_prev, _preempt_installed = prev, True
    return True


def _on_sigterm(signum, frame) -> None:
    global _PREEMPTION
    w = _ATT.words if _ATT.mode == "attached" else None
    reason = w[L.H_STOP_REASON] if w is not None else 0
    if reason == L.STOP_RESTART:   # a restart stops the ranks: end as the rank would have ended
        prev = _preempt_prev
        if callable(prev):
            prev(signum, frame)
            return
        if prev == signal.SIG_IGN:
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    if _PREEMPTION is not None:   # a repeated signal: already reported
        return
    deadline_ns = w[L.H_STOP_DEADLINE_NS] if (w is not None and reason == L.STOP_SHUTDOWN) else 0
    now_ns = _mono()
    _PREEMPTION = Preemption(signum, now_ns / 1e9, deadline_ns / 1e9 if deadline_ns else None)
    for fn in list(_preempt_callbacks):
        fn(_PREEMPTION)


def preempted() -> Optional[Preemption]:
    """None until SIGTERM reaches this rank, then a Preemption (truthy) saying how much grace is
    left before the launcher's SIGKILL. The first call installs the SIGTERM handler: from then on
    SIGTERM no longer ends the rank by itself; save what must be saved and exit."""
    if not _preempt_installed:
        _install_preemption_handler()
    return _PREEMPTION


def on_preemption(fn) -> Any:
    """Call `fn(preemption)` from the SIGTERM handler when the job is being stopped (also usable as
    a decorator). Like preempted(), SIGTERM then no longer ends the rank by itself."""
    _install_preemption_handler()
    _preempt_callbacks.append(fn)
    return fn


__all__ = ["RankMonitorClient", "RankMonitorClientError", "WorkloadAction", "WorkloadControlRequest", "section",
           "heartbeat", "FtSectionWarning", "preempted", "on_preemption", "Preemption",
           "send_workload_control_request"]
