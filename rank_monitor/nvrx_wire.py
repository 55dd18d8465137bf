"""NVRx's rank-monitor socket protocol without NVRx: reading a peer's messages safely and writing
replies that NVRx's client unpickles as its own classes.

The protocol (nvidia-resiliency-ext 0.4.1 to 0.7, fault_tolerance/data.py and utils.py): a Unix
stream socket per rank (`FT_RANK_MONITOR_IPC_SOCKET`), each message a 4-byte big-endian length
and a pickle. The client sends AuthkeyMsg (answered OkMsg), InitMsg (answered
OkMsg(cfg=FaultToleranceConfig)), then SectionMsg / HeartbeatMsg / UpdateConfigMsg, each answered
OkMsg or ErrorMsg(cause). Workload control requests go to `FT_LAUNCHER_IPC_SOCKET` on a
connection of their own: one pickled `(global_rank, WorkloadControlRequest)`, answered with the
pickled bytes `b"ok"`.

What changed by version, and what is covered here:
- 0.6+ InitMsg carries `iteration` and `num_warmup_iters`; 0.4.1 and 0.5 set only `rank_info`
  on a bare InitMsg. SectionMsg carries `iteration` from 0.6. UpdateConfigMsg has
  `current_cycle` (sent by 0.7's launcher, never by its client). All are accepted.
- From 0.5 the client waits for no reply to a SectionMsg or HeartbeatMsg when the configuration
  it got says `skip_section_response` (0.7's default is true). A 0.5 client cannot be told from a
  0.4.1 one, so the configuration sent back says `skip_section_response: false` to every client
  whose InitMsg has no `num_warmup_iters` (0.4.1 ignores the key, 0.5 then waits for the replies
  it gets), and the job's value to the others (`Peer.quiet`: no reply is then written).
- 0.7's client sends no SectionMsg for a section its configuration has no timeout for, and
  installs NVRx's exception hook when `install_exception_hook` says so: the configuration sent
  back carries the job's timeouts and that key.

Reading: `safe_pickle` with a table of NVRx's message and value classes only; each becomes a
`WireObject` (its fields, nothing else: NVRx need not be importable, and no class of NVRx runs),
and `decode` checks every field's type and turns the message into a plain `Message`. Anything
else is a `ProtocolError` with a one-line cause, answered ErrorMsg. Writing: `encode` pickles
`ByName` stand-ins as the named class (GLOBAL + REDUCE + BUILD), so the client's own unpickler
builds NVRx's OkMsg, ErrorMsg, FaultToleranceConfig and signal.Signals.
"""
from __future__ import annotations

import io
import math
import pickle
from typing import Any, Dict, Mapping, Optional, Tuple

from ft_launcher.rank_monitor import safe_pickle
from ft_launcher.rank_monitor.workload_requests import WorkloadAction

ENV_RANK_MONITOR_SOCKET = "FT_RANK_MONITOR_IPC_SOCKET"
ENV_LAUNCHER_SOCKET = "FT_LAUNCHER_IPC_SOCKET"
DATA = "nvidia_resiliency_ext.fault_tolerance.data"
CONFIG = "nvidia_resiliency_ext.fault_tolerance.config"
MAX_MESSAGE = 1 << 20    # bytes; NVRx's messages are a few hundred

# NVRx's FaultToleranceConfig fields (0.4.1 and 0.7, fault_tolerance/config.py): what the
# configuration sent back holds (a 0.4.1 client keeps 0.7's as plain attributes).
CONFIG_FIELDS = (
    "workload_check_interval", "initial_rank_heartbeat_timeout", "rank_heartbeat_timeout",
    "rank_section_timeouts", "rank_out_of_section_timeout", "node_health_check_interval", "safety_factor",
    "rank_termination_signal", "log_level", "restart_check_interval", "enable_nic_monitor",
    "enable_nic_healthcheck", "enable_dist_storage_healthcheck", "storage_healthcheck_path", "pci_topo_file",
    "link_down_path_template", "link_state_path_template", "skip_section_response", "segment",
    "numa_bind_strict", "gpu_memory_reclaim_timeout", "gpu_memory_tolerance_mb", "gpu_memory_poll_interval",
    "check_remaining_processes", "max_no_progress_cycles", "min_progress_iterations",
    "checkpoint_iteration_file", "install_exception_hook", "num_warmup_iterations", "attribution_endpoint",
    "attribution_stop_action", "attribution_export_url", "cycle_info_dir", "segment_health_check_dir",
)

SECTION_ACTIONS = {1: "open", 2: "close", 3: "close_all"}    # NVRx's SectionAction values
WORKLOAD_ACTIONS = {a.value: a.name for a in WorkloadAction}  # NVRx's WorkloadAction values


def socket_path(record_path: str) -> str:
    """Where the monitor of the shared-memory record `record_path` serves NVRx's client."""
    return record_path + ".nvrx.sock"


class ProtocolError(ValueError):
    """A message this side does not accept; str() is the one-line cause sent back."""


