"""The `ft_launcher` command line: torchrun's flags (both spellings, or their `PET_*` variables),
NVRx's `--ft-*` flags and YAML, SLURM defaults; builds a LaunchConfig and runs the node agent.

Every input problem ends in one line `ft_launcher: error: ...` and exit code 2, never a
traceback.
"""
from __future__ import annotations

import difflib
import os
import shutil
import signal
import sys
import tempfile
import uuid
import warnings
from typing import Dict, List, Optional, Sequence

from ft_launcher import nvrx_flags
from ft_launcher.flags import DEFAULT_MASTER_PORT, PROG, UsageError, build_parser
from ft_launcher.rank_monitor.config import ConfigError, FaultToleranceConfig

# Subcommands, recognised only as the first argument (a training script is a path: `./status`).
SUBCOMMANDS = {"report": "ft_launcher.report", "status": "ft_launcher.status"}
DEFAULT_C10D_PORT = 29400

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


# ---- value parsing -------------------------------------------------------------------------
def parse_nnodes(text: str) -> tuple:
    parts = text.split(":")
    try:
        if len(parts) == 1:
            low = high = int(parts[0])
        elif len(parts) == 2:
            low, high = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise UsageError(f"--nnodes: expected N or MIN:MAX, got {text!r}") from None
    if low < 1 or high < low:
        raise UsageError(f"--nnodes: need 1 <= MIN <= MAX, got {text!r}")
    return low, high


def parse_backend(text: Optional[str]) -> Optional[str]:
    if text is None or text in ("c10d", "static"):
        return text
    if text in ("etcd", "etcd-v2"):
        raise UsageError(f"--rdzv-backend: {text} is not supported: ft_launcher has no etcd rendezvous; its agents host their own "
                         "store: use --rdzv-backend c10d --rdzv-endpoint NODE0_HOST:PORT (or --standalone)")
    raise UsageError(f"--rdzv-backend: expected c10d or static, got {text!r}")


def parse_signals(text: Optional[str]) -> tuple:
    """--signals-to-handle SIGTERM,SIGUSR1,... (names, with or without SIG, or numbers)."""
    if text is None:
        return ()
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        name = item.upper() if item.upper().startswith("SIG") else "SIG" + item.upper()
        try:
            sig = signal.Signals(int(item)) if item.isdigit() else signal.Signals[name]
        except (KeyError, ValueError):
            raise UsageError(f"--signals-to-handle: unknown signal {item!r}") from None
        if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            raise UsageError(f"--signals-to-handle: {sig.name} cannot be handled")
        out.append(int(sig))
    if not out:
        raise UsageError("--signals-to-handle: expected e.g. SIGTERM,SIGINT,SIGUSR1")
    return tuple(dict.fromkeys(out))


def torchrun_notes(args) -> None:
    """One line for each torchrun flag given that ft_launcher takes but handles its own way."""
    if args.virtual_local_rank:
        raise UsageError("--virtual-local-rank is not supported: every rank sees every GPU of its node and "
                         "LOCAL_RANK is its index there (torch.cuda.set_device(LOCAL_RANK))")
    for dest, (default, line) in TORCHRUN_NOTES.items():
        if getattr(args, dest) not in (default, None):
            print(f"{PROG}: note: --{dest.replace('_', '-')}: {line}", file=sys.stderr)


def parse_rdzv_conf(text: str) -> Dict[str, object]:
    from ft_launcher.agent.launch_config import RDZV_CONF_DEFAULTS

    conf: Dict[str, object] = dict(RDZV_CONF_DEFAULTS)
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(f"--rdzv-conf: expected key=value, got {item!r}")
        if key == "is_host":
            if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise UsageError(f"--rdzv-conf: is_host must be true or false, got {value!r}")
            conf[key] = value.lower() in ("1", "true", "yes")
        elif key in RDZV_CONF_DEFAULTS or key == "timeout":
            try:
                number = float(value)
            except ValueError:
                raise UsageError(f"--rdzv-conf: {key} must be a number, got {value!r}") from None
            if number < 0:
                raise UsageError(f"--rdzv-conf: {key} must not be negative, got {value!r}")
            conf["join_timeout" if key == "timeout" else key] = number
        else:
            hint = difflib.get_close_matches(key, list(RDZV_CONF_DEFAULTS) + ["is_host"], n=1)
            print(f"{PROG}: warning: --rdzv-conf: unknown key {key!r} ignored"
                  + (f" (did you mean {hint[0]!r}?)" if hint else ""), file=sys.stderr)
    return conf


