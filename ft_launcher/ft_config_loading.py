"""Turns a YAML file and `--ft-*` flags into a FaultToleranceConfig (precedence: CLI >
FT_SIM_FAULT_DESC > file > defaults).

The keys sit under a `fault_tolerance:` section that may be nested at any depth (Megatron and
NeMo configs nest it; rank_monitor.config.load_yaml_file finds it), Megatron-Bridge's
InProcessRestartConfig names also there or in an `inprocess_restart:` section. Bad files give
one-line errors; unknown keys in a file give a warning naming the closest known key, and the
Megatron-Bridge names with no meaning here one warning for all of them.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional

from ft_launcher.rank_monitor.config import FaultToleranceConfig, load_yaml_file, parse_sim_fault_desc


def build_ft_config(cfg_path: Optional[str], cli_values: Dict[str, Any],
                    warn: Callable[[str], None]) -> FaultToleranceConfig:
    layers = []
    if cfg_path:
        layers.append((cfg_path, load_yaml_file(cfg_path, warn)))
    if os.environ.get("FT_SIM_FAULT_DESC"):
        layers.append(("FT_SIM_FAULT_DESC", parse_sim_fault_desc(os.environ["FT_SIM_FAULT_DESC"])))
    layers.append(("command line", cli_values))
    return FaultToleranceConfig.from_sources(*layers, warn=warn)
