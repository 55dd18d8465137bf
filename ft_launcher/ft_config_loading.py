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
from typing import Any, Callable, Dict, Optional, Tuple

from ft_launcher.flags import UsageError, warn
from ft_launcher.rank_monitor.config import ConfigError, FaultToleranceConfig, load_yaml_file, parse_sim_fault_desc


def build_ft_config(cfg_path: Optional[str], cli_values: Dict[str, Any],
                    warn: Callable[[str], None]) -> FaultToleranceConfig:
    layers = []
    if cfg_path:
        layers.append((cfg_path, load_yaml_file(cfg_path, warn)))
    if os.environ.get("FT_SIM_FAULT_DESC"):
        layers.append(("FT_SIM_FAULT_DESC", parse_sim_fault_desc(os.environ["FT_SIM_FAULT_DESC"])))
    layers.append(("command line", cli_values))
    return FaultToleranceConfig.from_sources(*layers, warn=warn)


def ft_config_from_args(args) -> Tuple[FaultToleranceConfig, Dict[str, Any]]:
    """(the config, the keys given as `--ft-<key>` flags) of the launcher's parsed flags; a bad value
    or file is a UsageError, a doubtful one a warning."""
    ft_cli = {k[4:]: v for k, v in vars(args).items() if k.startswith("ft__") and v is not None}
    try:
        return build_ft_config(args.ft_cfg_path, ft_cli, warn=warn), ft_cli
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