def parse_stream_map(flag: str, text: str, nproc: int) -> Dict[int, int]:
    text = text.strip()
    try:
        if ":" not in text:
            mask = int(text)
            if not 0 <= mask <= 3:
                raise ValueError
            return {i: mask for i in range(nproc)} if mask else {}
        out = {}
        for item in text.split(","):
            rank, _, mask = item.partition(":")
            value = int(mask)
            if not 0 <= value <= 3:
                raise ValueError
            out[int(rank)] = value
        return out
    except ValueError:
        raise UsageError(f"{flag}: expected 0-3 or local_rank:mask,... (1 stdout, 2 stderr, 3 both), got {text!r}") from None


def parse_nproc(text: str) -> int:
    if text.isdigit() and int(text) > 0:
        return int(text)
    if text in ("gpu", "auto"):
        with warnings.catch_warnings():  # torch's import-time warnings are not the user's (no numpy, pynvml)
            warnings.simplefilter("ignore")
            import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if text == "gpu":
            if not gpus:
                raise UsageError("--nproc-per-node gpu: no GPU found on this node")
            return gpus
        return gpus or (os.cpu_count() or 1)
    if text == "cpu":
        return os.cpu_count() or 1
    raise UsageError(f"--nproc-per-node: expected a positive int, cpu, gpu or auto, got {text!r}")


def parse_active_nodes(active_world_size: Optional[int], nproc: int, max_nodes: int) -> Optional[int]:
    """The nodes that train when only `active_world_size` ranks may (the rest are warm spares)."""
    if active_world_size is None:
        return None
    if active_world_size % nproc:
        raise UsageError(f"active_world_size {active_world_size} must be a multiple of --nproc-per-node "
                         f"({nproc} ranks per node): whole nodes train or stand by")
    nodes = active_world_size // nproc
    if nodes > max_nodes:
        raise UsageError(f"active_world_size {active_world_size} needs {nodes} nodes of {nproc} rank{'s' if nproc != 1 else ''}, "
                         f"but the job has at most {max_nodes} node{'s' if max_nodes != 1 else ''} (--nnodes)")
    return nodes


def parse_endpoint(text: str, default_port: int) -> tuple:
    host, sep, port = text.rpartition(":") if text.count(":") == 1 or text.startswith("[") else (text, "", "")
    if not sep:
        return text or "127.0.0.1", default_port
    host = host.strip("[]")
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise UsageError(f"--rdzv-endpoint: bad port in {text!r}")
    return host or "127.0.0.1", int(port)


def entrypoint(args) -> List[str]:
    script, rest = args.training_script, list(args.training_script_args)
    if args.no_python:
        if args.module:
            raise UsageError("--no-python and --module cannot be combined")
        if not (os.path.isfile(script) or shutil.which(script)):
            raise UsageError(f"program not found: {script}")
        return [script] + rest
    if args.module:
        import importlib.util

        sys.path.insert(0, os.getcwd())  # `python -m` (how each rank runs it) looks in the cwd first
        try:
            found = importlib.util.find_spec(script.split(".")[0]) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path.remove(os.getcwd())
        if not found:
            raise UsageError(f"module not found: {script}")
        return [sys.executable, "-u", "-m", script] + rest
    if os.path.isdir(script):
        raise UsageError(f"training script {script} is a directory, not a file")
    if not os.path.isfile(script):
        raise UsageError(f"training script not found: {script}")
    not_python = _not_python(script)
    if not_python:
        raise UsageError(f"training script {script} is not a Python script ({not_python}): to run it as a "
                         f"program, add --no-python")
    if args.run_path:
        runner = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
        return [sys.executable, "-u", "-c", runner, script] + rest
    return [sys.executable, "-u", script] + rest


