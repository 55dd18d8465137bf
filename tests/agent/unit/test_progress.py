"""Progress (agent/recovery/progress.py): did a cycle make progress? The restart policy counts the
cycles without it (max_no_progress_cycles). Real parts: the round's keys on a store this process
hosts, the `step` counts that real monitors keep for real ranks (tests/scripts/monitored_rank.py),
checkpoint iteration files on disk.

- Steps: a node reports `r<N>/progress` the first time one of its ranks has completed
  min_progress_iterations steps in cycle N, once.
- The checkpoint iteration file (NVRx's rule): read when the cycle starts (none yet: 0) and when it
  failed; the cycle made progress when it rose by min_progress_iterations; unreadable at the end,
  0 at both ends, or a cycle this node did not see begin: unknown (left out of the count).
- The history the policy reads: this cycle back to the last one with progress.
"""
import os

from conftest import SCRIPTS, wait_for
from harness import monitored_ranks, round_protocol
from ft_launcher.agent.recovery.progress import ProgressTracker, completed_steps, read_iteration

RANK = os.path.join(SCRIPTS, "monitored_rank.py")


def test_the_iteration_is_a_number_in_the_file_or_none(tmp_path):
    path = tmp_path / "latest_checkpointed_iteration.txt"
    assert read_iteration(str(path)) is None            # no file yet
    for text, value in (("", None), ("  \n", None), ("120\n", 120), ("release", None), ("7 8", None)):
        path.write_text(text)
        assert read_iteration(str(path)) == value, text


def test_a_node_reports_progress_once_a_rank_completed_enough_steps(launcher, tmp_path):
    proto = round_protocol()
    (tmp_path / "out").mkdir()
    steps = [RANK, tmp_path / "out", "--steps", 10000, "--step-time", 0.02]
    with monitored_ranks(launcher, tmp_path / "run", [steps, steps]) as (monitors, _):
        wait_for(lambda: completed_steps(monitors) >= 12, 30, "the ranks to complete 12 steps")
        counts = [m.section_stats()["sections"]["step"]["count"] for m in monitors]
        assert all(c >= 1 for c in counts) and completed_steps(monitors) >= sum(counts), counts
        ProgressTracker(3, min_iterations=10**6).poll(proto, 0, monitors)
        assert not proto.exists("r0/progress")            # no rank has completed that many
        tracker = ProgressTracker(3, min_iterations=5)
        tracker.poll(proto, 0, monitors)
        assert proto.get("r0/progress") == "1"
        proto.put("r0/progress", "written once")
        tracker.poll(proto, 0, monitors)                  # said for this cycle: nothing more
        assert proto.get("r0/progress") == "written once"
        tracker.poll(proto, 1, monitors)                  # the next cycle's own key
        assert proto.get("r1/progress") == "1"
        tracker.judge(proto, 1)                           # the file's rule only: steps are judged by poll
        assert not proto.exists("r1/progress_unknown")


def test_the_iteration_file_counts_a_cycle_that_rose_by_enough(tmp_path):
    proto = round_protocol()
    path = tmp_path / "latest_checkpointed_iteration.txt"
    tracker = ProgressTracker(3, min_iterations=10, iteration_file=str(path))
    path.write_text("100")
    tracker.begin_cycle(0)
    path.write_text("105")                                # cycle 0 failed 5 iterations later: too few
    tracker.judge(proto, 0)
    assert not proto.exists("r0/progress") and not proto.exists("r0/progress_unknown") and tracker.last == 105
    tracker.poll(proto, 0, [])                            # steps do not count with the file
    assert not proto.exists("r0/progress")
    tracker.begin_cycle(1)
    path.write_text("120")
    tracker.judge(proto, 1)
    assert proto.get("r1/progress") == "120"
    os.remove(path)                                       # no checkpoint yet when cycle 2 starts: 0
    tracker.begin_cycle(2)
    path.write_text("130")
    tracker.judge(proto, 2)
    assert proto.get("r2/progress") == "130"
    tracker.begin_cycle(3)
    os.remove(path)                                       # unreadable when cycle 3 failed: unknown
    tracker.judge(proto, 3)
    assert proto.exists("r3/progress_unknown") and not proto.exists("r3/progress") and tracker.last is None
    path.write_text("0")                                  # no checkpoint at either end: unknown
    tracker.begin_cycle(4)
    tracker.judge(proto, 4)
    assert proto.exists("r4/progress_unknown")
    tracker.begin_cycle(5)
    path.write_text("900")
    tracker.judge(proto, 6)                               # a cycle this node did not see begin
    assert proto.exists("r6/progress_unknown") and not proto.exists("r6/progress")
    assert tracker.history(proto, 6) == ["unknown", "none", "unknown", "unknown", "progress"]
    assert tracker.history(proto, 0) == ["none"]


def test_the_history_goes_back_to_the_last_cycle_with_progress_and_steps_know_no_unknown(tmp_path):
    proto = round_protocol()
    steps = ProgressTracker(3)
    assert steps.history(proto, 2) == ["none", "none", "none"]
    proto.put("r0/progress", "1")
    proto.put("r2/progress_unknown", "1")                 # only the file's rule says unknown
    assert steps.history(proto, 3) == ["none", "none", "none", "progress"]
    proto.put("r3/progress", "1")
    assert steps.history(proto, 3) == ["progress"]


def test_without_a_limit_the_file_is_not_read(tmp_path):
    proto = round_protocol()
    path = tmp_path / "iteration.txt"
    path.write_text("5")
    tracker = ProgressTracker(0, iteration_file=str(path))
    tracker.begin_cycle(0)
    path.write_text("500")
    tracker.judge(proto, 0)
    assert not proto.exists("r0/progress") and not proto.exists("r0/progress_unknown") and tracker.last is None
