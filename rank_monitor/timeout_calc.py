"""Computed timeouts: from observed section / out-of-section / heartbeat times to new timeouts.

The rule, per timeout (documented in docs/hang-detection.md):
- evidence: only a timeout with at least `calc_min_observations` observations (closes of the
  section, heartbeat intervals, out-of-section spans; over all ranks and nodes) is computed;
- candidate = max(observed max x safety_factor, calc_timeout_floor): the floor keeps a
  degenerate sample (a 4 ms "time to first heartbeat") from becoming a 20 ms timeout;
- merge with the previously *computed* value: grow at once (candidate >= previous -> candidate),
  shrink gradually (candidate < previous -> halfway between), so one quiet run cannot make the
  next one fragile while a slower phase is covered immediately;
- a pinned timeout (given on the command line) or an explicit null is the user's choice and is
  never replaced.

Keys name timeouts uniformly: "section:<name>", "out_of_section", "heartbeat:initial",
"heartbeat:subsequent".
"""
from __future__ import annotations

import dataclasses
import time
from typing import Dict, Iterable, List, Optional, Tuple

from ft_launcher.rank_monitor.config import FaultToleranceConfig

OUT_OF_SECTION = "out_of_section"
HB_INITIAL = "heartbeat:initial"
HB_SUBSEQUENT = "heartbeat:subsequent"


def section_key(name: str) -> str:
    return f"section:{name}"


@dataclasses.dataclass
class Observation:
    count: int = 0
    max: float = 0.0          # seconds
    when: float = 0.0         # unix time of the latest contribution

    def combine(self, other: "Observation") -> "Observation":
        return Observation(self.count + other.count, max(self.max, other.max), max(self.when, other.when))


def combine_all(parts: Iterable[Dict[str, Observation]]) -> Dict[str, Observation]:
    """Job-wide view: counts add up, maxima take the maximum."""
    out: Dict[str, Observation] = {}
    for part in parts:
        for key, obs in part.items():
            out[key] = out[key].combine(obs) if key in out else obs
    return out


def apply(cfg: FaultToleranceConfig, timeouts: Dict[str, Optional[float]]) -> FaultToleranceConfig:
    """A copy of cfg with these timeouts set."""
    new = dataclasses.replace(cfg, rank_section_timeouts=dict(cfg.rank_section_timeouts))
    for key, value in timeouts.items():
        if key.startswith("section:"):
            new.rank_section_timeouts[key[len("section:"):]] = value
        elif key == OUT_OF_SECTION:
            new.rank_out_of_section_timeout = value
        elif key == HB_INITIAL:
            new.initial_rank_heartbeat_timeout = value
        elif key == HB_SUBSEQUENT:
            new.rank_heartbeat_timeout = value
    return new


@dataclasses.dataclass
class Change:
    key: str
    old: Optional[float]
    new: float
    observation: Observation

    def describe(self, factor: float, ranks: Optional[int] = None) -> str:
        name = self.key.split(":", 1)[-1] if self.key.startswith("section:") else self.key.replace(":", " ")
        old = "none" if self.old is None else f"{self.old:.1f} s"
        over = f" over {ranks} ranks" if ranks else ""
        return (f"{name} timeout {old} -> {self.new:.1f} s (max {self.observation.max:.2f} s{over}, "
                f"{self.observation.count} observations, factor {factor:g})")


def compute(observations: Dict[str, Observation], current: Dict[str, Optional[float]],
            previously_computed: Dict[str, float], cfg: FaultToleranceConfig,
            pinned: Iterable[str] = ()) -> Tuple[Dict[str, Optional[float]], List[Change]]:
    """Return (all timeouts after this computation, the changes made)."""
    pinned = set(pinned) | set(cfg.pinned_timeouts)
    result = dict(current)
    changes: List[Change] = []
    for key, obs in sorted(observations.items()):
        if key in pinned:
            continue
        if obs.count < cfg.calc_min_observations or obs.max <= 0:
            continue
        candidate = max(obs.max * cfg.safety_factor, cfg.calc_timeout_floor)
        previous = previously_computed.get(key)
        value = candidate if previous is None or candidate >= previous else (previous + candidate) / 2
        value = round(value, 3)
        if result.get(key) != value:
            changes.append(Change(key, result.get(key), value, obs))
            result[key] = value
    return result, changes


def now() -> float:
    return time.time()
