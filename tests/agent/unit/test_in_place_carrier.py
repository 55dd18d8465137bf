"""The in-place carrier (agent/ranks/in_place_carrier.py): this node's ranks that restart in their
own process, carried from the cycle that failed into the next one.

Real monitors over real ranks (tests/scripts/restartable_rank.py under ft.restartable, plain
sleeps for ranks that are not restartable), the round's keys on a store this process hosts:
- `news` declares the node restartable once every rank runs under ft.restartable, and returns the
  rank whose function raised with its exception's line;
- `ask` applies the verdict: it asks the ranks the verdict keeps in place (Verdict.stays: not one
  stopped as hung); a verdict that is not in place, or a node that does not train, asks nobody;
- `adopt` returns the carried ranks that reached their restart point for the next cycle; one that
  exited, or did not get there within inprocess_timeout, is killed, and an `inprocess_timeout`
  event says so; a signal ends the wait at once;
- `drop` kills carried ranks that will not restart, with a line each.
(The whole path in a real job: tests/agent/jobs/test_inprocess_restart.py, tests/agent/jobs/test_failure_walk.py.)
"""
import os
import signal
import time

import pytest

from conftest import SCRIPTS, read_events, wait_for
from harness import monitored_ranks, round_protocol
from ft_launcher.agent.launch_config import LaunchConfig
from ft_launcher.agent.ranks import inprocess_ranks
from ft_launcher.agent.ranks.in_place_carrier import InPlaceCarrier
from ft_launcher.agent.ranks.monitor_set import MonitorSet
from ft_launcher.agent.ranks.workers import WorkerGroup
from ft_launcher.agent.recovery.restart_policy import PolicyInputs, RestartPolicy, RoundFacts
from ft_launcher.agent.rounds.round_types import NodeInfo, Round, Stopped
from ft_launcher.rank_monitor import shm_layout as L
from ft_launcher.rank_monitor.config import FaultToleranceConfig
from ft_launcher.rank_monitor.rank_side.inprocess import ENV_GRANULARITY

TIMEOUT = 0.5   # inprocess_timeout
RESTARTABLE = [os.path.join(SCRIPTS, "restartable_rank.py"), 1]   # rank 1 raises in cycle 0
SLEEP = ["-c", "import time; time.sleep(120)"]
IN_PLACE_ENV = {ENV_GRANULARITY: "auto"}   # what the agent gives its ranks (agent.ranks.workers)
NODE = NodeInfo("node-a", "127.0.0.1", None, 2)


@pytest.fixture
def carrier(events):
    cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, entrypoint=["x"],
                       ft=FaultToleranceConfig(inprocess_timeout=TIMEOUT))
    return InPlaceCarrier(cfg, events)


def verdict(inputs):
    """The policy's verdict on rank 1 of this one-node job failing in round 0."""
    facts = RoundFacts(0, [NODE.node_id], [], {NODE.node_id: 2})
    return RestartPolicy(5).decide({"kind": "failure", "what": "rank 1 died", "rank": 1, "node_id": NODE.node_id},
                                   facts, inputs)


def parts(carrier, ranks=(), monitors=()):
    """This node's cycle as the agent holds it: its ranks (WorkerGroup) and monitors (MonitorSet)."""
    group = WorkerGroup(carrier.cfg, None, None, 0)
    group.ranks.extend(ranks)
    monitor_set = MonitorSet(carrier.cfg, "", None, carrier.events)
    monitor_set.handles[:] = monitors
    return group, monitor_set


def test_news_declares_the_node_restartable_and_names_the_rank_that_raised(launcher, tmp_path, carrier):
    carrier.proto = round_protocol()
    with monitored_ranks(launcher, tmp_path / "run", [RESTARTABLE, RESTARTABLE], env=IN_PLACE_ENV) as (monitors,
                                                                                                      ranks):
        carrier.begin_cycle()
        news = wait_for(lambda: carrier.news(0, monitors, ranks), 30, "rank 1's exception")
        assert news[0] is ranks[1], news
        assert news[1].startswith("RuntimeError: simulated exception in step 3 at restartable_rank.py:"), news
        assert carrier.declared and carrier.proto.count("r0/restartable") == 1
        carrier.news(0, monitors, ranks)
        assert carrier.proto.count("r0/restartable") == 1            # once per cycle
        carrier.begin_cycle()
        carrier.news(1, monitors, ranks)
        assert carrier.proto.count("r1/restartable") == 1


def test_a_node_whose_ranks_are_not_all_restartable_is_not_declared(launcher, tmp_path, carrier):
    carrier.proto = round_protocol()
    with monitored_ranks(launcher, tmp_path / "run", [RESTARTABLE, SLEEP], env=IN_PLACE_ENV) as (monitors, ranks):
        carrier.begin_cycle()
        wait_for(lambda: inprocess_ranks.state(monitors[0]), 30, "rank 0 inside its restartable function")
        assert carrier.news(0, monitors, ranks) is None
        assert not carrier.declared and carrier.proto.count("r0/restartable") == 0


