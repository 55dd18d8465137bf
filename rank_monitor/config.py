"""The fault-tolerance configuration schema: keys, defaults, validation and value parsing.

This is the one definition of what a `fault_tolerance:` YAML section or an `--ft-<key>` flag may
hold. It lives at the bottom layer because it travels to every rank monitor; `ft_launcher` only
finds the flags and hands them here. Every problem is raised as `ConfigError` (a ValueError) with
a one-line message naming the key and the source of the bad value.

`FaultToleranceConfig` is also NVRx's class of that name for training scripts: the same field
names and types (`rank_termination_signal` a `signal.Signals`, `log_level` a logging level
number) and its constructors `from_kwargs`, `from_yaml_file`, `from_args`, plus `to_yaml_file`.
NVRx's keys that mean nothing here (`node_health_check_interval`, `restart_check_interval`,
`enable_nic_monitor`, `pci_topo_file`, `link_down_path_template`, and of NVRx 0.7's keys
`num_warmup_iterations`, the attribution keys and `segment_health_check_dir`) and
Megatron-Bridge's `enable_ft_package` are accepted and have no effect (`skip_section_response`
is what the monitor tells NVRx 0.6+'s own client: monitor_side.nvrx_peers). NVRx 0.7's other keys have their meaning here (docs/nvrx-flags.md says where each is built).

Megatron-Bridge's `InProcessRestartConfig` names are accepted too, under `fault_tolerance:` or in
an `inprocess_restart:` section of the same file (`megatron_bridge_aliases`): those with a meaning
here become our keys, the others are collected for one warning.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import signal
from typing import Any, Dict, List, Mapping, Optional

# Section names every user knows; any other name is accepted too.
COMMON_SECTIONS = ("setup", "step", "checkpointing")
NULL_WORDS = ("null", "none", "")


class ConfigError(ValueError):
    """A configuration problem, worded as one line for the operator."""


@dataclasses.dataclass
class FaultToleranceConfig:
    """Timeouts are seconds; None means "no timeout"."""

    rank_section_timeouts: Dict[str, Optional[float]] = dataclasses.field(default_factory=dict)
    rank_out_of_section_timeout: Optional[float] = None
    initial_rank_heartbeat_timeout: Optional[float] = None
    rank_heartbeat_timeout: Optional[float] = None
    rank_termination_signal: signal.Signals = signal.SIGKILL
    # With a catchable termination signal, SIGKILL follows after this many seconds.
    rank_termination_grace: float = 5.0
    # How long a monitor waits for a hung rank's stack dump before terminating it.
    stack_dump_wait: float = 0.3
    # NVRx's polling period. Our monitors are deadline driven; they poll shared memory at
    # min(this, 0.05) s, so a hang is seen within its timeout + 50 ms whatever is set here.
    workload_check_interval: float = 5.0
    safety_factor: float = 5.0
    # Computed timeouts (see rank_monitor/timeout_calc.py for the rule).
    calc_ft_timeouts: bool = False
    calc_min_observations: int = 10
    calc_timeout_floor: float = 5.0
    ft_state_path: Optional[str] = None
    # Timeout keys ("section:step", "out_of_section", "heartbeat:initial", ...) that computed
    # timeouts must not replace: those the user pins (bare section names are accepted, and
    # "heartbeat" means both heartbeat timeouts), and explicit nulls.
    pinned_timeouts: List[str] = dataclasses.field(default_factory=list)
    log_level: int = logging.INFO
    # Simulated faults (Megatron-Bridge's names), injected by the agent into any script.
    simulate_fault: bool = False
    simulated_fault_type: str = "random"          # rank_hung | rank_killed | random
    simulated_fault_rank: Optional[int] = None    # global rank; None: chosen from the seed
    simulated_fault_base_delay: float = 10.0      # seconds after the rank starts, plus <=20% jitter
    simulated_fault_seed: int = 0
    simulated_fault_count: int = 1                # faults per job, one per cycle at most; -1: every cycle
    # Warm reserves (agent.ranks.reserve_pool): warm interpreters per local rank slot that restarts use
    # instead of a cold start; 0 turns them off. A reserve not warm after the timeout is replaced.
    warm_reserves: int = 1
    warm_reserve_timeout: float = 120.0
    # Stragglers (agent.observation.stragglers): every straggler_window seconds each rank's mean time in
    # straggler_section is compared with the job's median; a rank over straggler_threshold x the
    # median for straggler_windows windows in a row is reported. straggler_window 0: off.
    straggler_section: str = "step"
    straggler_window: float = 60.0
    straggler_threshold: float = 1.5
    straggler_windows: int = 3
    # Exclude a reported straggler's node at the next restart when a hot spare can take its place.
    straggler_exclude: bool = False
    # Stopping when restarting is pointless (agent.recovery.progress): after this many cycles in a row
    # that ended without one completed `step` section on any rank (once the job has completed
    # one), the job stops; 0: never. Every agent then exits with no_restart_exit_code.
    max_no_progress_cycles: int = 3
    no_restart_exit_code: int = 93
    # Health checks before each rendezvous (agent.recovery.health_checks): GPUs through NVML when present,
    # the log and checkpoint directories writable, at least min_free_disk_gb free in them.
    health_checks: bool = True
    checkpoint_dir: Optional[str] = None
    min_free_disk_gb: float = 1.0
    # In-process restart (issue 11). Which processes a failure replaces: rank (only the failed
    # rank; the others restart in place), node (every rank of its node), job (every rank: a full
    # restart); auto: rank when the script uses ft.restartable, else job.
    restart_granularity: str = "auto"
    # Seconds a healthy rank has to reach the restart point before it is killed and replaced.
    inprocess_timeout: float = 10.0
    # Ranks that train; the other nodes stand by as warm spares. None: every node trains.
    active_world_size: Optional[int] = None
    # Empty the CUDA cache at an in-place restart.
    empty_cuda_cache: bool = True
    # Accepted so that NVRx and Megatron-Bridge configurations load; no effect here (the agent
    # checks node health by itself; ranks are always monitored under ft_launcher).
    node_health_check_interval: float = 5.0
    restart_check_interval: float = 60.0
    enable_nic_monitor: bool = True
    pci_topo_file: Optional[str] = None
    link_down_path_template: Optional[str] = None
    enable_ft_package: bool = False
    # NVRx 0.7's keys (nvidia-resiliency-ext 0.7.0, fault_tolerance/config.py). With a meaning here:
    # GPU memory after a kill (agent.ranks.gpu_memory): wait at most gpu_memory_reclaim_timeout s,
    # polling every gpu_memory_poll_interval s, until no GPU lists a dead rank's process holding
    # more than gpu_memory_tolerance_mb MB (ours wait 10 s and poll at 0.05 s by default, NVRx
    # 50 s and 2 s).
    gpu_memory_reclaim_timeout: float = 10.0
    gpu_memory_tolerance_mb: float = 512.0
    gpu_memory_poll_interval: float = 0.05
    # A rank's uncaught exception is reported to the launcher at raise time (rank_monitor.rank_side.excepthook).
    install_exception_hook: bool = False
    # Comma-separated paths that must exist and be readable before each rendezvous (health checks).
    storage_healthcheck_path: Optional[str] = None
    # Progress by the checkpoint iteration this file holds, and the rise a cycle needs (agent.recovery.progress).
    checkpoint_iteration_file: Optional[str] = None
    min_progress_iterations: int = 1
    # NVRx's cycle_info files and NVRX_CURRENT_CYCLE_INFO (agent.observation.nvrx_cycle_info).
    cycle_info_dir: Optional[str] = None
    # Health checks before each rendezvous (agent.recovery.health_checks): NIC port states, Lustre/NFS.
    enable_nic_healthcheck: bool = True
    enable_dist_storage_healthcheck: bool = False
    link_state_path_template: Optional[str] = None
    # Nodes train in whole segments of this many nodes of one NVLink domain (agent.rounds.segments).
    segment: Optional[int] = None
    # With NVRX_GPUS_PER_NUMA: CPUs are bound, memory is not; true says so (agent.ranks.numa_bind).
    numa_bind_strict: bool = True
    # After the ranks stop, name what is left of their process groups (agent.ranks.workers).
    check_remaining_processes: bool = False
    # Accepted from NVRx 0.7, no effect here (ft_launcher/nvrx_flags.py says what does their job);
    # skip_section_response: NVRx 0.6+'s own client on the monitor's socket sends sections and
    # heartbeats unanswered (monitor_side.nvrx_peers).
    num_warmup_iterations: int = 5
    skip_section_response: bool = True
    attribution_endpoint: Optional[str] = None
    attribution_stop_action: Optional[str] = None
    attribution_export_url: Optional[str] = None
    segment_health_check_dir: Optional[str] = None

    def __post_init__(self) -> None:
        # NVRx's types whatever the caller passed ("SIGTERM", 15, "debug", 10)
        self.rank_termination_signal = parse_signal(self.rank_termination_signal)
        self.log_level = _log_level(self.log_level, "config")

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
        if not 1 <= self.no_restart_exit_code <= 255:
            raise ConfigError(f"no_restart_exit_code must be 1-255, got {self.no_restart_exit_code}")
        if not (self.inprocess_timeout > 0 and math.isfinite(self.inprocess_timeout)):
            raise ConfigError(f"inprocess_timeout must be a positive number of seconds, got {self.inprocess_timeout}")
        if self.active_world_size is not None and self.active_world_size < 1:
            raise ConfigError(f"active_world_size must be a positive integer or null, got {self.active_world_size}")
        if self.restart_granularity not in RESTART_GRANULARITIES:
            raise ConfigError(f"restart_granularity must be one of {', '.join(RESTART_GRANULARITIES)}, "
                              f"got {self.restart_granularity!r}")
        for key in ("rank_termination_grace", "stack_dump_wait", "workload_check_interval"):
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
        return cls.from_kwargs(ignore_not_recognized=ignore_not_recognized, **load_yaml_section(cfg_path))

    @classmethod
    def from_args(cls, args) -> "FaultToleranceConfig":
        """From an argparse namespace with NVRx's attributes: `ft_cfg_path` (a YAML file) and
        `ft_<field>`; the latter override the file. Neither: a ConfigError."""
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


# ---- the YAML file ---------------------------------------------------------------------------
SECTION = "fault_tolerance"
INPROCESS_SECTION = "inprocess_restart"   # Megatron-Bridge's InProcessRestartConfig


def find_section(node: Any, name: str = SECTION) -> Optional[dict]:
    """Breadth-first search for the first `name:` key; its value must be a mapping."""
    queue = [node]
    while queue:
        item = queue.pop(0)
        if isinstance(item, dict):
            if name in item:
                value = item[name]
                if value is None:
                    return {}
                if not isinstance(value, dict):
                    raise ConfigError(f"'{name}:' must be a mapping of keys to values, "
                                      f"got {type(value).__name__}")
                return value
            queue.extend(item.values())
        elif isinstance(item, list):
            queue.extend(item)
    return None


def _read_yaml(path: str) -> Any:
    import yaml

    try:
        with open(path) as fh:
            return yaml.safe_load(fh)
    except FileNotFoundError:
        raise ConfigError(f"--ft-cfg-path: no such file: {path}") from None
    except OSError as exc:
        raise ConfigError(f"--ft-cfg-path: cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}: invalid YAML{where}: {problem}") from None


def _section_of(data: Any, path: str, name: str) -> Optional[dict]:
    try:
        return find_section(data, name)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def load_yaml_section(path: str) -> Dict[str, Any]:
    """The `fault_tolerance:` mapping of a YAML file, or a one-line ConfigError."""
    section = _section_of(_read_yaml(path), path, SECTION)
    if section is None:
        raise ConfigError(f"{path}: no 'fault_tolerance:' section found")
    return section


def load_yaml_file(path: str, warn=None) -> Dict[str, Any]:
    """What ft_launcher takes from `--ft-cfg-path`: the `fault_tolerance:` section with
    Megatron-Bridge's InProcessRestartConfig names in it, or in an `inprocess_restart:` section of
    the same file, translated (see megatron_bridge_aliases). Either section may be missing, not
    both."""
    data = _read_yaml(path)
    ft = _section_of(data, path, SECTION)
    inprocess = _section_of(data, path, INPROCESS_SECTION)
    if ft is None and inprocess is None:
        raise ConfigError(f"{path}: no 'fault_tolerance:' section found (nor '{INPROCESS_SECTION}:')")
    return megatron_bridge_aliases(ft or {}, inprocess or {}, path, warn)


# Megatron-Bridge's InProcessRestartConfig (megatron/bridge/training/config.py): the names with a
# meaning here, and for the others what does their job here (for the warning).
MB_ALIASES = {"granularity": "restart_granularity", "barrier_timeout": "inprocess_timeout",
              "termination_grace_time": "rank_termination_grace",
              "active_world_size": "active_world_size", "empty_cuda_cache": "empty_cuda_cache"}
_HANG = "hang detection uses the section and heartbeat timeouts, e.g. --ft-rank-section-timeouts"
_BUDGET = "the restart budget is --max-restarts"
MB_IGNORED = {
    "soft_timeout": _HANG, "hard_timeout": _HANG, "heartbeat_timeout": _HANG, "heartbeat_interval": _HANG,
    "progress_watchdog_interval": _HANG,
    "max_iterations": _BUDGET, "max_rank_faults": _BUDGET,
    "monitor_thread_interval": "the rank monitors are deadline driven",
    "monitor_process_interval": "the rank monitors are deadline driven",
    "completion_timeout": "the restart point's bound is --ft-inprocess-timeout",
    "last_call_wait": "the restart point's bound is --ft-inprocess-timeout",
    "monitor_process_logdir": "logs go to --log-dir",
}
MB_NAMES = tuple(sorted({"enabled", *MB_ALIASES, *MB_IGNORED}))


def megatron_bridge_aliases(ft: Mapping[str, Any], inprocess: Mapping[str, Any], source: str,
                            warn=None) -> Dict[str, Any]:
    """One mapping of our keys from a `fault_tolerance:` and an `inprocess_restart:` section.

    Megatron-Bridge names become ours: granularity -> restart_granularity, barrier_timeout ->
    inprocess_timeout, termination_grace_time -> rank_termination_grace, active_world_size and
    empty_cuda_cache as they are; `enabled: false` -> restart_granularity job (`true` changes
    nothing). Precedence: our own name in `fault_tolerance:` > a Megatron-Bridge name there > one
    in `inprocess_restart:`; `enabled: false` > `granularity`. The names with no meaning here are
    named in one warning; an unknown key in `inprocess_restart:` is a warning with the closest
    name (or, without `warn`, a ConfigError). Other keys of `fault_tolerance:` pass through
    unchanged for FaultToleranceConfig.update to check."""
    aliased: Dict[str, Any] = {}
    explicit: Dict[str, Any] = {}
    ignored = set()
    enabled = None
    for section_name, section in ((INPROCESS_SECTION, inprocess), (SECTION, ft)):
        for raw_key, value in section.items():
            key = str(raw_key).strip()
            where = f"{section_name}.{key}"
            if section_name == SECTION and normalize_key(key) in FIELD_NAMES:
                explicit[raw_key] = value
            elif key == "enabled":
                enabled = _bool(where, value, source)
            elif key in MB_ALIASES:
                aliased[MB_ALIASES[key]] = parse_value(MB_ALIASES[key], value, source, name=where)
            elif key in MB_IGNORED:
                ignored.add(key)
            elif section_name == SECTION:
                explicit[raw_key] = value   # unknown: update() warns with the closest key
            else:
                hits = difflib.get_close_matches(key, MB_NAMES, n=1, cutoff=0.6)
                msg = f"{source}: unknown {INPROCESS_SECTION} key '{key}'" + (
                    f" (did you mean '{hits[0]}'?)" if hits else "")
                if warn is None:
                    raise ConfigError(msg)
                warn(msg + "; ignored")
    if enabled is False:
        aliased["restart_granularity"] = "job"
    if ignored and warn is not None:
        names = sorted(ignored)
        hints = "; ".join(dict.fromkeys(MB_IGNORED[name] for name in names))
        warn(f"{source}: Megatron-Bridge {INPROCESS_SECTION} keys with no meaning here, ignored: "
             f"{', '.join(names)} ({hints})")
    explicit_keys = {normalize_key(str(k)) for k in explicit}
    return {**{k: v for k, v in aliased.items() if k not in explicit_keys}, **explicit}


# ---- value parsing ------------------------------------------------------------------------
def _timeout(key: str, value: Any, source: str) -> Optional[float]:
    if value is None or (isinstance(value, str) and value.strip().lower() in NULL_WORDS):
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{source}: {key} must be seconds or null, got {value!r}")
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: {key} must be seconds or null, got {value!r}") from None
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ConfigError(f"{source}: {key} must be a positive number of seconds or null, got {value!r}")
    return seconds


def _number(key: str, value: Any, source: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{source}: {key} must be a number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: {key} must be a number, got {value!r}") from None
    if number < 0 or not math.isfinite(number):
        raise ConfigError(f"{source}: {key} must be a non-negative number, got {value!r}")
    return number


def _bool(key: str, value: Any, source: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{source}: {key} must be true or false, got {value!r}")


FAULT_TYPES = ("rank_hung", "rank_killed", "random")
RESTART_GRANULARITIES = ("auto", "rank", "node", "job")


def _choice(key: str, value: Any, source: str, choices) -> str:
    text = str(value).strip()
    if text not in choices:
        hint = difflib.get_close_matches(text.lower(), choices, n=1, cutoff=0.5)
        raise ConfigError(f"{source}: {key} must be one of {', '.join(choices)}, got {value!r}"
                          + (f" (did you mean '{hint[0]}'?)" if hint else ""))
    return text


def _positive(key: str, value: Any, source: str) -> float:
    number = _number(key, value, source)
    if number == 0:
        raise ConfigError(f"{source}: {key} must be a positive number, got {value!r}")
    return number


def _positive_int_or_null(key: str, value: Any, source: str) -> Optional[int]:
    if value is None or (isinstance(value, str) and value.strip().lower() in NULL_WORDS):
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{source}: {key} must be a positive integer or null, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: {key} must be a positive integer or null, got {value!r}") from None
    if not (math.isfinite(number) and number >= 1 and number == int(number)):
        raise ConfigError(f"{source}: {key} must be a positive integer or null, got {value!r}")
    return int(number)


def _name(key: str, value: Any, source: str) -> str:
    text = "" if value is None else str(value).strip()
    if not text:
        raise ConfigError(f"{source}: {key} must be a section name, got {value!r}")
    return text


def _optional_str(key: str, value: Any, source: str) -> Optional[str]:
    if value is None or str(value).strip().lower() in NULL_WORDS:
        return None
    return str(value).strip()


def _int(key: str, value: Any, source: str) -> int:
    number = _number(key, value, source)
    if number != int(number):
        raise ConfigError(f"{source}: {key} must be a non-negative integer, got {value!r}")
    return int(number)


def parse_sim_fault_desc(text: str) -> Dict[str, Any]:
    """Megatron's FT_SIM_FAULT_DESC="rank_hung;3;60" (type;rank;base delay; rank may be empty)."""
    parts = [p.strip() for p in text.split(";")]
    if len(parts) != 3:
        raise ConfigError(f"FT_SIM_FAULT_DESC: expected type;rank;delay (e.g. rank_hung;3;60), got {text!r}")
    kind, rank, delay = parts
    out: Dict[str, Any] = {"simulate_fault": True, "simulated_fault_type": kind,
                           "simulated_fault_base_delay": delay}
    if rank:
        out["simulated_fault_rank"] = rank
    return out


