"""NVRx's `ft_launcher` flags that are not fault-tolerance keys: accepted in NVRx's spellings, so an
NVRx 0.4.1 or 0.7 command line runs here unchanged.

The fault-tolerance keys (`--ft-<key>`, NVRx 0.7's included) are rank_monitor.config's and are
added by ft_launcher.flags from FIELD_NAMES; this module owns the rest: the flags whose job this
launcher does another way, or always does (`--ft-restart-policy any-failed`), and the services
that are not ours (the attribution service, the gRPC log server). `notes(args)` gives one line for
each such flag on the command line saying what ft_launcher does instead; keys without a meaning
here get theirs from `key_notes(cfg, given)`. Nothing here changes what the job does.
"""
from __future__ import annotations

import argparse
from typing import Dict, Iterable, List

_LOGS = "per-rank, per-cycle logs go to <--log-dir>/cycle_N/rank_R.log and the launcher's lines to its stdout"
_ATTRIBUTION = ("no attribution service here: each failure's cause (rank, section, exception, stack) is "
                "one line on the console and an event in <--log-dir>/events.jsonl")
_LOG_SERVER = "no gRPC log server here: " + _LOGS

# flag (dashed, without --) -> (argparse kwargs, the line printed when it is given; None: silent)
# (--logs-specs is torchrun's flag, which NVRx passes on: flag_notes.TORCHRUN_NOTES takes it)
FLAGS: Dict[str, tuple] = {
    "ft-restart-policy": (dict(choices=["any-failed", "min-healthy"]),
                          "restarts happen on any failure (any-failed); --nnodes MIN:MAX keeps hot spares, "
                          "restart_granularity chooses what restarts"),
    "ft-ignore-missing-cfg": (dict(action="store_true"), None),   # no config is ever required here
    "ft-rdzv-impl": (dict(choices=["barrier"]), None),             # our rounds are a barrier on the TCPStore
    "ft-per-cycle-applog-prefix": ({}, None),   # built: agent.observation.nvrx_logs
    "ft-nvrx-logfile": ({}, None),              # built: agent.observation.nvrx_logs
    "ft-enable-log-server": ({}, _LOG_SERVER),
    "ft-log-server-port": ({}, _LOG_SERVER),
    "ft-log-aggregator-count": ({}, _LOG_SERVER),
    "ft-log-leaf-max-queue-chunks": ({}, _LOG_SERVER),
    "ft-log-server-log-prefix": ({}, _LOG_SERVER),
    "ft-log-server-graceful-shutdown-timeout": ({}, _LOG_SERVER),
    "ft-node-health-check-endpoint": ({}, "no node health check service here: the agent checks GPUs (NVML) and "
                                          "disks itself before each rendezvous (health_checks)"),
    "ft-attribution-startup-timeout": ({}, _ATTRIBUTION),
    "ft-attribution-llm-api-key-file": ({}, _ATTRIBUTION),
    "ft-attribution-llm-base-url": ({}, _ATTRIBUTION),
    "ft-attribution-llm-model": ({}, _ATTRIBUTION),
    "ft-attribution-analysis-backend": ({}, _ATTRIBUTION),
    "ft-attribution-log-level": ({}, _ATTRIBUTION),
}
# NVRx 0.4.1's deprecated spellings
OLD_SPELLINGS = {"ft-restart-policy": ["--restart-policy", "--restart_policy"],
                 "ft-ignore-missing-cfg": ["--ignore-missing-fault-tol-cfg"]}
# Spellings of our own flags that NVRx uses.
CFG_PATH_SPELLINGS = ("--ft-cfg_path", "--fault-tol-cfg-path")

# fault-tolerance keys with no effect here -> what does their job (None: nothing to say)
KEY_NOTES = {
    "cycle_info_dir": None,   # built: agent.observation.nvrx_cycle_info
    "checkpoint_iteration_file": None,   # built: agent.recovery.progress
    "min_progress_iterations": None,     # built: agent.recovery.progress
    "num_warmup_iterations": "section and out-of-section timeouts apply from the first step here; give a "
                             "longer first section (e.g. setup) or use calc_ft_timeouts",
    "enable_nic_healthcheck": None,      # built: agent.recovery.health_checks (NIC port states)
    "enable_nic_monitor": None,
    "enable_dist_storage_healthcheck": None,   # built: agent.recovery.health_checks (Lustre, NFS mounts)
    "link_state_path_template": None,    # built: agent.recovery.health_checks
    "link_down_path_template": "no in-training NIC link_downed counters are read here (enable_nic_monitor); "
                               "NIC port states are checked before each rendezvous (enable_nic_healthcheck)",
    "pci_topo_file": "no GPU-to-NIC mapping is needed here: every NIC's port state is checked before each "
                     "rendezvous (enable_nic_healthcheck)",
    "skip_section_response": None,   # built: NVRx 0.6+'s client on the monitor's socket (monitor_side.nvrx_peers)
    "segment": None,   # built: agent.rounds.segments
    "numa_bind_strict": None,   # built: agent.ranks.numa_bind (its line comes from ft_launcher.flag_notes)
    "check_remaining_processes": None,   # every rank's process group is killed and checked here anyway
    "attribution_endpoint": _ATTRIBUTION,
    "attribution_stop_action": _ATTRIBUTION,
    "attribution_export_url": _ATTRIBUTION,
    "segment_health_check_dir": "segment health decisions are not read here; the agent runs its own "
                                "health checks before each rendezvous",
}


def _dest(name: str) -> str:
    return "nvrx__" + name.replace("-", "_")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add NVRx's flags (both spellings, hidden from --help)."""
    for name, (kwargs, _) in FLAGS.items():
        spellings = [f"--{name}", f"--{name.replace('-', '_')}"]
        if name.startswith("ft-"):
            spellings.append(f"--ft-{name[3:].replace('-', '_')}")
        spellings += OLD_SPELLINGS.get(name, [])
        parser.add_argument(*dict.fromkeys(spellings), dest=_dest(name), default=None,
                            help=argparse.SUPPRESS, **kwargs)


def notes(args: argparse.Namespace) -> List[str]:
    """One line per NVRx flag given that has no effect here (the same line once)."""
    out: List[str] = []
    for name, (_, line) in FLAGS.items():
        if line is not None and getattr(args, _dest(name), None) not in (None, False):
            text = f"--{name}: accepted for NVRx; {line}"
            if text not in out:
                out.append(text)
    return out


def key_notes(given: Iterable[str]) -> List[str]:
    """One line per fault-tolerance key given (flag or YAML) that has no effect here."""
    return [f"{key}: accepted for NVRx, no effect here; {KEY_NOTES[key]}"
            for key in sorted(set(given)) if KEY_NOTES.get(key)]
