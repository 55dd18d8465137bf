"""ft_state.json: computed timeouts and the observations behind them, kept between runs.

Shape (a superset of what NVRx's `RankMonitorClient.state_dict()` gives Megatron to write):

    {"format_version": 1,
     "current_timeouts": {"section": {"step": 12.4, ...}, "out_of_section": 30.0,
                          "heartbeat": {"initial": 60.0, "subsequent": 10.0}},
     "observations": {"section:step": {"count": 800, "max": 2.48, "when": 1795000000.0}, ...},
     "config": {"safety_factor": 5.0, "calc_min_observations": 10, "calc_timeout_floor": 5.0},
     "updated": 1795000000.0}

Loading also accepts the plain NVRx/Megatron form (`current_timeouts` only, with NVRx's
dataclass fields such as `were_calculated`). Writing is atomic (temp file in the same
directory, fsync, rename, directory fsync) under a `filelock` lock, so concurrent writers on a
shared filesystem never leave a torn file. A corrupt, truncated or unknown-version file is
renamed aside with one warning and the job runs on its configured timeouts.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from typing import Callable, Dict, Optional

from filelock import FileLock

from .timeout_calc import HB_INITIAL, HB_SUBSEQUENT, OUT_OF_SECTION, Observation, section_key

FORMAT_VERSION = 1


class StateFormatError(ValueError):
    pass


@dataclasses.dataclass
class FtState:
    timeouts: Dict[str, Optional[float]] = dataclasses.field(default_factory=dict)  # uniform keys
    observations: Dict[str, Observation] = dataclasses.field(default_factory=dict)
    config: dict = dataclasses.field(default_factory=dict)
    updated: float = 0.0

    def to_json(self) -> dict:
        sections = {k[len("section:"):]: v for k, v in self.timeouts.items() if k.startswith("section:")}
        current = {"section": sections}
        if OUT_OF_SECTION in self.timeouts:
            current["out_of_section"] = self.timeouts[OUT_OF_SECTION]
        heartbeat = {}
        if HB_INITIAL in self.timeouts:
            heartbeat["initial"] = self.timeouts[HB_INITIAL]
        if HB_SUBSEQUENT in self.timeouts:
            heartbeat["subsequent"] = self.timeouts[HB_SUBSEQUENT]
        if heartbeat:
            current["heartbeat"] = dict(heartbeat, were_calculated=True)
        return {"format_version": FORMAT_VERSION, "current_timeouts": current,
                "observations": {k: dataclasses.asdict(v) for k, v in sorted(self.observations.items())},
                "config": self.config, "updated": self.updated}


def _seconds(value, where: str) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise StateFormatError(f"{where} is not a positive number of seconds: {value!r}")
    return float(value)


def parse(data) -> FtState:
    if not isinstance(data, dict):
        raise StateFormatError("not a JSON object")
    version = data.get("format_version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise StateFormatError(f"format_version {version!r}, this ft_launcher reads {FORMAT_VERSION}")
    current = data.get("current_timeouts")
    if not isinstance(current, dict):
        raise StateFormatError("no current_timeouts object")
    state = FtState()
    section = current.get("section", {})
    if isinstance(section, dict) and isinstance(section.get("section"), dict):  # NVRx SectionTimeouts
        if "out_of_section" in section:
            state.timeouts[OUT_OF_SECTION] = _seconds(section["out_of_section"], "out_of_section")
        section = section["section"]
    if not isinstance(section, dict):
        raise StateFormatError("current_timeouts.section is not an object")
    for name, value in section.items():
        state.timeouts[section_key(str(name))] = _seconds(value, f"section {name}")
    if "out_of_section" in current:
        state.timeouts[OUT_OF_SECTION] = _seconds(current["out_of_section"], "out_of_section")
    heartbeat = current.get("heartbeat")
    if heartbeat is not None:
        if not isinstance(heartbeat, dict):
            raise StateFormatError("current_timeouts.heartbeat is not an object")
        for field, key in (("initial", HB_INITIAL), ("subsequent", HB_SUBSEQUENT)):
            if field in heartbeat:
                state.timeouts[key] = _seconds(heartbeat[field], f"heartbeat {field}")
    for key, obs in (data.get("observations") or {}).items():
        try:
            state.observations[key] = Observation(int(obs["count"]), float(obs["max"]), float(obs.get("when", 0)))
        except (TypeError, KeyError, ValueError):
            raise StateFormatError(f"observation {key!r} is malformed") from None
    state.config = data.get("config") or {}
    state.updated = float(data.get("updated") or 0)
    return state


def load(path: str, warn: Callable[[str], None]) -> Optional[FtState]:
    """The state in `path`, or None (missing, or set aside as unreadable with one warning)."""
    try:
        with FileLock(path + ".lock", timeout=30):
            try:
                with open(path) as fh:
                    text = fh.read()
            except FileNotFoundError:
                return None
            try:
                return parse(json.loads(text))
            except (ValueError, StateFormatError) as exc:
                aside = _aside_name(path)
                os.rename(path, aside)
                warn(f"{path} is unreadable ({str(exc).splitlines()[0]}): kept aside as {aside}; "
                     f"running on the configured timeouts")
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
    with FileLock(path + ".lock", timeout=30):
        fd, tmp = tempfile.mkstemp(prefix=".ft_state.", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