def parse_signal(value: Any, source: str = "config", key: str = "rank_termination_signal") -> signal.Signals:
    if isinstance(value, signal.Signals):
        return value
    text = str(value).strip()
    if text.lstrip("-").isdigit():
        number = int(text)
        valid = {int(s) for s in signal.Signals}
        if number not in valid:
            raise ConfigError(f"{source}: {key}: {number} is not a signal number")
        return signal.Signals(number)
    name = text.upper()
    if not name.startswith("SIG"):
        name = "SIG" + name
    try:
        return signal.Signals[name]
    except KeyError:
        raise ConfigError(f"{source}: {key}: unknown signal {value!r}") from None


def parse_section_timeouts(value: Any, source: str) -> Dict[str, Optional[float]]:
    """A mapping, or the command-line form `setup:600,step:180,checkpointing:null`."""
    key = "rank_section_timeouts"
    if value is None:
        return {}
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            try:
                value = json.loads(text)
            except ValueError:
                raise ConfigError(f"{source}: {key}: not valid JSON: {text!r}") from None
        else:
            pairs = {}
            for item in filter(None, (p.strip() for p in text.split(","))):
                name, sep, seconds = item.partition(":")
                if not sep or not name.strip():
                    raise ConfigError(
                        f"{source}: {key}: expected name:seconds (e.g. setup:600,step:180), got {item!r}")
                pairs[name.strip()] = seconds.strip()
            value = pairs
    if not isinstance(value, Mapping):
        raise ConfigError(f"{source}: {key} must map section names to seconds, got {value!r}")
    return {str(name): _timeout(f"{key}.{name}", seconds, source) for name, seconds in value.items()}


