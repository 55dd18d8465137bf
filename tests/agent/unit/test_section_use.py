"""Section timeouts that protect nothing (agent/observation/section_use.py): with section timeouts
configured and no rank of the node inside any section NO_SECTION_AFTER s after its ranks started,
one line says so and what still finds a hang outside sections; said once, never before the
deadline, never when a rank entered a section or when no section timeout is set.

Real monitors over real ranks: one that never enters a section (a plain sleep), one that does
(tests/scripts/monitored_rank.py); a real event log. NO_SECTION_AFTER is shortened to keep the
test short.
"""
import os
import time

import pytest

from conftest import SCRIPTS, read_events, wait_for
from harness import monitored_ranks
from ft_launcher.agent.observation import section_use
from ft_launcher.agent.observation.section_use import SectionUse, entered_a_section
from ft_launcher.rank_monitor.config import FaultToleranceConfig

AFTER = 0.3


@pytest.fixture
def ranks(launcher, tmp_path, monkeypatch):
    """Monitors of two running ranks: [the one that never enters a section, the one that does]."""
    monkeypatch.setattr(section_use, "NO_SECTION_AFTER", AFTER)
    (tmp_path / "out").mkdir()
    commands = [["-c", "import time; time.sleep(120)"],
                [os.path.join(SCRIPTS, "monitored_rank.py"), tmp_path / "out", "--steps", 10000]]
    with monitored_ranks(launcher, tmp_path / "run", commands) as (monitors, _):
        wait_for(lambda: entered_a_section(monitors[1]), 30, "the monitored rank inside a section")
        yield monitors


def said(tmp_path):
    return [e["detail"] for e in read_events(str(tmp_path), "no_section_entered")]


@pytest.mark.parametrize("timeouts, rest", [
    ({"rank_out_of_section_timeout": 30.0}, "outside them the out-of-section timeout (30 s) applies"),
    ({"rank_heartbeat_timeout": 60.0}, "outside them only the heartbeat timeouts find a hang"),
    ({"initial_rank_heartbeat_timeout": 90.0}, "outside them only the heartbeat timeouts find a hang"),
    ({}, "nothing finds a hang outside them (no out-of-section or heartbeat timeout is set)"),
])
def test_no_rank_in_a_section_after_the_deadline_is_said_once_with_what_still_protects(ranks, events, console,
                                                                                       tmp_path, timeouts, rest):
    ft = FaultToleranceConfig(rank_section_timeouts={"step": 5.0, "setup": 20.0, "fwd": None}, **timeouts)
    use = SectionUse(events)
    use.poll(ranks[:1], ft)                   # before a cycle started: no deadline, nothing to check
    use.cycle_start()
    use.poll(ranks[:1], ft)
    assert not said(tmp_path) and not use.settled   # before the deadline
    wait_for(lambda: use.poll(ranks[:1], ft) or use.settled, 5, "the deadline")
    assert said(tmp_path) == [{"after": AFTER, "sections": ["setup", "step"]}]
    lines = console.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ft_launcher: warning: no rank on this node has entered a section "
                                                   f"{AFTER:g} s after its start: the section timeouts (setup 20 s, "
                                                   "step 5 s) apply only inside ft_launcher.section(...) blocks; "), lines
    assert rest in lines[0], lines
    use.poll(ranks[:1], ft)
    use.cycle_start()                         # settled: a later cycle is not checked again
    use.poll(ranks[:1], ft)
    assert len(said(tmp_path)) == 1


def test_a_rank_inside_a_section_settles_it_without_a_word(ranks, events, console, tmp_path):
    ft = FaultToleranceConfig(rank_section_timeouts={"step": 5.0})
    assert not entered_a_section(ranks[0]) and entered_a_section(ranks[1])
    use = SectionUse(events)
    use.cycle_start()
    use.poll(ranks, ft)                       # one rank of the node is enough
    assert use.settled and not said(tmp_path) and not console.getvalue()


def test_without_section_timeouts_nothing_is_said_and_a_later_one_is_still_checked(ranks, events, tmp_path):
    use = SectionUse(events)
    use.cycle_start()
    wait_for(lambda: time.monotonic() > use.deadline, 5, "the deadline")
    use.poll(ranks[:1], FaultToleranceConfig())
    assert not use.settled and not said(tmp_path)
    use.poll(ranks[:1], FaultToleranceConfig(rank_section_timeouts={"step": 5.0}))   # learned or loaded later
    assert use.settled and len(said(tmp_path)) == 1
