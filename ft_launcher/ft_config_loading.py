"""Turns a YAML file and `--ft-*` flags into a FaultToleranceConfig (precedence: CLI >
FT_SIM_FAULT_DESC > file > defaults).

The keys sit under a `fault_tolerance:` section that may be nested at any depth (Megatron and
NeMo configs nest it). Bad files give one-line errors; unknown keys in a file give a warning
naming the closest known key.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional

import yaml

from rank_monitor.config import ConfigError, FaultToleranceConfig, parse_sim_fault_desc

SECTION = "fault_tolerance"


def find_section(node: Any) -> Optional[dict]:
    """Breadth-first search for the first `fault_tolerance:` key; its value must be a mapping."""
    queue = [node]
    while queue:
        item = queue.pop(0)
        if isinstance(item, dict):
            if SECTION in item:
                value = item[SECTION]
                if value is None:
                    return {}
                if not isinstance(value, dict):
                    raise ConfigError(f"'{SECTION}:' must be a mapping of keys to values, "
                                      f"got {type(value).__name__}")
                return value
            queue.extend(item.values())
        elif isinstance(item, list):
            queue.extend(item)
    return None


def load_yaml_section(path: str) -> Dict[str, Any]:
    try:
        with open(path) as fh:
            data = yaml.safe_load(fh)
    except FileNotFoundError:
        raise ConfigError(f"--ft-cfg-path: no such file: {path}") from None
    except OSError as exc:
        raise ConfigError(f"--ft-cfg-path: cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}: invalid YAML{where}: {problem}") from None
    try:
        section = find_section(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if section is None:
        raise ConfigError(f"{path}: no 'fault_tolerance:' section found")
    return section


def build_ft_config(cfg_path: Optional[str], cli_values: Dict[str, Any],
                    warn: Callable[[str], None]) -> FaultToleranceConfig:
    layers = []
    if cfg_path:
        layers.append((cfg_path, load_yaml_section(cfg_path)))
    if os.environ.get("FT_SIM_FAULT_DESC"):
        layers.append(("FT_SIM_FAULT_DESC", parse_sim_fault_desc(os.environ["FT_SIM_FAULT_DESC"])))
    layers.append(("command line", cli_values))
    return FaultToleranceConfig.from_sources(*layers, warn=warn)