# ---- reading ----------------------------------------------------------------------------------
class WireObject:
    """One of NVRx's objects as a peer's pickle describes it: constructor arguments (enums:
    `SectionAction(1)`) and fields (BUILD's state). Nothing of NVRx runs to make it."""

    wire_name = "?"

    def __new__(cls, *args, **kwargs):   # NEWOBJ calls __new__ only; REDUCE calls the class
        obj = object.__new__(cls)
        obj.args, obj.fields = args, {}
        return obj

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __setstate__(self, state) -> None:
        if isinstance(state, tuple) and len(state) == 2:   # (dict, slots dict)
            merged: Dict[Any, Any] = {}
            for part in state:
                if part is not None and not isinstance(part, dict):
                    raise ProtocolError(f"{self.wire_name}: its state is not a mapping")
                merged.update(part or {})
            state = merged
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise ProtocolError(f"{self.wire_name}: its state is not a mapping of field names")
        self.fields.update(state)

    def __repr__(self) -> str:
        return f"<{self.wire_name} {self.fields or self.args}>"


_DATA_CLASSES = ("AuthkeyMsg", "InitMsg", "HeartbeatMsg", "SectionMsg", "SectionAction", "UpdateConfigMsg",
                 "HeartbeatTimeouts", "SectionTimeouts", "RankInfo", "WorkloadControlRequest", "WorkloadAction")
ADMITTED: Dict[Tuple[str, str], type] = {
    (DATA, name): type(name, (WireObject,), {"wire_name": name}) for name in _DATA_CLASSES}


class Message:
    """A peer's message, checked: `kind` and its fields as plain values."""

    def __init__(self, kind: str, **fields: Any) -> None:
        self.kind = kind
        self.__dict__.update(fields)

    def __repr__(self) -> str:
        return f"Message({self.__dict__})"


def _is(obj: Any, name: str) -> bool:
    return isinstance(obj, WireObject) and obj.wire_name == name


def _field(obj: WireObject, name: str, default: Any = None) -> Any:
    return obj.fields.get(name, default)


def _timeout(value: Any, what: str) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ProtocolError(f"{what} is not a positive number of seconds or None: {value!r}")
    return float(value)


def _int(value: Any, what: str, none_ok: bool = True) -> Optional[int]:
    if value is None and none_ok:
        return None
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():   # NVRx 0.4.1: RANK from the env
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{what} is not an integer: {value!r}")
    return value


def _str(value: Any, what: str, none_ok: bool = False) -> Optional[str]:
    if value is None and none_ok:
        return None
    if not isinstance(value, str):
        raise ProtocolError(f"{what} is not a string: {value!r}")
    return value


def _enum(obj: Any, name: str, values: Mapping[int, str]) -> str:
    if not _is(obj, name) or len(obj.args) != 1 or obj.args[0] not in values or isinstance(obj.args[0], bool):
        raise ProtocolError(f"not a {name}: {obj!r}")
    return values[obj.args[0]]


def _update(obj: WireObject) -> Message:
    hb = _field(obj, "hb_timeouts")
    sec = _field(obj, "section_timeouts")
    out = Message("update_config", heartbeat=None, sections=None)
    if hb is not None:
        if not _is(hb, "HeartbeatTimeouts"):
            raise ProtocolError(f"hb_timeouts is not a HeartbeatTimeouts: {hb!r}")
        out.heartbeat = {"initial": _timeout(_field(hb, "initial"), "hb_timeouts.initial"),
                         "subsequent": _timeout(_field(hb, "subsequent"), "hb_timeouts.subsequent"),
                         "were_calculated": bool(_field(hb, "were_calculated"))}
    if sec is not None:
        if not _is(sec, "SectionTimeouts"):
            raise ProtocolError(f"section_timeouts is not a SectionTimeouts: {sec!r}")
        section = _field(sec, "section", {})
        calculated = _field(sec, "calculated_sections", set())
        if not isinstance(section, dict) or not isinstance(calculated, (set, frozenset, list, tuple, dict)):
            raise ProtocolError("section_timeouts has no mapping of sections")
        out.sections = {
            "section": {_str(k, "a section name"): _timeout(v, f"section {k!r}'s timeout") for k, v in section.items()},
            "calculated": {_str(k, "a calculated section's name") for k in calculated},
            "out_of_section": _timeout(_field(sec, "out_of_section"), "section_timeouts.out_of_section"),
            "out_of_section_calculated": bool(_field(sec, "is_out_of_section_calculated")),
        }
    return out