def test_a_verdict_that_does_not_restart_in_place_asks_nobody(carrier):
    group, monitor_set = parts(carrier)
    this_round = Round(0, NODE, [NODE], [])
    full = verdict(PolicyInputs())                                       # nobody declared: a full restart
    assert full.rung == "job" and carrier.ask(this_round, full, NODE.node_id, group, monitor_set, set()) == {}
    assert carrier.ask(this_round, None, NODE.node_id, group, monitor_set, set()) == {}
    in_place = verdict(PolicyInputs(restartable=1))
    assert in_place.in_process
    spare = Round(0, NODE, [NodeInfo("node-b", "127.0.0.2", None, 2)], [NODE])   # this node waits as a spare
    assert carrier.ask(spare, in_place, NODE.node_id, group, monitor_set, set()) == {}


def test_the_ranks_the_verdict_keeps_are_asked_and_adopted_at_their_restart_point(launcher, tmp_path, carrier):
    """Rank 1 raised, rank 0 was stopped as hung (the blame's answer): the verdict keeps both ranks
    in place, the carrier asks rank 1 only; it reaches its restart point for round 1 and is adopted."""
    with monitored_ranks(launcher, tmp_path / "run", [RESTARTABLE, RESTARTABLE], env=IN_PLACE_ENV) as (monitors,
                                                                                                      ranks):
        wait_for(lambda: inprocess_ranks.raised(monitors, ranks), 30, "rank 1's exception")
        # rank 0 may still be importing when rank 1 has raised (a loaded machine): await its function
        wait_for(lambda: inprocess_ranks.state(monitors[0]) == L.IP_RUNNING, 30, "rank 0 inside its function")
        group, monitor_set = parts(carrier, ranks, monitors)
        in_place = verdict(PolicyInputs(restartable=1))
        asked = carrier.ask(Round(0, NODE, [NODE], []), in_place, NODE.node_id, group, monitor_set, {0})
        assert list(asked) == [1] and asked[1][:2] == (monitors[1], ranks[1])
        carrier.carry(asked)
        assert carrier.adopt(in_place.next_round, group, lambda: None) == {1: ranks[1]}
        assert inprocess_ranks.state(monitors[0]) == L.IP_RUNNING         # never asked: still in its function
        assert all(r.proc.poll() is None for r in ranks)
        assert carrier.adopt(2, group, lambda: None) == {}                # carried once
    assert not read_events(str(tmp_path), "inprocess_timeout")


def test_a_carried_rank_that_exited_or_is_late_is_killed_and_said(launcher, tmp_path, carrier):
    with monitored_ranks(launcher, tmp_path / "run", [["-c", "pass"], SLEEP]) as (monitors, ranks):
        ranks[0].proc.wait(30)
        asked = time.monotonic()
        carrier.carry({r.local_rank: (m, r, asked) for m, r in zip(monitors, ranks)})
        assert carrier.adopt(1, None, lambda: None) == {}
        took = time.monotonic() - asked
        assert ranks[1].proc.poll() == -signal.SIGKILL
    late = {e["rank"]: e["detail"] for e in read_events(str(tmp_path), "inprocess_timeout")}
    assert late[0]["exited"] and not late[1]["exited"], late
    assert TIMEOUT <= late[1]["waited"] <= took and took < TIMEOUT + 5, (late, took)


def test_a_signal_ends_the_wait_at_once(launcher, tmp_path, carrier):
    with monitored_ranks(launcher, tmp_path / "run", [SLEEP]) as (monitors, ranks):
        carrier.carry({0: (monitors[0], ranks[0], time.monotonic())})
        started = time.monotonic()
        with pytest.raises(Stopped) as stopped:
            carrier.adopt(1, None, lambda: signal.SIGTERM)
        assert stopped.value.signum == signal.SIGTERM and time.monotonic() - started < TIMEOUT
        assert carrier.adopt(1, None, lambda: None) == {}               # no longer carried
    assert not read_events(str(tmp_path), "inprocess_timeout")


def test_dropped_ranks_are_killed_with_a_line_each(launcher, tmp_path, carrier, console):
    with monitored_ranks(launcher, tmp_path / "run", [SLEEP, SLEEP]) as (monitors, ranks):
        carrier.carry({r.local_rank: (m, r, time.monotonic()) for m, r in zip(monitors, ranks)})
        carrier.drop("this node waits as a spare")
        assert [r.proc.poll() for r in ranks] == [-signal.SIGKILL, -signal.SIGKILL]
        lines = console.getvalue().splitlines()
        assert [f"rank {r.rank} (pid {r.pid}) will not restart in place: this node waits as a spare" in line
                for r, line in zip(ranks, lines)] == [True, True], lines
    with monitored_ranks(launcher, tmp_path / "run2", [SLEEP]) as (monitors, ranks):
        carrier.carry({0: (monitors[0], ranks[0], time.monotonic())})
        carrier.drop(None)                                              # on the way out: quietly
        assert ranks[0].proc.poll() == -signal.SIGKILL and len(console.getvalue().splitlines()) == 2