_PARSERS = {
    "rank_section_timeouts": lambda k, v, s: parse_section_timeouts(v, s),
    "rank_out_of_section_timeout": _timeout,
    "initial_rank_heartbeat_timeout": _timeout,
    "rank_heartbeat_timeout": _timeout,
    "rank_termination_signal": lambda k, v, s: parse_signal(v, s, k),
    "rank_termination_grace": _number,
    "stack_dump_wait": _number,
    "workload_check_interval": _number,
    "safety_factor": _number,
    "calc_ft_timeouts": _bool,
    "calc_min_observations": lambda k, v, s: int(_number(k, v, s)),
    "calc_timeout_floor": _number,
    "ft_state_path": lambda k, v, s: None if v is None or str(v).strip() == "" else str(v),
    "simulate_fault": _bool,
    "simulated_fault_type": lambda k, v, s: _choice(k, v, s, FAULT_TYPES),
    "simulated_fault_rank": lambda k, v, s: None if v is None or str(v).strip().lower() in NULL_WORDS else _int(k, v, s),
    "simulated_fault_base_delay": _number,
    "simulated_fault_seed": lambda k, v, s: _int(k, v, s),
    "simulated_fault_count": lambda k, v, s: -1 if str(v).strip().lower() in ("every", "every_cycle", "-1") else _int(k, v, s),
    "pinned_timeouts": lambda k, v, s: _pins(v, s),
    "warm_reserves": lambda k, v, s: _int(k, v, s),
    "warm_reserve_timeout": _number,
    "straggler_section": lambda k, v, s: _name(k, v, s),
    "straggler_window": _number,
    "straggler_threshold": _number,
    "straggler_windows": lambda k, v, s: _int(k, v, s),
    "straggler_exclude": _bool,
    "max_no_progress_cycles": lambda k, v, s: _int(k, v, s),
    "no_restart_exit_code": lambda k, v, s: _int(k, v, s),
    "health_checks": _bool,
    "checkpoint_dir": lambda k, v, s: None if v is None or str(v).strip() == "" else str(v),
    "min_free_disk_gb": _number,
    "restart_granularity": lambda k, v, s: _choice(k, v, s, RESTART_GRANULARITIES),
    "inprocess_timeout": _positive,
    "active_world_size": _positive_int_or_null,
    "empty_cuda_cache": _bool,
    "log_level": lambda k, v, s: _log_level(v, s),
    "node_health_check_interval": _number,
    "restart_check_interval": _number,
    "enable_nic_monitor": _bool,
    "pci_topo_file": lambda k, v, s: None if v is None else str(v),
    "link_down_path_template": lambda k, v, s: None if v is None else str(v),
    "enable_ft_package": _bool,
    "gpu_memory_reclaim_timeout": _number,
    "gpu_memory_tolerance_mb": _number,
    "gpu_memory_poll_interval": _positive,
    "install_exception_hook": _bool,
    "checkpoint_iteration_file": _optional_str,
    "min_progress_iterations": lambda k, v, s: _int(k, v, s),
    "cycle_info_dir": _optional_str,
    "storage_healthcheck_path": _optional_str,
    "num_warmup_iterations": lambda k, v, s: _int(k, v, s),
    "enable_nic_healthcheck": _bool,
    "enable_dist_storage_healthcheck": _bool,
    "link_state_path_template": _optional_str,
    "skip_section_response": _bool,
    "segment": _positive_int_or_null,
    "numa_bind_strict": _bool,
    "check_remaining_processes": _bool,
    "attribution_endpoint": _optional_str,
    "attribution_stop_action": _optional_str,
    "attribution_export_url": _optional_str,
    "segment_health_check_dir": _optional_str,
}


