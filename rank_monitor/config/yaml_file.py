"""The `--ft-cfg-path` YAML file: its `fault_tolerance:` section (found at any nesting level, as
NVRx and Megatron-Bridge nest it), and Megatron-Bridge's `InProcessRestartConfig` names, under
`fault_tolerance:` or in an `inprocess_restart:` section of the same file, translated into our keys
(those with a meaning here) or named in one warning (the others)."""
from __future__ import annotations

import difflib
from typing import Any, Dict, Mapping, Optional

from ft_launcher.rank_monitor.config.schema import FIELD_NAMES, normalize_key, parse_value
from ft_launcher.rank_monitor.config.values import ConfigError, boolean

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
                enabled = boolean(where, value, source)
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
