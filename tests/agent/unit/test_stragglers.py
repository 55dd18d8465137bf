"""Stragglers (agent/observation/stragglers.py): each rank's mean time in a section over a window,
from the counters its monitor keeps, compared with the median of the other ranks.

- The arithmetic: a window's mean from two (count, total) snapshots; which ranks are slower than
  threshold x the median of the others.
- The watch, on real parts: two real monitors over two real ranks (tests/scripts/monitored_rank.py,
  one stepping ten times slower), the round's keys on a store this process hosts, a real event
  log; the windows are told by the caller's clock. The slow rank is reported once, after
  straggler_windows windows in a row, with its node kept for exclusion; a new cycle starts over.
(A whole job naming its straggler: tests/agent/jobs/test_operations.py.)
"""
import json
import os

from conftest import SCRIPTS, read_events, wait_for
from harness import monitored_ranks, round_protocol
from ft_launcher.agent.observation.stragglers import StragglerWatch, mean_over_window, slow_ranks
from ft_launcher.agent.rounds.round_types import Round
from ft_launcher.rank_monitor.config import FaultToleranceConfig

RANK = os.path.join(SCRIPTS, "monitored_rank.py")


def test_a_windows_mean_comes_from_two_snapshots_of_one_incarnation():
    assert mean_over_window(None, (10, 2.0)) is None              # the first look
    assert mean_over_window((10, 2.0), (14, 3.0)) == 0.25
    assert mean_over_window((10, 2.0), (10, 2.0)) is None         # nothing completed in the window
    assert mean_over_window((10, 2.0), (3, 0.5)) is None          # a new incarnation counts from 0


def test_a_straggler_is_slower_than_threshold_times_the_median_of_the_others():
    assert slow_ranks({0: 1.0}, 1.5) == {}                        # nobody to compare with
    assert slow_ranks({0: 1.0, 1: 1.4, 2: 1.0}, 1.5) == {}
    assert slow_ranks({0: 1.0, 1: 2.0, 2: 1.0, 3: 1.2}, 1.5) == {1: (2.0 / 1.0, 1.0)}
    two = slow_ranks({0: 0.1, 1: 0.4}, 1.5)
    assert list(two) == [1] and two[1] == (4.0, 0.1)              # the median of one other is that rank
    assert slow_ranks({0: 0.0, 1: 0.5}, 1.5) == {}                # a zero median compares nothing


def test_the_slow_rank_is_reported_once_after_its_windows_and_its_node_kept_for_exclusion(launcher, tmp_path, events):
    ft = FaultToleranceConfig(straggler_window=10.0, straggler_threshold=2.0, straggler_windows=2,
                              straggler_exclude=True)
    proto = round_protocol(ft)
    events.cycle = 0
    watch = StragglerWatch(ft, events)
    (tmp_path / "out").mkdir()
    ranks_steps = [[RANK, tmp_path / "out", "--steps", 10000, "--step-time", t] for t in (0.02, 0.2)]
    with monitored_ranks(launcher, tmp_path / "run", ranks_steps) as (monitors, ranks):
        def counts():
            return [(m.section_stats().get("sections") or {}).get("step", {}).get("count", 0) for m in monitors]

        def window(rnd, now):
            """Both ranks complete two more steps, then the watch looks at `now`."""
            before = counts()
            wait_for(lambda: all(c >= b + 2 for c, b in zip(counts(), before)), 30, "two more steps of each rank")
            watch.tick(proto, rnd, ranks, monitors, now=now)

        def straggler_events():
            return read_events(str(tmp_path), "straggler")

        rnd = Round(0, proto.me, [proto.me], [])
        wait_for(lambda: all(counts()), 30, "both ranks stepping")
        watch.tick(proto, rnd, ranks, monitors, now=0.0)           # the first look: snapshots
        assert json.loads(proto.get("r0/strag/0"))["means"] == {}
        first = proto.get("r0/strag/0")
        window(rnd, 5.0)                                            # inside the window: nothing
        assert proto.get("r0/strag/0") == first
        window(rnd, 10.0)
        means = json.loads(proto.get("r0/strag/0"))["means"]
        assert 0.15 < means["1"] < 1.0 and means["0"] < means["1"] / 2, means
        assert not straggler_events() and not proto.exists("slow/node-a")   # one window of two
        window(rnd, 20.0)
        told = straggler_events()
        assert [e["rank"] for e in told] == [1], told
        detail = told[0]["detail"]
        assert detail["ratio"] > 2 and detail["windows"] == 2 and detail["section"] == "step", detail
        assert proto.get("slow/node-a").startswith("rank 1 on node 0 (127.0.0.1) is "), proto.get("slow/node-a")
        window(rnd, 30.0)
        assert len(straggler_events()) == 1                         # once per cycle
        next_cycle, events.cycle = Round(1, proto.me, [proto.me], []), 1
        window(next_cycle, 31.0)                                    # a new cycle starts over: snapshots
        assert json.loads(proto.get("r1/strag/0"))["means"] == {}
        window(next_cycle, 41.0)
        window(next_cycle, 51.0)
        assert [(e["rank"], e["cycle"]) for e in straggler_events()] == [(1, 0), (1, 1)]


def test_without_a_window_the_watch_does_nothing(events):
    ft = FaultToleranceConfig(straggler_window=0)
    proto = round_protocol(ft)
    watch = StragglerWatch(ft, events)
    assert not watch.enabled
    watch.tick(proto, Round(0, proto.me, [proto.me], []), [], [], now=0.0)
    assert not proto.exists("r0/strag/0")