def _not_python(script: str) -> Optional[str]:
    """Why `script` is a program rather than Python (a shell script passed without --no-python,
    which every rank would fail with a SyntaxError), or None. Only a file that python cannot
    compile counts, and only with a non-Python `#!` line or a shell's file extension."""
    try:
        with open(script, "rb") as fh:
            source = fh.read(1 << 20)
    except OSError:
        return None
    first = source.split(b"\n", 1)[0].decode("utf-8", errors="replace").strip()
    shebang = first[2:].strip() if first.startswith("#!") else None
    if shebang is not None and "python" in shebang:
        return None
    if shebang is None and not script.endswith((".sh", ".bash", ".zsh")):
        return None
    try:
        compile(source, script, "exec")
        return None
    except (SyntaxError, ValueError) as exc:
        lineno = getattr(exc, "lineno", None)
        where = f"python cannot parse it: {type(exc).__name__}" + (f" at line {lineno}" if lineno else "")
        return f"it starts with '#!{shebang}'; {where}" if shebang else where


def _hooked_entrypoint(args, ft) -> List[str]:
    """The rank's command; with install_exception_hook, through rank_monitor.rank_side.excepthook."""
    command = entrypoint(args)
    if not ft.install_exception_hook:
        return command
    if args.no_python:
        print(f"{PROG}: install_exception_hook: --no-python runs no Python of ours first; the hook is "
              "not installed (a rank's exit code still reports its failure)", file=sys.stderr)
        return command
    from ft_launcher.rank_monitor.rank_side import excepthook
    from ft_launcher.rank_monitor.own_modules import package_parent

    return excepthook.command(entry_kind(args), command, args.training_script,
                              list(args.training_script_args), package_parent())


def entry_kind(args) -> str:
    """How the cold command runs the target (see LaunchConfig.entry_kind)."""
    if args.no_python:
        return "program"
    return "module" if args.module else "run_path" if args.run_path else "script"


