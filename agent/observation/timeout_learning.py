"""Computed timeouts across the job: observations in, timeouts out, ft_state.json on disk.

Every agent publishes its ranks' observations (read from its monitors' shared memory) into the
store; the agent of node 0 is the one writer per job: it combines the job-wide view (counts add
up, maxima take the maximum), applies the rule of rank_monitor.timeout_calc, logs each change,
writes ft_state.json atomically and publishes the timeouts with a version number. Every agent
applies a new version to its monitors at once, so the running job is protected by the learned
values, and the next cycle and the next job start from the file.

What counts as an observation (docs/hang-detection.md's rule): a failed cycle contributes what its ranks had
completed when the failure became known, nothing after. A monitor that finds its rank hung
freezes that rank's statistics before it resumes or signals it (shm_layout.freeze_stats), so the
hung occurrence never counts, even where it closes after all (a SIGSTOPped rank resumed for its
stack dump, a SIGTERM handler that leaves the section). Each agent freezes its node's view of the
cycle (`freeze`) when it learns of a failure: its monitor's hang report, the job's flight-recorder
request (before any hung rank is resumed), a rank's death, another node's failure. So the peers
that waited for the hung or dead rank, and finish their section or interval only once it is
resumed or gone, add nothing. A new incarnation starts its intervals afresh, so no interval
spans a restart.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Dict, List, Optional

from ft_launcher.agent.rounds import store_keys
from ft_launcher.rank_monitor.config import FaultToleranceConfig
from ft_launcher.rank_monitor.timeout_calc import (HB_INITIAL, HB_SUBSEQUENT, OUT_OF_SECTION, Observation, apply, combine_all,
                                       compute, section_key)

from ft_launcher.agent.observation.events import EventLog

PUBLISH_EVERY = 2.0  # seconds between publications of observations while ranks run


def observations_from_stats(stats: dict) -> Dict[str, Observation]:
    """One monitor's section_stats() (rank_monitor.shm_layout.read_stats) under the uniform keys
    of timeout_calc."""
    out: Dict[str, Observation] = {}
    now = time.time()

    def take(key, entry):
        if isinstance(entry, dict) and entry.get("count"):
            out[key] = Observation(int(entry["count"]), float(entry.get("max", 0.0)), now)

    for name, entry in (stats.get("sections") or {}).items():
        take(section_key(name), entry)
    take(OUT_OF_SECTION, stats.get("out_of_section"))
    heartbeat = stats.get("heartbeat") or {}
    take(HB_INITIAL, heartbeat.get("initial"))
    take(HB_SUBSEQUENT, heartbeat.get("subsequent"))
    return out


class TimeoutLearner:
    def __init__(self, ft: FaultToleranceConfig, state_path: str, events: EventLog):
        self.ft = ft
        self.path = state_path
        self.events = events
        self.enabled = ft.calc_ft_timeouts
        self.previous: Dict[str, float] = {}         # computed values from the file (merge input)
        self.computed: Dict[str, float] = {}         # what the file holds: computed values only
        self.evidence: Dict[str, Observation] = {}   # the observations behind them
        self.past: Dict[str, Observation] = {}      # this node, cycles already over
        self.version_seen = 0
        self._next_publish = 0.0
        self.cycle: Optional[int] = None
        self._frozen: Optional[Dict[str, Observation]] = None   # this cycle's, as of its failure
        self._lock = threading.Lock()   # freeze may come from the flight-recorder thread

    # ---- start and restart ----------------------------------------------------------------
    def load(self) -> FaultToleranceConfig:
        """The configuration to start a cycle with: file values over configured ones (pins kept).
        The file is read only when timeouts are computed or its path was given: a stale
        ft_state.json in the working directory must not change a job that asked for neither."""
        if not (self.enabled or self.ft.ft_state_path):
            return self.ft
        from ft_launcher.rank_monitor import ft_state_file   # here: a job that learns no timeouts never loads it

        state = ft_state_file.load(self.path, warn=lambda m: self.events.event("ft_state_unreadable", f"warning: {m}"))
        if state is None:
            return self.ft
        # Only computed numbers are applied: a value the file marks as not calculated (NVRx and
        # Megatron write the configured ones beside the computed ones) or a null must not
        # replace or switch off a timeout this job's configuration sets.
        self.previous = {k: v for k, v in state.timeouts.items() if v is not None}
        self.computed = dict(self.previous)
        self.evidence = dict(state.observations)
        usable = {k: v for k, v in self.previous.items() if k not in self.ft.pinned_timeouts}
        if usable:
            shown = ", ".join(f"{k.split(':', 1)[-1]} {v:g} s" for k, v in sorted(usable.items()))
            self.events.event("timeouts_loaded", f"timeouts from {self.path}: {shown}", timeouts=usable)
        self.ft = apply(self.ft, usable)
        return self.ft

    # ---- during a cycle -------------------------------------------------------------------
    def due(self) -> bool:
        return self.enabled and time.monotonic() >= self._next_publish

    def begin_cycle(self, number: int) -> None:
        with self._lock:
            self.cycle, self._frozen = number, None

    def freeze(self, monitors: list, cycle: Optional[int] = None) -> None:
        """The cycle has failed (or another node's has): from now on its observations are those
        of this moment. Later calls change nothing; one about another cycle is ignored."""
        if not self.enabled:
            return
        with self._lock:
            if self._frozen is not None or (cycle is not None and cycle != self.cycle):
                return
            try:
                self._frozen = self._current(monitors)
            except ValueError:   # a record released under us (a monitor being replaced): none then
                self._frozen = {}

    @staticmethod
    def _current(monitors: list) -> Dict[str, Observation]:
        return combine_all(observations_from_stats(m.section_stats()) for m in monitors)

    def local_observations(self, monitors: list) -> Dict[str, Observation]:
        with self._lock:
            current = self._frozen if self._frozen is not None else self._current(monitors)
        return combine_all([self.past, current])

    def publish(self, proto, monitors: list) -> None:
        self._next_publish = time.monotonic() + PUBLISH_EVERY
        obs = self.local_observations(monitors)
        proto.put(store_keys.observations(proto.me.node_id),
                  json.dumps({k: [o.count, o.max, o.when] for k, o in obs.items()}))

    def end_of_cycle(self, monitors: list) -> None:
        """Fold this cycle's observations in before the monitors serve new incarnations."""
        if self.enabled:
            self.past = self.local_observations(monitors)
        with self._lock:
            self.cycle, self._frozen = None, None

    def compute_as_writer(self, proto, node_ids: List[str], ranks: int) -> None:
        raw = proto.get_many([store_keys.observations(n) for n in node_ids if proto.exists(store_keys.observations(n))])
        parts = [{k: Observation(*v) for k, v in json.loads(r).items()} for r in raw]
        observations = combine_all(parts)
        current = self.ft.timeout_keys()
        timeouts, changes = compute(observations, current, self.previous, self.ft)
        if not changes:
            return
        for change in changes:
            self.events.event("timeout_computed", change.describe(self.ft.safety_factor, ranks), key=change.key,
                              old=change.old, new=change.new, count=change.observation.count,
                              max=change.observation.max)
        self.ft = apply(self.ft, timeouts)
        for change in changes:
            self.computed[change.key] = change.new
            self.evidence[change.key] = change.observation
        from ft_launcher.rank_monitor import ft_state_file

        state = ft_state_file.FtState(
            dict(self.computed), dict(self.evidence),
            {"safety_factor": self.ft.safety_factor, "calc_min_observations": self.ft.calc_min_observations,
             "calc_timeout_floor": self.ft.calc_timeout_floor}, time.time(),
            others={k: v for k, v in self.ft.timeout_keys().items() if k not in self.computed})
        try:
            ft_state_file.save(self.path, state)
        except OSError as exc:  # the job's outcome never depends on this file
            self.events.event("ft_state_unwritable", f"warning: cannot write {self.path}: {exc}; the computed "
                              f"timeouts apply to this job but are not kept", path=self.path, error=str(exc))
        proto.put(store_keys.timeouts(), json.dumps(timeouts))
        proto.count(store_keys.timeouts_version(), 1)

    def poll(self, proto) -> Optional[FaultToleranceConfig]:
        """A newer job-wide set of timeouts, if the writer published one since we last looked."""
        version = proto.count(store_keys.timeouts_version())
        if version <= self.version_seen:
            return None
        self.version_seen = version
        timeouts = json.loads(proto.get(store_keys.timeouts()))
        self.ft = apply(self.ft, timeouts)
        return self.ft


def default_state_path(ft: FaultToleranceConfig, log_dir: Optional[str]) -> str:
    return ft.ft_state_path or os.path.join(log_dir or os.getcwd(), "ft_state.json")
