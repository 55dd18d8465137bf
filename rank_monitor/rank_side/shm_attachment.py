"""The rank's one mapping of its monitor's shared-memory record (shm_layout), shared by every
client in the process: attaching (or going no-op, once, with one warning: no launcher, an
unusable record, the record already owned by NVRx's client or another process), a new cycle
after an in-process restart, detaching at shutdown and in a forked child, the section-name
slots, the stack-dump handler, and the timeouts this process computed or loaded from a state
dict (written into the record, where the monitor reads them; an unusable state dict is one
warning and changes nothing).

The hot path that writes into the record is rank_side.sections; it imports `_ATT` from here, so
this module reaches it only from slow paths (creating a section object, forgetting the bound
words), by a late import.
"""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import time
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional

from ft_launcher.rank_monitor import flight_recorder
from ft_launcher.rank_monitor import shm_layout as L
from ft_launcher.rank_monitor.rank_side import exit_settle, import_record
from ft_launcher.rank_monitor.rank_side.warn_once import _warn

if TYPE_CHECKING:
    from ft_launcher.rank_monitor.rank_side.sections import _Section

_mono = time.monotonic_ns

DUMP_SIGNAL = int(signal.SIGUSR2)


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
        from ft_launcher.rank_monitor.rank_side import sections

        sections._HB_WORDS = None   # re-armed by the next heartbeat's slow path
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
        from ft_launcher.rank_monitor.rank_side import sections

        sections._HB_WORDS = None
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
            from ft_launcher.rank_monitor.rank_side.sections import _CheckpointSection, _Section

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


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) must not write into its parent's record."""
    from ft_launcher.rank_monitor.rank_side import sections

    _ATT.mode = "noop"
    _ATT._unbind_all()
    sections._HB_NOOP = True
