"""Computed timeouts across the job (agent/observation/timeout_learning.py): observations in,
timeouts out, ft_state.json on disk. Real monitors over a real rank (tests/scripts/monitored_rank.py),
the round's keys on a store this process hosts, files in the test's dir.

- One monitor's statistics under timeout_calc's keys.
- A failed cycle counts what its ranks had completed when the failure became known (`freeze`),
  nothing after; a finished cycle's observations are kept for the next.
- The writer (node 0) combines what the agents published, computes, logs each change, writes
  ft_state.json and publishes a version; another agent applies a new version once; the next job
  starts from the file, which a job that asked for neither computing nor the file never reads.
(Whole jobs learning their timeouts: tests/monitor/unit/test_computed_timeouts.py.)
"""
import json
import os

import pytest

from conftest import SCRIPTS, read_events, wait_for
from harness import monitored_ranks, round_protocol
from ft_launcher.agent.observation.timeout_learning import TimeoutLearner, observations_from_stats
from ft_launcher.rank_monitor import ft_state_file
from ft_launcher.rank_monitor.config import FaultToleranceConfig

RANK = [os.path.join(SCRIPTS, "monitored_rank.py")]
LEARN = dict(calc_ft_timeouts=True, calc_min_observations=3, safety_factor=2.0, calc_timeout_floor=1.5)


@pytest.fixture
def stepping(launcher, tmp_path):
    """The monitor of one rank stepping every 20 ms."""
    (tmp_path / "out").mkdir()
    with monitored_ranks(launcher, tmp_path / "run", [RANK + [tmp_path / "out", "--steps", 10000]]) as (monitors, _):
        yield monitors


def steps(monitors):
    return ((monitors[0].section_stats().get("sections") or {}).get("step") or {}).get("count", 0)


def test_a_monitors_statistics_under_the_uniform_keys(stepping):
    wait_for(lambda: steps(stepping) >= 3, 30, "three steps")
    obs = observations_from_stats(stepping[0].section_stats())
    assert {"section:setup", "section:step", "section:fwd", "out_of_section", "heartbeat:initial",
            "heartbeat:subsequent"} <= set(obs), obs
    assert obs["section:step"].count >= 3 and 0.01 < obs["section:step"].max < 5, obs["section:step"]
    assert obs["heartbeat:initial"].count == 1 and obs["section:setup"].count == 1
    assert observations_from_stats({}) == {}
    assert observations_from_stats({"sections": {"step": {"count": 0, "max": 2.0}}}) == {}   # nothing completed


def test_a_failed_cycle_counts_what_it_had_done_when_it_failed(stepping, events, tmp_path):
    learner = TimeoutLearner(FaultToleranceConfig(calc_ft_timeouts=True), str(tmp_path / "ft_state.json"), events)
    learner.begin_cycle(0)
    wait_for(lambda: steps(stepping) >= 3, 30, "three steps")
    learner.freeze(stepping, cycle=1)                  # another cycle's failure: not this one's
    seen = learner.local_observations(stepping)["section:step"].count
    wait_for(lambda: learner.local_observations(stepping)["section:step"].count > seen, 30, "more steps counted")
    learner.freeze(stepping)                           # this cycle failed
    at_failure = learner.local_observations(stepping)["section:step"].count
    wait_for(lambda: steps(stepping) >= at_failure + 3, 30, "steps after the failure")
    learner.freeze(stepping)                           # later calls change nothing
    assert learner.local_observations(stepping)["section:step"].count == at_failure
    learner.end_of_cycle(stepping)                     # kept for the next cycle
    assert learner.past["section:step"].count == at_failure
    learner.begin_cycle(1)
    assert learner.local_observations(stepping)["section:step"].count > at_failure   # the past + the record now


def test_the_writer_computes_and_keeps_the_timeouts_and_the_agents_apply_them(stepping, events, tmp_path):
    ft = FaultToleranceConfig(rank_section_timeouts={"step": 60.0}, **LEARN)
    path = str(tmp_path / "ft_state.json")
    proto = round_protocol(ft)
    writer, other = TimeoutLearner(ft, path, events), TimeoutLearner(ft, path, events)
    writer.begin_cycle(0)
    assert other.poll(proto) is None                   # nothing published yet
    wait_for(lambda: steps(stepping) >= 5, 30, "five steps")
    writer.publish(proto, stepping)
    assert json.loads(proto.get("obs/node-a"))["section:step"][0] >= 5
    writer.compute_as_writer(proto, ["node-a", "node-b"], ranks=1)   # node-b published nothing
    timeouts = json.loads(proto.get("timeouts"))
    assert proto.count("timeouts_version") == 1
    assert timeouts["section:step"] == 1.5 and timeouts["section:fwd"] == 1.5, timeouts   # the floor: steps are short
    assert "section:setup" not in timeouts or timeouts["section:setup"] is None   # one observation: too few
    computed = {e["detail"]["key"]: e["detail"] for e in read_events(str(tmp_path), "timeout_computed")}
    assert computed["section:step"]["old"] == 60.0 and computed["section:step"]["new"] == 1.5, computed
    assert writer.ft.rank_section_timeouts["step"] == 1.5
    applied = other.poll(proto)
    assert applied.rank_section_timeouts["step"] == 1.5 and other.poll(proto) is None   # once per version
    writer.compute_as_writer(proto, ["node-a"], ranks=1)   # nothing changed: no new version
    assert proto.count("timeouts_version") == 1
    state = ft_state_file.load(path, warn=pytest.fail)
    assert state.timeouts["section:step"] == 1.5 and state.observations["section:step"].count >= 5
    # the next job starts from the file; one that asked for neither computing nor the file does not
    loaded = TimeoutLearner(ft, path, events).load()
    assert loaded.rank_section_timeouts["step"] == 1.5
    assert [e["detail"]["timeouts"]["section:step"] for e in read_events(str(tmp_path), "timeouts_loaded")] == [1.5]
    plain = FaultToleranceConfig(rank_section_timeouts={"step": 60.0})
    assert TimeoutLearner(plain, path, events).load().rank_section_timeouts["step"] == 60.0