def check_writable_dir(what: str, path: str) -> None:
    """`path`, a directory the launcher will write into, exists (or is made now) and takes a file."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except FileExistsError:
        raise UsageError(f"{what}: {path} exists and is not a directory") from None
    except OSError as exc:
        raise UsageError(f"{what}: cannot write in {path}: {exc.strerror or exc}") from None


def check_output_paths(log_dir: Optional[str], ft) -> None:
    """Every path the launcher will write, checked before anything starts."""
    if log_dir:
        check_writable_dir("--log-dir", log_dir)
    if ft.calc_ft_timeouts or ft.ft_state_path:
        from ft_launcher.agent.observation.timeout_learning import default_state_path

        path = os.path.abspath(default_state_path(ft, log_dir))
        what = "--ft-state-path" if ft.ft_state_path else "ft_state.json (calc_ft_timeouts)"
        if os.path.isdir(path):
            raise UsageError(f"{what}: {path} is a directory, not a file")
        check_writable_dir(what, os.path.dirname(path))


def _slurm():
    try:
        from ft_launcher.agent.rounds.slurm_env import slurm_info
    except ImportError:
        return None
    try:
        return slurm_info()
    except ValueError as exc:
        raise UsageError(f"SLURM environment: {exc}") from None


def launch_config(argv: Sequence[str]):
    from ft_launcher import env_flags

    try:  # a flag not on the command line comes from its PET_* variable (torchrun's rule)
        args, origins = env_flags.parse_args(build_parser(), argv, warn=lambda m: print(f"{PROG}: warning: {m}", file=sys.stderr))
    except env_flags.EnvFlagError as exc:
        raise UsageError(str(exc)) from None
    try:
        return _launch_config(args, origins)
    except UsageError as exc:
        raise UsageError(origins.blame(str(exc))) from None


def _keys_set(ft_cli, ft) -> set:
    """Fault-tolerance keys given on the command line or set away from their default (a file)."""
    defaults = FaultToleranceConfig()
    return set(ft_cli) | {k for k in nvrx_flags.KEY_NOTES if getattr(ft, k) != getattr(defaults, k)}


def _check_nic_keys(ft, given: set) -> None:
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


def _launch_config(args, origins):
    from ft_launcher.agent.launch_config import LaunchConfig
    from ft_launcher.ft_config_loading import build_ft_config

    slurm = _slurm()
    nproc = parse_nproc(args.nproc_per_node)
    backend = parse_backend(args.rdzv_backend)
    signals = parse_signals(args.signals_to_handle)
    torchrun_notes(args)
    if args.shutdown_timeout is not None and origins.of("term_timeout") is None:
        args.term_timeout = float(args.shutdown_timeout)
    order_key: Optional[int] = None
    store_here: Optional[bool] = None  # whether this node hosts the store, when SLURM says so
    if args.standalone:
        if args.nnodes and args.nnodes.strip() not in ("1", "1:1"):
            raise UsageError(f"--standalone is one node: it cannot be combined with --nnodes {args.nnodes}")
        backend, low, high = "c10d", 1, 1
        host, port, run_id = "127.0.0.1", 0, args.rdzv_id or uuid.uuid4().hex[:12]
    else:
        low, high = parse_nnodes(args.nnodes) if args.nnodes else (
            (slurm.nnodes, slurm.nnodes) if slurm else (1, 1))
        if args.rdzv_endpoint:
            backend = backend or "c10d"
            host, port = parse_endpoint(args.rdzv_endpoint, DEFAULT_C10D_PORT)
        elif slurm and backend != "static":
            backend, host, port = "c10d", slurm.first_host, DEFAULT_MASTER_PORT
            if os.environ.get("SLURMD_NODENAME"):  # the store lives on the first node, and only there
                store_here = slurm.nodename == slurm.first_host
        else:
            backend = backend or "static"
            host, port = args.master_addr, args.master_port
        run_id = args.rdzv_id or (slurm.job_id if slurm else "none")
        if slurm:
            order_key = slurm.node_rank
        if args.node_rank is not None:
            order_key = args.node_rank
        elif order_key is None and os.environ.get("GROUP_RANK", "").isdigit():
            order_key = int(os.environ["GROUP_RANK"])
        if backend == "static":
            if low != high:
                raise UsageError("--rdzv-backend static needs a fixed --nnodes N (use c10d for MIN:MAX)")
            order_key = order_key or 0
    rdzv_conf = parse_rdzv_conf(args.rdzv_conf)
    is_host = rdzv_conf.pop("is_host", store_here)
    if backend == "static" and is_host is None:
        is_host = order_key == 0
    for flag in ("max_restarts", "term_timeout", "workers_stop_timeout"):
        if getattr(args, flag) < 0:
            raise UsageError(f"--{flag.replace('_', '-')} must not be negative, got {getattr(args, flag):g}")
    if args.monitor_interval <= 0:
        raise UsageError(f"--monitor-interval must be positive, got {args.monitor_interval:g}")
    ft_cli = {k[4:]: v for k, v in vars(args).items() if k.startswith("ft__") and v is not None}
    try:
        ft = build_ft_config(args.ft_cfg_path, ft_cli, warn=lambda m: print(f"{PROG}: warning: {m}", file=sys.stderr))
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    for line in nvrx_flags.notes(args) + nvrx_flags.key_notes(_keys_set(ft_cli, ft)):
        print(f"{PROG}: {line}", file=sys.stderr)
    _check_nic_keys(ft, _keys_set(ft_cli, ft) | set(ft_cli))
    from ft_launcher.agent.ranks import numa_bind

    for line in numa_bind.problems(nproc, ft.numa_bind_strict):
        print(f"{PROG}: {line}", file=sys.stderr)
    if "numa_bind_strict" in _keys_set(ft_cli, ft) | set(ft_cli) and not os.environ.get(numa_bind.ENV):
        print(f"{PROG}: numa_bind_strict: {numa_bind.ENV} is not set, so ranks are not bound to NUMA nodes "
              f"(as in NVRx)", file=sys.stderr)
    capture = parse_stream_map("--redirects", args.redirects, nproc)
    tee = parse_stream_map("--tee", args.tee, nproc)
    log_dir = args.log_dir
    if log_dir:
        log_dir = os.path.abspath(log_dir)
        if not capture and not tee:
            tee = {i: 3 for i in range(nproc)}  # a log dir means files for every rank, console too
    elif capture:
        log_dir = tempfile.mkdtemp(prefix="ft_launcher_logs_")
        print(f"{PROG}: --redirects without --log-dir: logs go to {log_dir}", file=sys.stderr)
    check_output_paths(log_dir, ft)
    applog_prefix, nvrx_logfile = args.nvrx__ft_per_cycle_applog_prefix, args.nvrx__ft_nvrx_logfile
    for flag, path in (("--ft-per-cycle-applog-prefix", applog_prefix), ("--ft-nvrx-logfile", nvrx_logfile),
                       ("--ft-cycle-info-dir", ft.cycle_info_dir)):
        if path:
            check_writable_dir(flag, path if flag == "--ft-cycle-info-dir" else os.path.dirname(os.path.abspath(path)))
    active_nodes = parse_active_nodes(ft.active_world_size, nproc, high)
    training = min(active_nodes, low) if active_nodes else low
    if ft.segment and training % ft.segment:
        raise UsageError(f"--ft-segment {ft.segment}: the {training} training node(s) (MIN of --nnodes) must be a "
                         f"multiple of it: nodes train in whole segments of {ft.segment} nodes of one NVLink domain")
    if args.metrics_port is not None and not 0 < args.metrics_port < 65536:
        raise UsageError(f"--metrics-port: expected a port 1-65535, got {args.metrics_port}")
    ranks_filter = None
    if args.local_ranks_filter:
        try:
            ranks_filter = {int(x) for x in args.local_ranks_filter.split(",") if x.strip()}
        except ValueError:
            raise UsageError(f"--local-ranks-filter: expected e.g. 0,1, got {args.local_ranks_filter!r}") from None
    return LaunchConfig(
        min_nodes=low, max_nodes=high, nproc_per_node=nproc, entrypoint=_hooked_entrypoint(args, ft),
        rdzv_backend=backend, rdzv_host=host, rdzv_port=port, rdzv_id=run_id, rdzv_conf=rdzv_conf,
        is_host=is_host, order_key=order_key, standalone=args.standalone, max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval, role=args.role, log_dir=log_dir, capture=capture, tee=tee,
        local_ranks_filter=ranks_filter, local_addr=args.local_addr, term_timeout=args.term_timeout,
        workers_stop_timeout=args.workers_stop_timeout, ft=ft, entry_kind=entry_kind(args),
        entry_target=args.training_script, entry_args=list(args.training_script_args),
        origins=origins.describe(args, slurm), metrics_port=args.metrics_port, active_nodes=active_nodes,
        signals=signals, applog_prefix=applog_prefix and os.path.abspath(applog_prefix),
        nvrx_logfile=nvrx_logfile and os.path.abspath(nvrx_logfile))


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:  # `ft_launcher report LOGDIR...`, `ft_launcher status LOGDIR...`
        import importlib

        return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
    if "TORCH_CPP_LOG_LEVEL" not in os.environ:  # quiet torch's C++ store warnings in the agent only
        os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
        os.environ["FT_LAUNCHER_QUIET_CPP_LOG"] = "1"
    try:
        cfg = launch_config(argv)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    metrics = None
    if cfg.metrics_port is not None:  # bound before anything starts: a busy port is bad input
        from ft_launcher.agent.observation.metrics import Metrics, MetricsUnavailable

        try:
            metrics = Metrics(cfg.metrics_port)
        except MetricsUnavailable as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return 2
    from ft_launcher.agent.rounds import store_threads
    from ft_launcher.agent.agent import NodeAgent
    from ft_launcher.agent.observation.events import EventLog

    stream = None
    if cfg.nvrx_logfile:   # NVRx's launcher log: the agent's lines go there too (agent.observation.nvrx_logs)
        from ft_launcher.agent.observation.nvrx_logs import LauncherLogTee

        stream = LauncherLogTee(sys.stderr, cfg.nvrx_logfile)
    events = EventLog(os.path.join(cfg.log_dir, "events.jsonl") if cfg.log_dir else None, stream)
    try:
        code = NodeAgent(cfg, events, metrics).run()
    except KeyboardInterrupt:
        code = 130
    finally:
        events.close()
        if stream is not None:
            stream.close()
        if metrics is not None:
            metrics.close()
    return store_threads.exit_past_stuck(code)   # a thread stuck in torch's store code would abort the exit


if __name__ == "__main__":
    sys.exit(main())
