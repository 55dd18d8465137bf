"""The rank side of hang detection: sections, heartbeats and NVRx's RankMonitorClient.

Owns the hot path. Entering or leaving a section and sending a heartbeat write a few integers
(time.monotonic_ns(), counters) into the shared-memory record the rank's monitor created
(see shm_layout): no syscall, no socket, no lock, nothing that waits on the monitor.
Everything else (attaching, registering a section name, warnings, computed timeouts) is the slow
path and happens once per name or on explicit calls.

All clients in one process share one attachment. Without the monitor's environment variable
(plain python, torchrun) every call is a cheap no-op after one warning. Misuse (ending a section
that is not open, nesting a section in itself, a name with no configured timeout) warns once per
name and never raises.
"""
from __future__ import annotations

import faulthandler
import functools
import json
import os
import signal
import sys
import time
import warnings
from typing import Any, Dict, Iterable, Mapping, Optional

from rank_monitor import shm_layout as L

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
        self.calc_hb: Optional[Dict[str, Optional[float]]] = None
        self.pending_state: Optional[Mapping[str, Any]] = None

    # ---- attach / detach ----------------------------------------------------------------
    def ensure(self) -> bool:
        """Attach on first use; True when the hot path is live."""
        if self.mode == "unattached":
            self._attach()
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
        for sec in self.sections.values():   # objects made before attaching (none usually)
            sec._bind(self)
        if self.pending_state is not None:
            state, self.pending_state = self.pending_state, None
            self.apply_state(state)
        os.register_at_fork(after_in_child=_after_fork_in_child)

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
            sec = _Section(name)
            self.sections[name] = sec
            sec._bind(self)
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
        idx = w[L.H_NSLOTS]
        if idx >= L.MAX_SLOTS:
            _warn(("full", name), f"ft_launcher: more than {L.MAX_SLOTS} section names; "
                                  f"section {name!r} is not monitored")
            return None
        b = L.slot_base(idx)
        for i in range(L.SLOT_WORDS):
            w[b + i] = 0
        L.write_name(self.mm, w, idx, data)
        if name in self.calc_sections:
            w[b + L.S_TIMEOUT] = L.encode_timeout(self.calc_sections[name])
        w[L.H_NSLOTS] = idx + 1          # publish last
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

    def set_hb_timeouts(self, initial: Optional[float], subsequent: Optional[float]) -> None:
        self.calc_hb = {"initial": initial, "subsequent": subsequent}
        if self.mode == "attached":
            self.words[L.H_TO_HB_INIT] = L.encode_timeout(initial)
            self.words[L.H_TO_HB_SUB] = L.encode_timeout(subsequent)

    def apply_state(self, state: Mapping[str, Any]) -> None:
        if "current_timeouts" in state and isinstance(state["current_timeouts"], Mapping):
            state = state["current_timeouts"]
        calculated = state.get("calculated")
        sections = state.get("section") or {}
        if isinstance(sections, Mapping) and isinstance(sections.get("section"), Mapping):
            # NVRx's nested form: {"section": {"section": {...}, "out_of_section": s, ...}}
            nested = sections
            sections = nested["section"]
            if "out_of_section" in nested and "out_of_section" not in state:
                state = dict(state, out_of_section=nested["out_of_section"])
        wanted = None if calculated is None else set(calculated.get("section") or ())
        for name, secs in dict(sections).items():
            if wanted is None or name in wanted:
                self.set_section_timeout(str(name), _secs(secs))
        if "out_of_section" in state and (calculated is None or calculated.get("out_of_section")):
            self.set_oos_timeout(_secs(state["out_of_section"]))
        hb = state.get("heartbeat")
        if isinstance(hb, Mapping) and (calculated is None or calculated.get("heartbeat")):
            if hb.get("initial") is not None or hb.get("subsequent") is not None:
                self.set_hb_timeouts(_secs(hb.get("initial")), _secs(hb.get("subsequent")))


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