def _pins(value: Any, source: str) -> List[str]:
    """`step,out_of_section,heartbeat` -> uniform timeout keys."""
    if value is None:
        return []
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)):
        raise ConfigError(f"{source}: pinned_timeouts must be a list of timeout names, got {value!r}")
    out = []
    for name in (str(n).strip() for n in names):
        if not name:
            continue
        if name == "heartbeat":
            out += ["heartbeat:initial", "heartbeat:subsequent"]
        elif name in ("out_of_section", "heartbeat:initial", "heartbeat:subsequent") or name.startswith("section:"):
            out.append(name)
        elif ":" in name:
            raise ConfigError(f"{source}: pinned_timeouts: unknown timeout {name!r} (use a section name, "
                              "out_of_section, heartbeat, heartbeat:initial or heartbeat:subsequent)")
        else:
            out.append(f"section:{name}")
    return out


_LEVELS = {"DEBUG": logging.DEBUG, "DBG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING,
           "WARN": logging.WARNING, "ERROR": logging.ERROR, "CRITICAL": logging.CRITICAL}


def _log_level(value: Any, source: str) -> int:
    """A level name or number -> the logging level number (NVRx's type)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if logging.DEBUG <= value <= logging.CRITICAL:
            return value
    else:
        level = _LEVELS.get(str(value).strip().upper())
        if level is not None:
            return level
    raise ConfigError(f"{source}: log_level must be DEBUG, INFO, WARNING, ERROR or CRITICAL, got {value!r}")


def parse_value(key: str, value: Any, source: str, name: Optional[str] = None) -> Any:
    """`value` for field `key`; errors call it `name` (default: the key)."""
    return _PARSERS[key](name or key, value, source)


assert set(_PARSERS) == set(FIELD_NAMES), "every config field needs a parser"
