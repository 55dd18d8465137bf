"""NVRx's client surface (nvidia_resiliency_ext.fault_tolerance 0.4.1), same names and fields, over
the rank's shared-memory record: RankMonitorClient with NVRx's attributes (the HeartbeatTimeouts
and SectionTimeouts of rank_monitor.nvrx_types), RankMonitorClientError, raised only where NVRx
raises it (a second init_workload_monitoring, a timeout calculation without data unless
skip_if_not_ready), and send_workload_control_request, which hands NVRx's WorkloadControlRequest
to the launcher through the record: ShutdownWorkload stops the job (no restart), ExcludeThisNode
takes this node out of the job.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Dict, Iterable, Mapping, Optional

from ft_launcher.rank_monitor import shm_layout as L
from ft_launcher.rank_monitor.rank_side.sections import _Section, _section_of, heartbeat, section
from ft_launcher.rank_monitor.rank_side.shm_attachment import _ATT
from ft_launcher.rank_monitor.rank_side.warn_once import _warn
from ft_launcher.rank_monitor.workload_requests import WorkloadAction, WorkloadControlRequest

_mono = time.monotonic_ns
# Bound by assignment, not imported: CPython 3.11 calls a method of an imported name without
# LOAD_METHOD, and end_section's _sections.get is on NVRx's per-step path.
_sections = _ATT.sections


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


__all__ = ["RankMonitorClient", "RankMonitorClientError", "WorkloadAction", "WorkloadControlRequest",
           "send_workload_control_request"]
