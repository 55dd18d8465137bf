"""ft_launcher's public API for training scripts: sections, heartbeats and NVRx's client.

Every name is loaded on first use (PEP 562), so importing the package costs nothing: the agent,
the rank monitors and the warm reserves are its subpackages `ft_launcher.agent` and
`ft_launcher.rank_monitor` (the repository keeps them in agent/ and rank_monitor/ beside this
folder; an installation puts them inside it), and they must start fast. The implementation of
the names below is in ft_launcher.rank_monitor.rank_side (sections: section, heartbeat;
nvrx_api: NVRx's client; preemption; warn_once; inprocess; live_state), rank_monitor.nvrx_types
and rank_monitor.config. The calls are cheap no-ops (after one warning)
when the script is not running under ft_launcher. An NVRx script changes only its import:
`from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient` becomes
`from ft_launcher import RankMonitorClient`; the names below are those NVRx's fault_tolerance
package gives a training script, plus HeartbeatTimeouts and SectionTimeouts. In-process restart:
`restartable(fn)`; the state it keeps in memory across one (zero rollback): `LiveState`. Preemption: `preempted()` / `on_preemption(fn)`; a rank's request to stop the
job or leave its node: `send_workload_control_request(WorkloadControlRequest(WorkloadAction...))`.
"""
import os as _os

__version__ = "0.1.0"

# A source checkout (a setup.cfg beside this folder) keeps agent/ and rank_monitor/ next to it;
# they are still imported as ft_launcher.agent and ft_launcher.rank_monitor, never top-level, so a
# user's agent.py or rank_monitor.py cannot stand in for them. Only those two folders: the
# checkout's tests/, bench/, docs/ and examples/ are no part of the package.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
_SUBPACKAGES = ("agent", "rank_monitor")


class _CheckoutFinder:
    """Finds ft_launcher.agent and ft_launcher.rank_monitor in a source checkout."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        prefix, _, sub = name.partition(".")
        if prefix != __name__ or sub not in _SUBPACKAGES:
            return None
        import importlib.util

        folder = _os.path.join(_checkout, sub)
        return importlib.util.spec_from_file_location(name, _os.path.join(folder, "__init__.py"),
                                                      submodule_search_locations=[folder])


if (not _os.path.isdir(_os.path.join(__path__[0], "agent"))
        and _os.path.isfile(_os.path.join(_checkout, "setup.cfg"))
        and _os.path.isfile(_os.path.join(_checkout, "agent", "__init__.py"))):
    import sys as _sys

    _sys.meta_path.insert(0, _CheckoutFinder)

_RANK_SIDE = "ft_launcher.rank_monitor.rank_side."
_LAZY = {"section": _RANK_SIDE + "sections",
         "heartbeat": _RANK_SIDE + "sections",
         "RankMonitorClient": _RANK_SIDE + "nvrx_api",
         "RankMonitorClientError": _RANK_SIDE + "nvrx_api",
         "send_workload_control_request": _RANK_SIDE + "nvrx_api",
         "Preemption": _RANK_SIDE + "preemption",
         "preempted": _RANK_SIDE + "preemption",
         "on_preemption": _RANK_SIDE + "preemption",
         "FtSectionWarning": _RANK_SIDE + "warn_once"}
_LAZY.update({"WorkloadAction": "ft_launcher.rank_monitor.workload_requests",
              "WorkloadControlRequest": "ft_launcher.rank_monitor.workload_requests",
              "RestartInPlace": "ft_launcher.rank_monitor.rank_side.inprocess",
              "restartable": "ft_launcher.rank_monitor.rank_side.inprocess",
              "LiveState": "ft_launcher.rank_monitor.rank_side.live.live_state",
              "FaultToleranceConfig": "ft_launcher.rank_monitor.config",
              "HeartbeatTimeouts": "ft_launcher.rank_monitor.nvrx_types",
              "SectionTimeouts": "ft_launcher.rank_monitor.nvrx_types"})

__all__ = ["section", "heartbeat", "RankMonitorClient", "RankMonitorClientError", "FaultToleranceConfig",
           "HeartbeatTimeouts", "SectionTimeouts", "WorkloadAction", "WorkloadControlRequest", "FtSectionWarning",
           "preempted", "on_preemption", "Preemption", "send_workload_control_request", "restartable",
           "RestartInPlace", "LiveState"]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ft_launcher' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
