"""The launcher's command line as argparse sees it: every flag (torchrun's, ours, NVRx's and the
fault-tolerance keys `--ft-<key>` from rank_monitor.config), its spellings, its --help group and
line, `--version`; and the parser's errors as one line (UsageError: `ft_launcher: error: ...`,
exit code 2, said by ft_launcher.cli.main).

What a flag's value means is flag_values'; what the launcher does with the flags is ft_launcher.cli's.
"""
from __future__ import annotations

import argparse
import difflib
import shutil
import signal
import sys
from typing import Optional

from ft_launcher import __version__, nvrx_flags
from ft_launcher.rank_monitor.config import FIELD_NAMES, FaultToleranceConfig, help_of

PROG = "ft_launcher"
DEFAULT_MASTER_PORT = 29500


class UsageError(Exception):
    """Bad input: its message is the one line after `ft_launcher: error: `."""


def warn(message: str) -> None:
    """`ft_launcher: warning: <message>` on stderr (the run goes on)."""
    print(f"{PROG}: warning: {message}", file=sys.stderr)


def command_owner(path: str) -> Optional[str]:
    """Which package a console script at `path` runs: "ft_launcher", "nvidia-resiliency-ext", or
    None (not a Python entry-point script, e.g. a pyenv shim)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096).decode("utf-8", "replace")
    except OSError:
        return None
    if "nvidia_resiliency_ext" in head:
        return "nvidia-resiliency-ext"
    if "ft_launcher.cli" in head:
        return "ft_launcher"
    return None


class _Version(argparse.Action):
    """--version as its lines are (argparse's own re-wraps them into one paragraph)."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


def version_text() -> str:
    """`--version`: this package's version, and a note when the `ft_launcher` command on PATH is
    nvidia-resiliency-ext's (it installs a script of the same name; the one installed last wins)."""
    text = f"{PROG} {__version__}"
    found = shutil.which(PROG)
    if found and command_owner(found) == "nvidia-resiliency-ext":
        text += (f"\nnote: the `{PROG}` command on PATH ({found}) is nvidia-resiliency-ext's launcher, installed "
                 f"after this package: run `ftrun` or `python -m ft_launcher`, or reinstall ft_launcher to take the "
                 f"name back (docs/migrating-from-nvrx.md)")
    return text


class _Parser(argparse.ArgumentParser):
    """argparse's errors as a UsageError (report and status parse with it too)."""

    def error(self, message: str):  # one line, with a hint for a mistyped flag
        if "required: training_script" in message:
            message = "no training script given (usage: ft_launcher [flags] train.py [script args])"
        if message.startswith("unrecognized arguments:"):
            flag = message.split(":", 1)[1].split()[0]
            options = [o for a in self._actions if a.help != argparse.SUPPRESS for o in a.option_strings]
            hint = difflib.get_close_matches(flag.split("=")[0].replace("_", "-"), options, n=1)
            if hint:
                message += f" (did you mean {hint[0]}?)"
        raise UsageError(message)


# --help groups the flags; each flag shows one spelling, its default and one line.
_GROUPS = {
    "nodes and rendezvous": ("nnodes", "elastic", "nproc-per-node", "rdzv-backend", "rdzv-endpoint", "rdzv-id", "rdzv-conf",
                             "standalone", "node-rank", "master-addr", "master-port", "local-addr"),
    "restarts and stopping": ("max-restarts", "term-timeout", "workers-stop-timeout", "monitor-interval",
                              "shutdown-timeout", "signals-to-handle"),
    "what each rank runs": ("module", "no-python", "run-path", "role", "start-method"),
    "logs and console": ("log-dir", "redirects", "tee", "local-ranks-filter", "metrics-port"),
    "torchrun flags this launcher does differently (each says how when used)": (
        "event-log-handler", "logs-specs", "duplicate-stdout-filters", "duplicate-stderr-filters", "numa-binding",
        "virtual-local-rank"),
}
NUMA_MODES = ("node", "socket", "exclusive", "core-complex")  # torch.numa.binding.AffinityMode values
_GROUP_OF = {name: title for title, names in _GROUPS.items() for name in names}

# NVRx's own spellings of some keys
FT_KEY_ALIASES = {"storage_healthcheck_path": ("--ft-storage-health-check-path", "--ft_storage_health_check_path")}


def _group(parser, title: str):
    groups = parser.__dict__.setdefault("_ft_groups", {})
    if title not in groups:
        groups[title] = parser.add_argument_group(title)
    return groups[title]


def _with_default(help_text: Optional[str], default) -> Optional[str]:
    if help_text is None or "default" in help_text or default in (None, "", False):
        return help_text
    return f"{help_text} (default {default})"


def _flag(parser, name: str, *extra: str, **kwargs):
    """Add `--a-b` to its --help group, with its default; the underscore twin `--a_b` is
    accepted too but not shown."""
    kwargs["help"] = _with_default(kwargs.get("help"), kwargs.get("default"))
    _group(parser, _GROUP_OF.get(name, "other")).add_argument(*extra, f"--{name}", **kwargs)
    if "-" in name:
        parser.add_argument(f"--{name.replace('-', '_')}", **dict(kwargs, help=argparse.SUPPRESS))


def _ft_default(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if value in (None, {}, []):
        return "none"
    return str(value)


def build_parser() -> argparse.ArgumentParser:
    """The launcher's parser: --help shows each flag once, in its group, with its default."""
    p = _Parser(prog=PROG, allow_abbrev=False, usage=f"{PROG} [flags] training_script [script args ...]",
                formatter_class=lambda prog: argparse.HelpFormatter(prog, max_help_position=40),
                description="Fault-tolerant launcher for PyTorch training (a torchrun replacement).",
                epilog=f"also: {PROG} report LOGDIR... (an HTML report of a job), "
                       f"{PROG} status [LOGDIR...] (what a running job is doing); each takes --help")
    _add_torchrun_flags(p)
    p.add_argument("--version", action=_Version, nargs=0, help="print the version and exit")
    _add_ft_flags(p)
    p.add_argument("training_script", help="the script (or module, or program) every rank runs")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER, help="passed to the script")
    return p


def _add_torchrun_flags(p) -> None:
    """torchrun 2.13's flags (both spellings) and our own launcher flags, in their --help groups."""
    _flag(p, "nnodes", default=None, help="N or MIN:MAX; nodes past MIN wait as hot spares, as in NVRx (default 1, "
          "SLURM_NNODES under SLURM); with --elastic, torchrun's meaning: up to MAX train, down to MIN go on")
    _flag(p, "elastic", action="store_true", help="--nnodes MIN:MAX as torchrun means it: up to MAX nodes train; a "
          "node lost with no hot spare left: the others go on at once on fewer data-parallel replicas, in place, "
          "from their live state, down to MIN (fewer: exit 1); a node that joins later is taken in at a step")
    _flag(p, "nproc-per-node", default="1", help="ranks per node: an int, cpu, gpu or auto")
    _flag(p, "rdzv-backend", default=None, help="c10d or static (default static, c10d with --rdzv-endpoint or SLURM); "
          "etcd and etcd-v2 are a one-line error")
    _flag(p, "rdzv-endpoint", default="", help="HOST[:PORT] of the rendezvous store (default port 29400)")
    _flag(p, "rdzv-id", default=None, help="job id shared by all nodes (default SLURM_JOB_ID or 'none')")
    _flag(p, "rdzv-conf", default="", help="k=v,... : join_timeout, last_call_timeout, close_timeout, read_timeout, is_host, keep_alive_interval, keep_alive_max_attempt, store_unresponsive_timeout")
    _flag(p, "standalone", action="store_true", help="single node, local store on a free port")
    _flag(p, "max-restarts", type=int, default=0, help="job-wide restart budget (default 0)")
    _flag(p, "monitor-interval", type=float, default=0.1, help="fallback polling period of the agent in seconds")
    _flag(p, "start-method", default="spawn", choices=["spawn", "fork", "forkserver"], help="accepted for torchrun compatibility; ranks are always fresh processes")
    _flag(p, "role", default="default", help="the ranks' ROLE_NAME")
    _flag(p, "module", "-m", action="store_true", help="run the script as a module (python -m)")
    _flag(p, "no-python", action="store_true", help="run the script directly, not through python")
    _flag(p, "run-path", action="store_true", help="run the script through runpy.run_path")
    _flag(p, "log-dir", default=None, help="per-rank, per-cycle logs and events.jsonl go here")
    _flag(p, "redirects", "-r", default="0", help="streams to send only to the log files: 0-3 or local_rank:mask,...")
    _flag(p, "tee", "-t", default="0", help="streams to copy to the log files and the console: 0-3 or local_rank:mask,...")
    _flag(p, "local-ranks-filter", default="", help="show only these local ranks on the console, e.g. 0,1")
    _flag(p, "metrics-port", type=int, default=None, help="serve Prometheus metrics on this port (default off)")
    _flag(p, "node-rank", type=int, default=None, help="this node's rank (static backend)")
    _flag(p, "master-addr", default="127.0.0.1", help="store host (static backend)")
    _flag(p, "master-port", type=int, default=DEFAULT_MASTER_PORT, help="store port (static backend)")
    _flag(p, "local-addr", default=None, help="address the other nodes reach this node at")
    _flag(p, "term-timeout", type=float, default=30.0, help="seconds ranks get after SIGTERM/SIGINT before SIGKILL")
    _flag(p, "workers-stop-timeout", type=float, default=15.0, help="seconds ranks get to stop at a restart before SIGKILL")
    # torchrun 2.13's other flags: shutdown-timeout and signals-to-handle act; the rest say how we differ
    _flag(p, "shutdown-timeout", type=int, default=None, help="torchrun's name for --term-timeout (--term-timeout wins when both are given)")
    _flag(p, "signals-to-handle", default=None, help="signals forwarded to the ranks, then the job stops "
          "(default SIGTERM,SIGINT,SIGHUP; torchrun's also has SIGQUIT)")
    _flag(p, "event-log-handler", default="null", help="accepted: events go to <log dir>/events.jsonl")
    _flag(p, "logs-specs", default=None, help="accepted: ft_launcher lays out rank logs itself")
    _flag(p, "duplicate-stdout-filters", default="", help="accepted, not acted on: grep the --log-dir files")
    _flag(p, "duplicate-stderr-filters", default="", help="accepted, not acted on: grep the --log-dir files")
    _flag(p, "numa-binding", default=None, choices=NUMA_MODES, help="accepted, not acted on: ranks are not bound to CPUs")
    _flag(p, "virtual-local-rank", action="store_true", help="not supported: one-line error (ranks see every GPU)")


def _add_ft_flags(p) -> None:
    """The `fault tolerance` group: --ft-cfg-path, NVRx's own flags, and every fault-tolerance key in
    all its spellings (one shown in --help with its default)."""
    ft = _group(p, "fault tolerance")
    ft.description = ("hang detection and simulated faults; also a fault_tolerance: section in --ft-cfg-path "
                      "(flags win). Each flag is also accepted with underscores and as --ft-param-<key>.")
    _GROUP_OF["ft-cfg-path"] = "fault tolerance"
    _flag(p, "ft-cfg-path", default=None, help="YAML with a fault_tolerance: section (at any nesting level)")
    p.add_argument(*nvrx_flags.CFG_PATH_SPELLINGS, dest="ft_cfg_path", default=None, help=argparse.SUPPRESS)
    nvrx_flags.add_flags(p)
    defaults = FaultToleranceConfig()
    for key in FIELD_NAMES:
        dashed = key.replace("_", "-")
        spellings = list(dict.fromkeys([f"--ft-{dashed}", f"--ft-{key}", f"--ft-param-{key}", f"--ft-param-{dashed}"]
                                       + ([f"--{dashed}", f"--{key}"] if key.startswith("ft_") else [f"--ft_{key}"])
                                       + list(FT_KEY_ALIASES.get(key, ()))))
        shown = f"--{dashed}" if key.startswith("ft_") else spellings[0]  # --ft-state-path
        default = getattr(defaults, key)
        if key == "rank_termination_signal":
            default = signal.Signals(default).name
        line = help_of(key)   # declared with the key (rank_monitor.config.schema); None: not shown
        ft.add_argument(shown, dest=f"ft__{key}", default=None, metavar="V",
                        help=argparse.SUPPRESS if line is None else
                        _with_default(line.replace("%", "%%"), _ft_default(default)))
        p.add_argument(*[s for s in spellings if s != shown], dest=f"ft__{key}", default=None,
                       help=argparse.SUPPRESS)
