"""The fault-tolerance configuration schema: every key declared once, with its type, default,
value parser and one line of help (`key(default, parser, help)`); the flags, their --help and the
docs' table come from these declarations.

This is the one definition of what a `fault_tolerance:` YAML section or an `--ft-<key>` flag may
hold. It lives at the bottom layer because it travels to every rank monitor; `ft_launcher` only
finds the flags and hands them here. Every problem is raised as `ConfigError` (a ValueError) with
a one-line message naming the key and the source of the bad value.

`FaultToleranceConfig` is also NVRx's class of that name for training scripts: the same field
names and types (`rank_termination_signal` a `signal.Signals`, `log_level` a logging level
number) and its constructors `from_kwargs`, `from_yaml_file`, `from_args`, plus `to_yaml_file`.
NVRx's keys that mean nothing here (`node_health_check_interval`, `restart_check_interval`,
`enable_nic_monitor`, `pci_topo_file`, `link_down_path_template`, and of NVRx 0.7's keys
`num_warmup_iterations`, the attribution keys and `segment_health_check_dir`) and Megatron-Bridge's
`enable_ft_package` are accepted and have no effect (their help is None: no flag shown);
`skip_section_response` (no flag shown either) is what the monitor tells NVRx 0.6+'s own client
(monitor_side.nvrx_peers). NVRx 0.7's other keys have their meaning here
(docs/nvrx-flags.md says where each is built).
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import signal
from typing import Any, Callable, Dict, List, Mapping, Optional

from ft_launcher.rank_monitor.config.values import (
    ConfigError, as_int, boolean, choice, fault_count, level_name, log_level_value, number, optional_int,
    optional_str, parse_section_timeouts, parse_signal, pins, positive, positive_int_or_null, sdc_spec, section_name,
    section_timeouts,
    signal_value, timeout)

# Section names every user knows; any other name is accepted too.
COMMON_SECTIONS = ("setup", "step", "checkpointing")
FAULT_TYPES = ("rank_hung", "rank_killed", "rank_sdc", "random")
RESTART_GRANULARITIES = ("auto", "rank", "node", "job")
RESERVE_PREIMPORTS = ("torch", "recorded", "none")   # rank_monitor.rank_side.import_record


def key(default: Any, parse: Callable[[str, Any, str], Any], help: Optional[str], factory=None):
    """One fault-tolerance key: its default (or `factory` for a mutable one), the parser of its
    values and its one line of --help (None: accepted for NVRx or Megatron-Bridge, not shown)."""
    meta = {"parse": parse, "help": help}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass
class FaultToleranceConfig:
    """Timeouts are seconds; None means "no timeout"."""

    rank_section_timeouts: Dict[str, Optional[float]] = key(
        None, section_timeouts, "seconds per section, e.g. setup:600,step:180,checkpointing:null", factory=dict)
    rank_out_of_section_timeout: Optional[float] = key(None, timeout,
                                                       "seconds a rank may spend with no section open")
    initial_rank_heartbeat_timeout: Optional[float] = key(None, timeout,
                                                          "seconds from a rank's start to its first heartbeat")
    rank_heartbeat_timeout: Optional[float] = key(None, timeout, "seconds between heartbeats")
    rank_termination_signal: signal.Signals = key(signal.SIGKILL, signal_value,
                                                  "signal a hung rank gets (name or number), after a stack dump")
    # With a catchable termination signal, SIGKILL follows after this many seconds.
    rank_termination_grace: float = key(5.0, number,
                                        "seconds before SIGKILL follows a catchable termination signal")
    # How long a monitor waits for a hung rank's stack dump before terminating it.
    stack_dump_wait: float = key(0.3, number, "seconds a monitor waits for a hung rank's stack dump")
    # NVRx's polling period. Our monitors are deadline driven; they poll shared memory at
    # min(this, 0.05) s, so a hang is seen within its timeout + 50 ms whatever is set here.
    workload_check_interval: float = key(5.0, number, "accepted for NVRx (monitors are deadline driven)")
    safety_factor: float = key(5.0, number, "a computed timeout is the observed maximum times this")
    # Computed timeouts (see rank_monitor/timeout_calc.py for the rule).
    calc_ft_timeouts: bool = key(False, boolean, "compute timeouts from observed times (true/false)")
    calc_min_observations: int = key(10, as_int, "observations needed before a timeout is computed")
    calc_timeout_floor: float = key(5.0, number, "seconds no computed timeout goes below")
    ft_state_path: Optional[str] = key(None, optional_str,
        "where computed timeouts persist (default <log dir>/ft_state.json, else ./ft_state.json)")
    # Timeout keys ("section:step", "out_of_section", "heartbeat:initial", ...) that computed
    # timeouts must not replace: those the user pins (bare section names are accepted, and
    # "heartbeat" means both heartbeat timeouts), and explicit nulls.
    pinned_timeouts: List[str] = key(None, pins, "timeouts computed values never replace, e.g. checkpointing,heartbeat",
                                     factory=list)
    log_level: int = key(logging.INFO, level_name, "log level of the rank monitors")
    # Simulated faults (Megatron-Bridge's names), injected by the agent into any script.
    simulate_fault: bool = key(False, boolean, "inject a simulated fault into a rank (true/false)")
    simulated_fault_type: str = key("random", choice(FAULT_TYPES),
                                    "rank_hung, rank_killed, rank_sdc or random (rank_hung or rank_killed)")
    # global rank; None: chosen from the seed
    simulated_fault_rank: Optional[int] = key(None, optional_int,
                                              "global rank to hit (default: drawn from the seed)")
    # seconds after the rank starts, plus <=20% jitter
    simulated_fault_base_delay: float = key(10.0, number, "seconds after the rank's start (plus up to 20% jitter)")
    simulated_fault_seed: int = key(0, as_int, "seed of the fault plan (rank, type, jitter)")
    # rank_sdc (rank_side.live.step_guard): what, at which training step, and on which hardware for how long
    simulated_sdc: str = key("nan:100:once:backward", sdc_spec,
                             "rank_sdc: KIND:STEP[:PERSIST[:PLACE]]: nan, inf, bitflip (top exponent bit), "
                             "expflip or mantflip (finite) at that step, once or on its device or node from then "
                             "on, in the rank's gradient before the all-reduce (backward), after it (reduced) or "
                             "in a parameter after the optimizer step (memory)")
    # faults per job, one per cycle at most; -1: every cycle
    simulated_fault_count: int = key(1, fault_count, "faults per job (-1 or every: one per cycle)")
    # Warm reserves (agent.ranks.reserve_pool): warm interpreters per local rank slot that restarts use
    # instead of a cold start; 0 turns them off. A reserve not warm after the timeout is replaced.
    warm_reserves: int = key(1, as_int,
                             "warm interpreters per local rank that restarts use instead of a cold start (0: off)")
    warm_reserve_timeout: float = key(120.0, number,
                                      "seconds a warm reserve may take to warm up before it is replaced")
    # What a reserve imports ahead of the script (rank_monitor.rank_side.import_record): torch and
    # ft_launcher's own modules the rank imported (what a script cannot have set up first), every
    # library the rank imported (recorded), or nothing.
    reserve_preimport: str = key("torch", choice(RESERVE_PREIMPORTS),
        "what a warm reserve imports before the script runs: torch, recorded (every library the rank imported) or none")
    # Stragglers (agent.observation.stragglers): every straggler_window seconds each rank's mean time in
    # straggler_section is compared with the job's median; a rank over straggler_threshold x the
    # median for straggler_windows windows in a row is reported. straggler_window 0: off.
    straggler_section: str = key("step", section_name,
                                 "section whose time per rank is compared with the job's median")
    straggler_window: float = key(60.0, number,
                                  "seconds per straggler comparison window (0: no straggler detection)")
    straggler_threshold: float = key(1.5, number, "a rank this many times slower than the median is a straggler")
    straggler_windows: int = key(3, as_int, "windows in a row a rank must be slow before it is reported")
    # Exclude a reported straggler's node at the next restart when a hot spare can take its place.
    straggler_exclude: bool = key(False, boolean,
                                  "at the next restart, leave a straggler's node out when a hot spare can replace it")
    # Stopping when restarting is pointless (agent.recovery.progress): after this many cycles in a row
    # that ended without one completed `step` section on any rank (once the job has completed
    # one), the job stops; 0: never. Every agent then exits with no_restart_exit_code.
    max_no_progress_cycles: int = key(3, as_int,
        "stop the job after this many cycles in a row without a completed step (0: never)")
    # After this many failures in a row with the same traceback and no progress in between (an
    # import error, a script python cannot run), the job stops: a restart would fail the same way
    # (agent.recovery.restart_policy). 0: never.
    max_identical_failures: int = key(2, as_int,
        "stop the job after this many failures in a row with the same traceback and no progress between (0: never)")
    no_restart_exit_code: int = key(93, as_int,
                                    "exit code of every agent when the job stops and must not be requeued")
    # Health checks before each rendezvous (agent.recovery.health_checks): GPUs through NVML when present,
    # the log and checkpoint directories writable, min_free_disk_gb free in the checkpoint directory (the log
    # directory: only ever a warning, logs are not the job).
    health_checks: bool = key(True, boolean,
                              "check GPUs (NVML), log/checkpoint dirs and free disk before each rendezvous")
    checkpoint_dir: Optional[str] = key(None, optional_str,
                                        "a directory the health checks require writable, with min_free_disk_gb free")
    min_free_disk_gb: float = key(1.0, number,
                                  "GB that must be free in the checkpoint directory (the log directory: a warning)")
    # In-process restart (issue 11). Which processes a failure replaces: rank (only the failed
    # rank; the others restart in place), node (every rank of its node), job (every rank: a full
    # restart); auto: rank when the script uses ft.restartable, else job.
    restart_granularity: str = key("auto", choice(RESTART_GRANULARITIES),
        "what a failure restarts: rank, node, job, or auto (rank with ft.restartable, else job)")
    # Seconds a healthy rank has to reach the restart point before it is killed and replaced.
    inprocess_timeout: float = key(10.0, positive,
                                   "seconds a healthy rank has to reach the restart point before it is replaced")
    # A rank still running when every other rank of the job has ended 0, outside any section and
    # using no CPU for this many seconds, hung in its teardown (agent.recovery.teardown_watch): its
    # stack is dumped, it is ended, and the job counts it as finished. 0: never.
    teardown_hang_grace: float = key(60.0, number,
        "seconds a rank may sit idle outside any section after every other rank finished 0, before "
        "its stack is dumped and it is ended as hung in its teardown (0: never)")
    # Ranks that train; the other nodes stand by as warm spares. None: every node trains.
    active_world_size: Optional[int] = key(None, positive_int_or_null,
        "ranks that train (a multiple of --nproc-per-node); other nodes stand by as warm spares")
    # Empty the CUDA cache at an in-place restart.
    empty_cuda_cache: bool = key(True, boolean, "empty the CUDA cache at an in-place restart (true/false)")
    # Accepted so that NVRx and Megatron-Bridge configurations load; no effect here (the agent
    # checks node health by itself; ranks are always monitored under ft_launcher).
    node_health_check_interval: float = key(5.0, number, None)
    restart_check_interval: float = key(60.0, number, None)
    enable_nic_monitor: bool = key(True, boolean, None)
    pci_topo_file: Optional[str] = key(None, optional_str, None)
    link_down_path_template: Optional[str] = key(None, optional_str, None)
    enable_ft_package: bool = key(False, boolean, None)
    # NVRx 0.7's keys (nvidia-resiliency-ext 0.7.0, fault_tolerance/config.py). With a meaning here:
    # GPU memory after a kill (agent.ranks.gpu_memory): wait at most gpu_memory_reclaim_timeout s,
    # polling every gpu_memory_poll_interval s, until no GPU lists a dead rank's process holding
    # more than gpu_memory_tolerance_mb MB (ours wait 10 s and poll at 0.05 s by default, NVRx
    # 50 s and 2 s).
    gpu_memory_reclaim_timeout: float = key(10.0, number,
                                            "seconds a restart waits for the GPUs to free a dead rank's memory")
    gpu_memory_tolerance_mb: float = key(512.0, number,
        "a dead rank's process still listed with at most this many MB counts as gone")
    gpu_memory_poll_interval: float = key(0.05, positive,
                                          "seconds between looks at the GPUs while waiting for their memory")
    # A rank's uncaught exception is reported to the launcher at raise time (rank_monitor.rank_side.excepthook).
    install_exception_hook: bool = key(False, boolean,
        "report a rank's uncaught exception to the launcher at raise time (true/false)")
    # Comma-separated paths that must exist and be readable before each rendezvous (health checks).
    storage_healthcheck_path: Optional[str] = key(None, optional_str,
        "paths (comma-separated) that must be readable before each rendezvous")
    # Progress by the checkpoint iteration this file holds, and the rise a cycle needs (agent.recovery.progress).
    checkpoint_iteration_file: Optional[str] = key(None, optional_str,
        "measure progress by the iteration this file holds (max_no_progress_cycles)")
    min_progress_iterations: int = key(1, as_int, "iterations (or steps) a cycle must add to count as progress")
    # NVRx's cycle_info files and NVRX_CURRENT_CYCLE_INFO (agent.observation.nvrx_cycle_info).
    cycle_info_dir: Optional[str] = key(None, optional_str,
        "write NVRx's cycle_info.<job>.<attempt>.<cycle> files and the .current link here "
                      "(ranks get NVRX_CURRENT_CYCLE_INFO)")
    # Health checks before each rendezvous (agent.recovery.health_checks): NIC port states, Lustre/NFS.
    enable_nic_healthcheck: bool = key(True, boolean,
        "fail the node when an RDMA NIC port that was ACTIVE is not, before each rendezvous")
    enable_dist_storage_healthcheck: bool = key(False, boolean,
        "check Lustre health and that Lustre/NFS mounts answer before each rendezvous")
    link_state_path_template: Optional[str] = key(None, optional_str,
        "a NIC port's state file, with {nic} (default /sys/class/infiniband/{nic}/ports/1/state)")
    # Nodes train in whole segments of this many nodes of one NVLink domain (agent.rounds.segments).
    segment: Optional[int] = key(None, positive_int_or_null,
                                 "nodes per NVLink-domain segment: nodes train in whole segments of one domain")
    # With NVRX_GPUS_PER_NUMA: CPUs are bound, memory is not; true says so (agent.ranks.numa_bind).
    numa_bind_strict: bool = key(True, boolean,
                                 "with NVRX_GPUS_PER_NUMA set: say that memory is not bound (CPUs are)")
    # After the ranks stop, name what is left of their process groups (agent.ranks.workers).
    check_remaining_processes: bool = key(False, boolean,
                                          "after the ranks stop, name any process of their groups still there")
    # Accepted from NVRx 0.7, no effect here (ft_launcher/nvrx_flags.py says what does their job);
    # skip_section_response: NVRx 0.6+'s own client on the monitor's socket sends sections and
    # heartbeats unanswered (monitor_side.nvrx_peers).
    num_warmup_iterations: int = key(5, as_int, None)
    skip_section_response: bool = key(True, boolean, None)
    attribution_endpoint: Optional[str] = key(None, optional_str, None)
    attribution_stop_action: Optional[str] = key(None, optional_str, None)
    attribution_export_url: Optional[str] = key(None, optional_str, None)
    segment_health_check_dir: Optional[str] = key(None, optional_str, None)

    def __post_init__(self) -> None:
        # NVRx's types whatever the caller passed ("SIGTERM", 15, "debug", 10)
        self.rank_termination_signal = parse_signal(self.rank_termination_signal)
        self.log_level = log_level_value(self.log_level, "config")

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_sources(cls, *layers: "tuple[str, Mapping[str, Any]]", warn=None) -> "FaultToleranceConfig":
        """Build from (source_name, mapping) layers, later layers overriding earlier ones.
        An explicit null timeout, from any source, is pinned: computed timeouts never replace it."""
        cfg = cls()
        nulls = set()
        for source, mapping in layers:
            cfg.update(mapping, source, warn=warn)
            nulls |= {key for key, value in cfg.timeout_keys().items() if value is None and _mentions(mapping, key)}
        cfg.pinned_timeouts = sorted(set(cfg.pinned_timeouts) | nulls)
        cfg.validate()
        return cfg

    def timeout_keys(self) -> Dict[str, Optional[float]]:
        """Timeouts under the uniform keys of rank_monitor.timeout_calc."""
        out = {f"section:{k}": v for k, v in self.rank_section_timeouts.items()}
        out["out_of_section"] = self.rank_out_of_section_timeout
        out["heartbeat:initial"] = self.initial_rank_heartbeat_timeout
        out["heartbeat:subsequent"] = self.rank_heartbeat_timeout
        return out

    def update(self, mapping: Mapping[str, Any], source: str, warn=None) -> None:
        for raw_key, value in mapping.items():
            key = normalize_key(str(raw_key))
            if key not in FIELD_NAMES:
                hint = closest_key(key)
                msg = f"{source}: unknown fault_tolerance key '{raw_key}'" + (
                    f" (did you mean '{hint}'?)" if hint else "")
                if warn is None:
                    raise ConfigError(msg)
                warn(msg + "; ignored")
                continue
            parsed = parse_value(key, value, source)
            if key == "rank_section_timeouts":  # per-section precedence: later sources win per name
                parsed = {**self.rank_section_timeouts, **parsed}
            setattr(self, key, parsed)

    def validate(self) -> None:
        for name, value in self.timeouts().items():
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"timeout {name} must be a positive number of seconds or null, got {value}")
        if not self.safety_factor > 0:
            raise ConfigError(f"safety_factor must be positive, got {self.safety_factor}")
        if not self.warm_reserve_timeout > 0:
            raise ConfigError(f"warm_reserve_timeout must be positive, got {self.warm_reserve_timeout}")
        if not self.straggler_threshold > 1:
            raise ConfigError(f"straggler_threshold must be above 1 (a ratio to the median), got {self.straggler_threshold}")
        if self.straggler_windows < 1:
            raise ConfigError(f"straggler_windows must be at least 1, got {self.straggler_windows}")
        if self.max_identical_failures < 0:
            raise ConfigError(f"max_identical_failures must be 0 (never) or more, got {self.max_identical_failures}")
        if not 1 <= self.no_restart_exit_code <= 255:
            raise ConfigError(f"no_restart_exit_code must be 1-255, got {self.no_restart_exit_code}")
        if not (self.inprocess_timeout > 0 and math.isfinite(self.inprocess_timeout)):
            raise ConfigError(f"inprocess_timeout must be a positive number of seconds, got {self.inprocess_timeout}")
        if self.active_world_size is not None and self.active_world_size < 1:
            raise ConfigError(f"active_world_size must be a positive integer or null, got {self.active_world_size}")
        if self.restart_granularity not in RESTART_GRANULARITIES:
            raise ConfigError(f"restart_granularity must be one of {', '.join(RESTART_GRANULARITIES)}, "
                              f"got {self.restart_granularity!r}")
        for key in ("rank_termination_grace", "stack_dump_wait", "workload_check_interval", "teardown_hang_grace"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key} must not be negative, got {getattr(self, key)}")

    # ---- views ----------------------------------------------------------------------------
    def timeouts(self) -> Dict[str, Optional[float]]:
        out = {f"section {k}": v for k, v in self.rank_section_timeouts.items()}
        out["rank_out_of_section_timeout"] = self.rank_out_of_section_timeout
        out["initial_rank_heartbeat_timeout"] = self.initial_rank_heartbeat_timeout
        out["rank_heartbeat_timeout"] = self.rank_heartbeat_timeout
        return out

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "FaultToleranceConfig":
        return cls(**json.loads(text))

    # ---- NVRx's constructors (training scripts call these) -----------------------------------
    @classmethod
    def from_kwargs(cls, ignore_not_recognized: bool = True, **kwargs) -> "FaultToleranceConfig":
        """From keyword arguments named as the fields; others are ignored, or with
        ignore_not_recognized=False a ConfigError (a ValueError, as in NVRx)."""
        known = {k: v for k, v in kwargs.items() if k in FIELD_NAMES}
        extra = sorted(k for k in kwargs if k not in FIELD_NAMES)
        if extra and not ignore_not_recognized:
            raise ConfigError(f"not recognized fault_tolerance keys: {', '.join(extra)}")
        return cls.from_sources(("from_kwargs", known))

    @classmethod
    def from_yaml_file(cls, cfg_path: str, ignore_not_recognized: bool = True) -> "FaultToleranceConfig":
        """From the `fault_tolerance:` section of a YAML file, found at any nesting level."""
        from ft_launcher.rank_monitor.config.yaml_file import load_yaml_section

        return cls.from_kwargs(ignore_not_recognized=ignore_not_recognized, **load_yaml_section(cfg_path))

    @classmethod
    def from_args(cls, args) -> "FaultToleranceConfig":
        """From an argparse namespace with NVRx's attributes: `ft_cfg_path` (a YAML file) and
        `ft_<field>`; the latter override the file. Neither: a ConfigError."""
        from ft_launcher.rank_monitor.config.yaml_file import load_yaml_section

        layers = []
        path = getattr(args, "ft_cfg_path", None)
        if path is not None:
            layers.append((path, load_yaml_section(path)))
        flags = {name: getattr(args, f"ft_{name}") for name in FIELD_NAMES
                 if getattr(args, f"ft_{name}", None) is not None}
        if flags:
            layers.append(("arguments", flags))
        if not layers:
            raise ConfigError("No fault tolerance configuration provided.")
        return cls.from_sources(*layers)

    def to_yaml_file(self, cfg_path: str) -> None:
        """Write a `fault_tolerance:` section that from_yaml_file (ours or NVRx's) reads back."""
        import yaml

        data = dataclasses.asdict(self)
        data["rank_termination_signal"] = signal.Signals(self.rank_termination_signal).name
        data["log_level"] = logging.getLevelName(self.log_level)
        with open(cfg_path, "w") as fh:
            yaml.safe_dump({"fault_tolerance": data}, fh)


FIELD_NAMES = tuple(f.name for f in dataclasses.fields(FaultToleranceConfig))
_TIMEOUT_FIELDS = {"out_of_section": "rank_out_of_section_timeout",
                   "heartbeat:initial": "initial_rank_heartbeat_timeout",
                   "heartbeat:subsequent": "rank_heartbeat_timeout"}


def _mentions(mapping: Mapping[str, Any], key: str) -> bool:
    """Does this source mapping set the timeout behind uniform `key`?"""
    names = {normalize_key(str(k)): v for k, v in mapping.items()}
    if key.startswith("section:"):
        sections = names.get("rank_section_timeouts")
        if sections is None:
            return False
        try:
            return key[len("section:"):] in parse_section_timeouts(sections, "")
        except ConfigError:
            return False
    return _TIMEOUT_FIELDS[key] in names


def normalize_key(key: str) -> str:
    """`--ft-rank-section-timeouts`, `ft-param-rank_section_timeouts`, ... -> field name."""
    key = key.lstrip("-")
    if key.replace("-", "_") in FIELD_NAMES:   # ft_state_path is a field, not ft_ + state_path
        return key.replace("-", "_")
    for prefix in ("ft-param-", "ft_param_", "ft-", "ft_"):
        if key.startswith(prefix):
            key = key[len(prefix):]
            break
    return key.replace("-", "_")


def closest_key(key: str) -> Optional[str]:
    hits = difflib.get_close_matches(key, FIELD_NAMES, n=1, cutoff=0.6)
    return hits[0] if hits else None


FIELDS = {f.name: f for f in dataclasses.fields(FaultToleranceConfig)}


def help_of(key: str) -> Optional[str]:
    """The key's one line of --help (None: accepted, not shown)."""
    return FIELDS[key].metadata["help"]


def default_of(key: str) -> Any:
    f = FIELDS[key]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def parse_value(key: str, value: Any, source: str, name: Optional[str] = None) -> Any:
    """`value` for field `key`; errors call it `name` (default: the key)."""
    return FIELDS[key].metadata["parse"](name or key, value, source)
