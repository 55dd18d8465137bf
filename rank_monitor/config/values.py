"""Fault-tolerance values: one parser per kind of value a key holds (seconds, numbers, booleans,
choices, signals, section timeouts, log levels), each turning what a YAML file, a flag or a
keyword gave into the key's type, or raising a one-line `ConfigError` that names the key and the
value's source. A parser is called as `parse(key, value, source)`."""
from __future__ import annotations

import difflib
import json
import logging
import math
import signal
from typing import Any, Callable, Dict, List, Mapping, Optional

NULL_WORDS = ("null", "none", "")


class ConfigError(ValueError):
    """A configuration problem, worded as one line for the operator."""


def _null(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() in NULL_WORDS)


def timeout(key: str, value: Any, source: str) -> Optional[float]:
    if _null(value):
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


def number(key: str, value: Any, source: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{source}: {key} must be a number, got {value!r}")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: {key} must be a number, got {value!r}") from None
    if out < 0 or not math.isfinite(out):
        raise ConfigError(f"{source}: {key} must be a non-negative number, got {value!r}")
    return out


def boolean(key: str, value: Any, source: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{source}: {key} must be true or false, got {value!r}")


def _choice(key: str, value: Any, source: str, choices) -> str:
    text = str(value).strip()
    if text not in choices:
        hint = difflib.get_close_matches(text.lower(), choices, n=1, cutoff=0.5)
        raise ConfigError(f"{source}: {key} must be one of {', '.join(choices)}, got {value!r}"
                          + (f" (did you mean '{hint[0]}'?)" if hint else ""))
    return text


def positive(key: str, value: Any, source: str) -> float:
    out = number(key, value, source)
    if out == 0:
        raise ConfigError(f"{source}: {key} must be a positive number, got {value!r}")
    return out


def positive_int_or_null(key: str, value: Any, source: str) -> Optional[int]:
    if _null(value):
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{source}: {key} must be a positive integer or null, got {value!r}")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: {key} must be a positive integer or null, got {value!r}") from None
    if not (math.isfinite(out) and out >= 1 and out == int(out)):
        raise ConfigError(f"{source}: {key} must be a positive integer or null, got {value!r}")
    return int(out)


def section_name(key: str, value: Any, source: str) -> str:
    text = "" if value is None else str(value).strip()
    if not text:
        raise ConfigError(f"{source}: {key} must be a section name, got {value!r}")
    return text


def optional_str(key: str, value: Any, source: str) -> Optional[str]:
    """A path or name, or None for null/none/empty (every optional path key parses alike)."""
    if value is None or str(value).strip().lower() in NULL_WORDS:
        return None
    return str(value).strip()


def as_int(key: str, value: Any, source: str) -> int:
    out = number(key, value, source)
    if out != int(out):
        raise ConfigError(f"{source}: {key} must be a non-negative integer, got {value!r}")
    return int(out)


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
    return {str(name): timeout(f"{key}.{name}", seconds, source) for name, seconds in value.items()}




def parse_pins(value: Any, source: str) -> List[str]:
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


def log_level_value(value: Any, source: str) -> int:
    """A level name or number -> the logging level number (NVRx's type)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if logging.DEBUG <= value <= logging.CRITICAL:
            return value
    else:
        level = _LEVELS.get(str(value).strip().upper())
        if level is not None:
            return level
    raise ConfigError(f"{source}: log_level must be DEBUG, INFO, WARNING, ERROR or CRITICAL, got {value!r}")


# ---- the parsers the schema names (each `(key, value, source) -> value`) ------------------------
def choice(choices) -> Callable[[str, Any, str], str]:
    return lambda key, value, source: _choice(key, value, source, choices)


def optional_int(key: str, value: Any, source: str) -> Optional[int]:
    return None if _null(value) else as_int(key, value, source)


def fault_count(key: str, value: Any, source: str) -> int:
    """Faults per job; -1 (or `every`): one per cycle."""
    return -1 if str(value).strip().lower() in ("every", "every_cycle", "-1") else as_int(key, value, source)


def sdc_spec(key: str, value: Any, source: str) -> str:
    """rank_sdc's fault: KIND:STEP[:PERSIST[:PLACE]] (rank_side.live.sdc_sim): KIND nan, inf, bitflip,
    expflip or mantflip; PERSIST once (default), device or node; PLACE backward (default), reduced or
    memory."""
    from ft_launcher.rank_monitor.rank_side.live import sdc_sim

    parts = [p.strip().lower() for p in str(value).split(":")]
    parts += ["once", "backward"][len(parts) - 2:] if 2 <= len(parts) < 4 else []
    if (len(parts) != 4 or parts[0] not in sdc_sim.KINDS or not parts[1].isdigit()
            or parts[2] not in sdc_sim.PERSISTS or parts[3] not in sdc_sim.PLACES):
        raise ConfigError(f"{source}: {key} must be KIND:STEP[:PERSIST[:PLACE]] ({', '.join(sdc_sim.KINDS)}; a "
                          f"step; {', '.join(sdc_sim.PERSISTS)}; {', '.join(sdc_sim.PLACES)}), e.g. "
                          f"nan:137:once:backward, got {value!r}")
    return ":".join(parts)


def section_timeouts(key: str, value: Any, source: str) -> Dict[str, Optional[float]]:
    return parse_section_timeouts(value, source)


def signal_value(key: str, value: Any, source: str) -> signal.Signals:
    return parse_signal(value, source, key)


def pins(key: str, value: Any, source: str) -> List[str]:
    return parse_pins(value, source)


def level_name(key: str, value: Any, source: str) -> int:
    return log_level_value(value, source)
