"""ft_launcher's public API for training scripts: sections, heartbeats and NVRx's client.

Re-exports only; the implementation is rank_monitor.client, with rank_monitor.nvrx_types and
rank_monitor.config for the names loaded on first use (they cost start-up time). The calls are
cheap no-ops (after one warning) when the script is not running under ft_launcher. An NVRx script
changes only its import: `from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient`
becomes `from ft_launcher import RankMonitorClient`; the names below are those NVRx's
fault_tolerance package gives a training script, plus HeartbeatTimeouts and SectionTimeouts.
In-process restart: `restartable(fn)` (rank_monitor.inprocess). Preemption: `preempted()` / `on_preemption(fn)`; a rank's request to stop the job or leave its
node: `send_workload_control_request(WorkloadControlRequest(WorkloadAction...))`.
"""
from rank_monitor.client import (FtSectionWarning, Preemption, RankMonitorClient, RankMonitorClientError,
                                 WorkloadAction, WorkloadControlRequest, heartbeat, on_preemption, preempted,
                                 section, send_workload_control_request)

__version__ = "0.1.0"

from rank_monitor.inprocess import RestartInPlace, restartable

_LAZY = {"FaultToleranceConfig": "rank_monitor.config", "HeartbeatTimeouts": "rank_monitor.nvrx_types",
         "SectionTimeouts": "rank_monitor.nvrx_types"}

__all__ = ["section", "heartbeat", "RankMonitorClient", "RankMonitorClientError", "FaultToleranceConfig",
           "HeartbeatTimeouts", "SectionTimeouts", "WorkloadAction", "WorkloadControlRequest", "FtSectionWarning",
           "preempted", "on_preemption", "Preemption", "send_workload_control_request", "restartable",
           "RestartInPlace"]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ft_launcher' has no attribute {name!r}")
