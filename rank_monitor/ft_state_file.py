"""ft_state.json: computed timeouts and the observations behind them, kept between runs.

The file is what NVRx's `RankMonitorClient.state_dict()` returns (and Megatron writes), with our
own fields beside it at the top level:

    {"current_timeouts": {
        "section": {"section": {"setup": 600.0, "step": 12.4},       # every timeout in effect
                    "out_of_section": 30.0,
                    "calculated_sections": ["step"],                  # ... of which computed
                    "is_out_of_section_calculated": true},
        "heartbeat": {"initial": 60.0, "subsequent": 10.0, "were_calculated": true}},
     "format_version": 2,
     "computed": ["heartbeat:initial", "heartbeat:subsequent", "out_of_section", "section:step"],
     "observations": {"section:step": {"count": 800, "max": 2.48, "when": 1795000000.0}, ...},
     "config": {"safety_factor": 5.0, "calc_min_observations": 10, "calc_timeout_floor": 5.0},
     "updated": 1795000000.0}

`current_timeouts` holds NVRx's `SectionTimeouts` and `HeartbeatTimeouts` field for field, so
NVRx's own `load_state_dict` takes the file. As NVRx does, `section` is present only when a
section or out-of-section timeout was computed and `heartbeat` only when a heartbeat timeout was;
values that were not computed are the writer's configured ones, marked as not calculated.
NVRx has one `were_calculated` flag for both heartbeat timeouts; `computed` names each computed
timeout, so a file where only the subsequent heartbeat timeout was learned says so.

Loading takes as computed only what the file marks computed: `computed` when present, otherwise
`calculated_sections`, `is_out_of_section_calculated` and `were_calculated` (files NVRx or
Megatron wrote). Every other value is kept apart (`FtState.others`) and never applied: a
configured value in someone's file must not override this job's configuration. Format 1 (the
flat `section` map of ft_launcher 0.1, where every value was computed) still loads.

Writing is atomic (temp file in the same directory, fsync, rename, directory fsync) under a
`filelock` lock, so concurrent writers on a shared filesystem never leave a torn file. A file
that is not a valid state (not UTF-8, truncated or too deeply nested JSON, a value of the wrong
type or not finite anywhere, an unknown version) is renamed aside with one warning and the job
runs on its configured timeouts.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Callable, Dict, Optional

from ft_launcher.rank_monitor import atomic_file

from ft_launcher.rank_monitor.timeout_calc import HB_INITIAL, HB_SUBSEQUENT, OUT_OF_SECTION, Observation, section_key

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)   # 1: ft_launcher 0.1's flat section map, every value computed
CURRENT_TIMEOUTS = "current_timeouts"   # NVRx's RankMonitorClient.CURRENT_TIMEOUTS_STATE_KEY

Timeouts = Dict[str, Optional[float]]   # uniform keys of timeout_calc -> seconds (None: off)


class StateFormatError(ValueError):
    pass


@dataclasses.dataclass
class FtState:
    timeouts: Timeouts = dataclasses.field(default_factory=dict)   # computed values only
    observations: Dict[str, Observation] = dataclasses.field(default_factory=dict)
    config: dict = dataclasses.field(default_factory=dict)
    updated: float = 0.0
    # Values in effect when the file was written that were not computed (configured ones): written
    # so that NVRx's client sees complete SectionTimeouts/HeartbeatTimeouts, never applied on load.
    others: Timeouts = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        return {CURRENT_TIMEOUTS: to_current_timeouts(self.timeouts, self.others),
                "format_version": FORMAT_VERSION, "computed": sorted(self.timeouts),
                "observations": {k: dataclasses.asdict(v) for k, v in sorted(self.observations.items())},
                "config": self.config, "updated": self.updated}


def to_current_timeouts(computed: Timeouts, others: Timeouts) -> dict:
    """NVRx's `current_timeouts` object (what its `state_dict()` holds) for these timeouts."""
    current: dict = {}
    names = [k[len("section:"):] for k in computed if k.startswith("section:")]
    if names or OUT_OF_SECTION in computed:
        everything = {**others, **computed}
        current["section"] = {
            "section": {k[len("section:"):]: v for k, v in sorted(everything.items()) if k.startswith("section:")},
            "out_of_section": everything.get(OUT_OF_SECTION),
            "calculated_sections": sorted(names),
            "is_out_of_section_calculated": OUT_OF_SECTION in computed,
        }
    if HB_INITIAL in computed or HB_SUBSEQUENT in computed:
        value = lambda key: computed[key] if key in computed else others.get(key)  # noqa: E731
        current["heartbeat"] = {"initial": value(HB_INITIAL), "subsequent": value(HB_SUBSEQUENT),
                                "were_calculated": HB_INITIAL in computed and HB_SUBSEQUENT in computed}
    return current


def _seconds(value, where: str) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise StateFormatError(f"{where} is not a positive number of seconds: {value!r}")
    return float(value)


def _flag(value, where: str) -> bool:
    if value is not None and not isinstance(value, bool):
        raise StateFormatError(f"{where} is not true or false: {value!r}")
    return bool(value)