# ---------------------------------------------------------------------------------------------
# NVRx-compatible client
# ---------------------------------------------------------------------------------------------
class RankMonitorClient:
    """NVRx's RankMonitorClient over the shared-memory record. All instances share one attachment.

    Computed timeouts are the observed maximum x safety_factor, at least calc_timeout_floor; a new
    computation never lowers a timeout computed (or loaded) earlier in this process. They take
    effect at once (the monitor reads them from shared memory) and travel across restarts through
    state_dict/load_state_dict.
    """

    def __init__(self) -> None:
        self._att = _ATT

    # ---- lifecycle ----------------------------------------------------------------------
    def init_workload_monitoring(self) -> None:
        self._att.ensure()

    def shutdown_workload_monitoring(self) -> None:
        self._att.shutdown()

    @property
    def is_initialized(self) -> bool:
        return self._att.mode == "attached"

    # ---- sections and heartbeats ---------------------------------------------------------
    def section(self, name: str) -> _Section:
        return section(name)

    def start_section(self, name: str) -> None:
        section(name).__enter__()

    def end_section(self, name: str) -> None:
        sec = _sections.get(name)
        if sec is None:
            sec = section(name)
        sec.__exit__(None, None, None)

    def end_all_sections(self) -> None:
        self._att.close_all()

    def send_heartbeat(self, state: Any = None) -> None:
        heartbeat()

    # ---- computed timeouts ---------------------------------------------------------------
    def calculate_and_set_section_timeouts(self, selected_sections: Optional[Iterable[str]] = None,
                                           calc_out_of_section: bool = True) -> bool:
        att = self._att
        if not att.ensure():
            return False
        w, done = att.words, True
        names = list(att.slots) if selected_sections is None else list(selected_sections)
        for name in names:
            idx = att.slots.get(name)
            if idx is None or w[L.slot_base(idx) + L.S_CLOSES] == 0:
                _warn(("nocalc", name), f"ft_launcher: section {name!r} has not completed yet; "
                                        "its timeout is not computed")
                done = False
                continue
            new = att.computed(w[L.slot_base(idx) + L.S_MAX_NS])
            prev = att.calc_sections.get(name)
            att.set_section_timeout(name, max(new, prev) if prev else new)
        if calc_out_of_section:
            if w[L.H_OOS_COUNT] == 0:
                _warn(("nocalc-oos",), "ft_launcher: no time between sections observed yet; "
                                       "the out-of-section timeout is not computed")
                done = False
            else:
                new = att.computed(w[L.H_OOS_MAX_NS])
                prev = att.calc_oos
                att.set_oos_timeout(max(new, prev) if prev else new)
        return done

    def calculate_and_set_hb_timeouts(self, skip_if_not_ready: bool = True) -> bool:
        att = self._att
        if not att.ensure():
            return False
        w = att.words
        if w[L.H_HB_COUNT] < 2:
            _warn(("nocalc-hb",), "ft_launcher: fewer than 2 heartbeats observed; heartbeat timeouts not computed")
            return False
        start = w[L.H_START_NS] or w[L.H_ATTACH_NS]
        initial = att.computed(max(0, w[L.H_HB_FIRST_NS] - start))
        subsequent = att.computed(w[L.H_HB_MAX_NS])
        prev = att.calc_hb or {}
        if prev.get("initial"):
            initial = max(initial, prev["initial"])
        if prev.get("subsequent"):
            subsequent = max(subsequent, prev["subsequent"])
        att.set_hb_timeouts(initial, subsequent)
        return True

    calculate_and_set_timeouts = calculate_and_set_hb_timeouts   # NVRx's older name

    # ---- views --------------------------------------------------------------------------
    @property
    def section_timeouts(self) -> Dict[str, Optional[float]]:
        """Effective section timeouts (seconds, None = not enforced): config, then computed."""
        att = self._att
        out = dict(att.config.get("sections", {}))
        out.update(att.calc_sections)
        return out

    @property
    def out_of_section_timeout(self) -> Optional[float]:
        att = self._att
        return att.calc_oos if att.calc_oos_set else att.config.get("out_of_section")

    @property
    def hb_timeouts(self) -> Dict[str, Optional[float]]:
        att = self._att
        if att.calc_hb is not None:
            return dict(att.calc_hb)
        return {"initial": att.config.get("hb_initial"), "subsequent": att.config.get("hb_subsequent")}

    def state_dict(self) -> Dict[str, Any]:
        att = self._att
        return {
            "section": self.section_timeouts,
            "out_of_section": self.out_of_section_timeout,
            "heartbeat": self.hb_timeouts,
            "calculated": {
                "section": sorted(att.calc_sections),
                "out_of_section": att.calc_oos_set,
                "heartbeat": att.calc_hb is not None,
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore computed timeouts; before init_workload_monitoring they wait for the attach."""
        att = self._att
        if not state:
            return
        if att.mode == "attached":
            att.apply_state(state)
        elif att.mode == "unattached":
            att.pending_state = state
        else:  # no monitor: remember for state_dict
            att.apply_state(state)


__all__ = ["RankMonitorClient", "section", "heartbeat", "FtSectionWarning"]
