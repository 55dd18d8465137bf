"""The fault-tolerance configuration: the schema (`schema`: every key declared once), the value
parsers (`values`) and the YAML file with Megatron-Bridge's names (`yaml_file`). The names other
modules use are importable from here."""
from ft_launcher.rank_monitor.config.schema import (  # noqa: F401
    COMMON_SECTIONS, FAULT_TYPES, FIELD_NAMES, FIELDS, RESTART_GRANULARITIES, FaultToleranceConfig, closest_key,
    default_of, help_of, normalize_key, parse_value)
from ft_launcher.rank_monitor.config.values import (  # noqa: F401
    NULL_WORDS, ConfigError, parse_section_timeouts, parse_signal, parse_sim_fault_desc)
from ft_launcher.rank_monitor.config.yaml_file import (  # noqa: F401
    MB_ALIASES, MB_IGNORED, MB_NAMES, load_yaml_file, load_yaml_section, megatron_bridge_aliases)