def from_current_timeouts(current, computed_keys=None, legacy: bool = False) -> "tuple[Timeouts, Timeouts]":
    """(computed, others) from a `current_timeouts` object. Computed are those the object marks
    calculated (NVRx's flags), or exactly `computed_keys` when given; `legacy`: ft_launcher 0.1's
    flat form, where every value was computed."""
    if not isinstance(current, dict):
        raise StateFormatError(f"no {CURRENT_TIMEOUTS} object")
    values: Timeouts = {}
    flagged = set()
    section = current.get("section", {})
    if not isinstance(section, dict):
        raise StateFormatError(f"{CURRENT_TIMEOUTS}.section is not an object")
    if isinstance(section.get("section"), dict):                 # NVRx's SectionTimeouts
        calculated = section.get("calculated_sections") or []
        if not isinstance(calculated, (list, tuple)) or not all(isinstance(n, str) for n in calculated):
            raise StateFormatError(f"calculated_sections is not a list of section names: {calculated!r}")
        for name, value in section["section"].items():
            values[section_key(str(name))] = _seconds(value, f"section {name}")
            if name in calculated:
                flagged.add(section_key(str(name)))
        if "out_of_section" in section:
            values[OUT_OF_SECTION] = _seconds(section["out_of_section"], "out_of_section")
            if _flag(section.get("is_out_of_section_calculated"), "is_out_of_section_calculated"):
                flagged.add(OUT_OF_SECTION)
    elif legacy:                                                 # format 1: {"step": 12.4, ...}
        for name, value in section.items():
            values[section_key(str(name))] = _seconds(value, f"section {name}")
        if "out_of_section" in current:
            values[OUT_OF_SECTION] = _seconds(current["out_of_section"], "out_of_section")
    elif section:
        raise StateFormatError(f"{CURRENT_TIMEOUTS}.section has no 'section' map (NVRx's SectionTimeouts)")
    heartbeat = current.get("heartbeat")
    if heartbeat is not None:
        if not isinstance(heartbeat, dict):
            raise StateFormatError(f"{CURRENT_TIMEOUTS}.heartbeat is not an object")
        were = _flag(heartbeat.get("were_calculated"), "were_calculated")
        for field, key in (("initial", HB_INITIAL), ("subsequent", HB_SUBSEQUENT)):
            if field in heartbeat:
                values[key] = _seconds(heartbeat[field], f"heartbeat {field}")
                if were:
                    flagged.add(key)
    if legacy:
        flagged = set(values)
    elif computed_keys is not None:
        flagged = set(computed_keys)
    computed = {k: v for k, v in values.items() if k in flagged}
    others = {k: v for k, v in values.items() if k not in flagged}
    return computed, others


def _number(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise StateFormatError(f"{where} is not a number >= 0: {value!r}")
    return float(value)


def parse(data) -> FtState:
    """The state in a decoded JSON document; StateFormatError for anything that is not one."""
    if not isinstance(data, dict):
        raise StateFormatError("not a JSON object")
    version = data.get("format_version")   # none in the files NVRx and Megatron write
    if version is not None and (isinstance(version, bool) or version not in READABLE_VERSIONS):
        raise StateFormatError(f"format_version {version!r}, this ft_launcher reads "
                               f"{', '.join(map(str, READABLE_VERSIONS))}")
    keys = data.get("computed") if version == FORMAT_VERSION else None
    if keys is not None and (not isinstance(keys, list) or not all(isinstance(k, str) for k in keys)):
        raise StateFormatError(f"computed is not a list of timeout names: {keys!r}")
    state = FtState()
    state.timeouts, state.others = from_current_timeouts(data.get(CURRENT_TIMEOUTS), keys, legacy=version == 1)
    observations = data.get("observations") or {}
    if not isinstance(observations, dict):
        raise StateFormatError("observations is not an object")
    for key, obs in observations.items():
        if not isinstance(obs, dict) or "count" not in obs or "max" not in obs:
            raise StateFormatError(f"observation {key!r} is malformed")
        count = _number(obs["count"], f"observation {key!r} count")
        if count != int(count):
            raise StateFormatError(f"observation {key!r} count is not a whole number: {obs['count']!r}")
        state.observations[key] = Observation(int(count), _number(obs["max"], f"observation {key!r} max"),
                                              _number(obs.get("when", 0), f"observation {key!r} when"))
    config = data.get("config") or {}
    if not isinstance(config, dict):
        raise StateFormatError("config is not an object")
    state.config = config
    state.updated = _number(data.get("updated") or 0, "updated")
    return state


def load(path: str, warn: Callable[[str], None]) -> Optional[FtState]:
    """The state in `path`, or None (missing, or set aside as unreadable with one warning).
    Unreadable is anything but a valid state: bytes that are not UTF-8, JSON that is truncated or
    nested beyond the parser's depth, a value of the wrong type anywhere."""
    from filelock import FileLock   # here, not at the top: a job that learns no timeouts never loads it

    try:
        with FileLock(path + ".lock", timeout=30):
            try:
                with open(path, "rb") as fh:
                    raw = fh.read()
            except FileNotFoundError:
                return None
            try:
                return parse(json.loads(raw.decode("utf-8")))
            except (ValueError, StateFormatError, RecursionError) as exc:   # UnicodeDecodeError is a ValueError
                aside = _aside_name(path)
                os.rename(path, aside)
                reason = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
                warn(f"{path} is unreadable ({reason}): kept aside as {aside}; running on the configured timeouts")
                return None
    except OSError as exc:
        warn(f"cannot read {path}: {exc}; running on the configured timeouts")
        return None


def _aside_name(path: str) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    n = 0
    while True:  # never overwrite an earlier aside file
        aside = f"{path}.corrupt-{stamp}" + (f"-{n}" if n else "")
        if not os.path.exists(aside):
            return aside
        n += 1


def save(path: str, state: FtState) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    data = json.dumps(state.to_json(), indent=2, sort_keys=True) + "\n"
    from filelock import FileLock

    with FileLock(path + ".lock", timeout=30):
        atomic_file.write(path, data, durable=True)
