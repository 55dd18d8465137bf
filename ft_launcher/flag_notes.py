"""One line each for what the launcher takes but handles its own way, said before the job starts:
torchrun's flags that act differently here (TORCHRUN_NOTES; --virtual-local-rank is refused),
NVRx's flags and fault-tolerance keys without an effect here (nvrx_flags), and the NIC health check
and NUMA binding asked for on a node that cannot do them. Nothing here changes what the job does.
"""
from __future__ import annotations

import os
import sys
from typing import Dict

from ft_launcher import nvrx_flags
from ft_launcher.flags import PROG, UsageError
from ft_launcher.rank_monitor.config import FaultToleranceConfig

# torchrun 2.13 flags ft_launcher takes but does not act on as torchrun does: one line each, said
# when the flag is given a value other than torchrun's default (flag dest -> (default, the line)).
TORCHRUN_NOTES = {
    "event_log_handler": ("null", "torch's event handlers are not called; ft_launcher writes its events to "
                                  "<log dir>/events.jsonl (--log-dir)"),
    "logs_specs": (None, "no LogsSpecs plugin is loaded; ft_launcher lays out rank logs itself (--log-dir, "
                         "--redirects, --tee)"),
    "duplicate_stdout_filters": ("", "lines are not duplicated to a filtered file; with --log-dir every rank's "
                                     "output is in its log files (grep them)"),
    "duplicate_stderr_filters": ("", "lines are not duplicated to a filtered file; with --log-dir every rank's "
                                     "output is in its log files (grep them)"),
    "numa_binding": (None, "ranks are not bound to CPUs near their GPU; bind them yourself (e.g. numactl in "
                           "--no-python mode)"),
}


def torchrun_notes(args) -> None:
    """One line for each torchrun flag given that ft_launcher takes but handles its own way."""
    if args.virtual_local_rank:
        raise UsageError("--virtual-local-rank is not supported: every rank sees every GPU of its node and "
                         "LOCAL_RANK is its index there (torch.cuda.set_device(LOCAL_RANK))")
    for dest, (default, line) in TORCHRUN_NOTES.items():
        if getattr(args, dest) not in (default, None):
            print(f"{PROG}: note: --{dest.replace('_', '-')}: {line}", file=sys.stderr)


def ft_notes(args, ft, ft_cli: Dict[str, object], nproc: int) -> None:
    """NVRx's flags and keys given, the NIC check and NUMA binding: one line each on stderr (a bad NIC
    path template is a UsageError)."""
    given = _keys_set(ft_cli, ft)
    for line in nvrx_flags.notes(args) + nvrx_flags.key_notes(given):
        print(f"{PROG}: {line}", file=sys.stderr)
    check_nic_keys(ft, given)
    from ft_launcher.agent.ranks import numa_bind

    for line in numa_bind.problems(nproc, ft.numa_bind_strict):
        print(f"{PROG}: {line}", file=sys.stderr)
    if "numa_bind_strict" in given and not os.environ.get(numa_bind.ENV):
        print(f"{PROG}: numa_bind_strict: {numa_bind.ENV} is not set, so ranks are not bound to NUMA nodes "
              f"(as in NVRx)", file=sys.stderr)


def _keys_set(ft_cli, ft) -> set:
    """Fault-tolerance keys given on the command line or set away from their default (a file); the
    command line's include those left at their default."""
    defaults = FaultToleranceConfig()
    return set(ft_cli) | {k for k in nvrx_flags.KEY_NOTES if getattr(ft, k) != getattr(defaults, k)}


def check_nic_keys(ft, given: set) -> None:
    """NVRx's NIC link-state check (agent.recovery.health_checks): a template names its NIC by {nic}; asked
    for on a node without that folder of NICs, one line says it is skipped."""
    from ft_launcher.agent.recovery.health_checks import nic_folder

    template = ft.link_state_path_template
    if template and "{nic}" not in template:
        raise UsageError(f"link_state_path_template: {template!r} must contain {{nic}} (the NIC's name), e.g. "
                         "/sys/class/infiniband/{nic}/ports/1/state")
    asked = {"enable_nic_healthcheck", "link_state_path_template"} & given
    if ft.enable_nic_healthcheck and asked and not os.path.isdir(nic_folder(template)):
        print(f"{PROG}: enable_nic_healthcheck: skipped on this node: {nic_folder(template)} does not exist "
              f"(no RDMA NIC to check)", file=sys.stderr)
