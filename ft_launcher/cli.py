"""The `ft_launcher` command: torchrun's flags (both spellings, or their `PET_*` variables),
NVRx's `--ft-*` flags and YAML, SLURM defaults -> a LaunchConfig -> the node agent, until it exits.

The steps, in the order their errors are reported: the parser and its flags (flags; `PET_*` from
env_flags), each value (flag_values), what ft_launcher does differently (flag_notes), the
rendezvous (rendezvous_endpoint), flags that do not fit together (flag_checks), the fault-tolerance
config (ft_config_loading), the logs and every path written (output_paths), and the command each
rank runs (rank_command). Every input problem ends in one line `ft_launcher: error: ...` and exit
code 2, never a traceback.
"""
from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from ft_launcher.flag_checks import check_elastic, check_restart_timings, training_nodes
from ft_launcher.flag_notes import ft_notes, torchrun_notes
from ft_launcher.flag_values import (check_metrics_port, parse_backend, parse_nproc, parse_ranks_filter,
                                     parse_signals)
from ft_launcher.flags import PROG, UsageError, build_parser, warn
from ft_launcher.ft_config_loading import ft_config_from_args
from ft_launcher.output_paths import check_nvrx_log_paths, check_output_paths, resolve_logs
from ft_launcher.rank_command import entry_kind, hooked_entrypoint
from ft_launcher.rendezvous_endpoint import resolve_rendezvous, slurm_or_none

# Subcommands, recognised only as the first argument (a training script is a path: `./status`).
SUBCOMMANDS = {"report": "ft_launcher.report", "status": "ft_launcher.status"}


def launch_config(argv: Sequence[str]):
    """The LaunchConfig of the command line `argv` (and the `PET_*` variables, SLURM); bad input is a
    UsageError naming where the value came from."""
    from ft_launcher import env_flags

    try:  # a flag not on the command line comes from its PET_* variable (torchrun's rule)
        args, origins = env_flags.parse_args(build_parser(), argv, warn=warn)
    except env_flags.EnvFlagError as exc:
        raise UsageError(str(exc)) from None
    try:
        return _launch_config(args, origins)
    except UsageError as exc:
        raise UsageError(origins.blame(str(exc))) from None


def _launch_config(args, origins):
    from ft_launcher.agent.launch_config import LaunchConfig

    slurm = slurm_or_none()
    nproc = parse_nproc(args.nproc_per_node)
    backend = parse_backend(args.rdzv_backend)
    signals = parse_signals(args.signals_to_handle)
    torchrun_notes(args)
    if args.shutdown_timeout is not None and origins.of("term_timeout") is None:
        args.term_timeout = float(args.shutdown_timeout)
    rdzv = resolve_rendezvous(args, backend, slurm)
    check_restart_timings(args)
    ft, ft_cli = ft_config_from_args(args)
    ft_notes(args, ft, ft_cli, nproc)
    log_dir, capture, tee = resolve_logs(args, nproc)
    check_output_paths(log_dir, ft)
    check_nvrx_log_paths(args, ft)
    active_nodes = training_nodes(ft, nproc, rdzv.min_nodes, rdzv.max_nodes)
    elastic = bool(args.elastic)   # the flag goes to elastic's room (agent.rounds.elastic) and nowhere else
    check_elastic(elastic, ft, rdzv.min_nodes, rdzv.max_nodes)
    check_metrics_port(args.metrics_port)
    ranks_filter = parse_ranks_filter(args.local_ranks_filter)
    applog_prefix, nvrx_logfile = args.nvrx__ft_per_cycle_applog_prefix, args.nvrx__ft_nvrx_logfile
    return LaunchConfig(
        min_nodes=rdzv.min_nodes, max_nodes=rdzv.max_nodes, nproc_per_node=nproc,
        entrypoint=hooked_entrypoint(args, ft), rdzv_backend=rdzv.backend, rdzv_host=rdzv.host,
        rdzv_port=rdzv.port, rdzv_id=rdzv.run_id, rdzv_conf=rdzv.conf, is_host=rdzv.is_host,
        order_key=rdzv.order_key, standalone=args.standalone, max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval, role=args.role, log_dir=log_dir, capture=capture, tee=tee,
        local_ranks_filter=ranks_filter, local_addr=args.local_addr, term_timeout=args.term_timeout,
        workers_stop_timeout=args.workers_stop_timeout, ft=ft, entry_kind=entry_kind(args),
        entry_target=args.training_script, entry_args=list(args.training_script_args),
        origins=origins.describe(args, slurm), metrics_port=args.metrics_port, active_nodes=active_nodes,
        elastic=elastic, signals=signals, applog_prefix=applog_prefix and os.path.abspath(applog_prefix),
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