def decode(payload: bytes) -> Message:
    """One message's pickle -> Message; ProtocolError (one line) for anything else."""
    try:
        obj = safe_pickle.loads(payload, ADMITTED)
    except ProtocolError:
        raise
    except Exception as exc:  # noqa: BLE001 - UnsafePickle or not a pickle: nothing was called
        raise ProtocolError(f"message refused: {safe_pickle.why_not(exc)}") from None
    if isinstance(obj, tuple) and len(obj) == 2 and _is(obj[1], "WorkloadControlRequest"):
        req = obj[1]
        return Message("request", rank=_int(obj[0], "the request's rank"),
                       action=_enum(_field(req, "action"), "WorkloadAction", WORKLOAD_ACTIONS),
                       description=str(_field(req, "description", "") or "")[:512])
    if not isinstance(obj, WireObject):
        raise ProtocolError(f"message refused: a {type(obj).__name__}, not one of NVRx's messages")
    name = obj.wire_name
    if name == "AuthkeyMsg":
        return Message("authkey")
    if name == "InitMsg":
        info = _field(obj, "rank_info")
        if not _is(info, "RankInfo"):
            raise ProtocolError(f"InitMsg without a RankInfo: {info!r}")
        return Message("init", rank=_int(_field(info, "global_rank"), "rank_info.global_rank"),
                       local_rank=_int(_field(info, "local_rank"), "rank_info.local_rank"),
                       pid=_int(_field(info, "pid"), "rank_info.pid"),
                       reads_skip_flag="num_warmup_iters" in obj.fields,
                       num_warmup_iters=_int(_field(obj, "num_warmup_iters"), "num_warmup_iters"))
    if name == "HeartbeatMsg":
        return Message("heartbeat")
    if name == "SectionMsg":
        action = _enum(_field(obj, "action"), "SectionAction", SECTION_ACTIONS)
        section = _str(_field(obj, "section"), "the section's name", none_ok=action == "close_all")
        return Message("section", action=action, section=section)
    if name == "UpdateConfigMsg":
        return _update(obj)
    raise ProtocolError(f"message refused: {name} is not a message a rank sends")


class Frames:
    """Reassembles length-prefixed messages from a non-blocking stream."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> None:
        self.buf += data

    def next(self) -> Optional[bytes]:
        """The next whole message, or None; ProtocolError when its length is absurd."""
        buf = self.buf
        if len(buf) < 4:
            return None
        size = int.from_bytes(buf[:4], "big")
        if size > MAX_MESSAGE:
            raise ProtocolError(f"message refused: {size} bytes announced (at most {MAX_MESSAGE})")
        if len(buf) < 4 + size:
            return None
        payload = bytes(buf[4:4 + size])
        del buf[:4 + size]
        return payload


# ---- writing ----------------------------------------------------------------------------------
class _Ref:
    """A class named by module and name: pickled as GLOBAL, never imported here."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *args):   # save_reduce wants a callable; never called
        raise TypeError(f"{self.module}.{self.name} is only a name here")


class ByName:
    """An instance of `module.name` to be built by the reader: `cls(*args)`, then `state` set."""

    def __init__(self, module: str, name: str, state: Optional[dict] = None, args: tuple = ()) -> None:
        self.ref, self.state, self.args = _Ref(module, name), state, args


class _Encoder(pickle._Pickler):   # the Python pickler: its dispatch table takes _Ref
    dispatch = dict(pickle._Pickler.dispatch)

    def _save_ref(self, ref: _Ref) -> None:
        self.write(pickle.GLOBAL + f"{ref.module}\n{ref.name}\n".encode("utf-8"))
        self.memoize(ref)

    dispatch[_Ref] = _save_ref

    def reducer_override(self, obj):
        if type(obj) is ByName:
            return obj.ref, obj.args, obj.state or None
        return NotImplemented


def encode(obj: Any) -> bytes:
    """One framed message: length + pickle (ByName objects as the classes they name)."""
    out = io.BytesIO()
    _Encoder(out, protocol=4).dump(obj)
    payload = out.getvalue()
    return len(payload).to_bytes(4, "big") + payload


def ok(**fields: Any) -> bytes:
    return encode(ByName(DATA, "OkMsg", fields))


def error(cause: str) -> bytes:
    return encode(ByName(DATA, "ErrorMsg", {"cause": cause}))


OK = ok()
LAUNCHER_OK = len(pickle.dumps(b"ok")).to_bytes(4, "big") + pickle.dumps(b"ok")


def config(cfg: Any, timeouts: Mapping[str, Any], skip_section_response: bool) -> ByName:
    """NVRx's FaultToleranceConfig for a client: the job's values of NVRx's fields, with
    `timeouts` (rank_section_timeouts, rank_out_of_section_timeout,
    initial_rank_heartbeat_timeout, rank_heartbeat_timeout) as this monitor has them now."""
    state: Dict[str, Any] = {}
    for name in CONFIG_FIELDS:
        if name in timeouts:
            value = timeouts[name]
        elif hasattr(cfg, name):
            value = getattr(cfg, name)
        else:
            continue
        if name == "rank_termination_signal":
            value = ByName("signal", "Signals", args=(int(value),))
        elif name == "rank_section_timeouts":
            value = dict(value)
        elif name == "log_level":
            value = int(value)
        state[name] = value
    state["skip_section_response"] = bool(skip_section_response)
    return ByName(CONFIG, "FaultToleranceConfig", state)
