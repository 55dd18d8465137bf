"""What a failure is (agent/recovery/failure_cause.py): one function per way a node learns of a
failure, each returning the typed Failure whose report the round's verdict is decided from and
whose `what` is the operator's line.

- A rank ended: its monitor's hang report (the last one; the place in words), else its monitor's
  death, else its exit status; with hang blame, the culprit's line names who waited on it (a real
  HangBlame deciding on a store this process hosts, with two real monitors to tell).
- A rank raised under ft.restartable; peer nodes stopped answering; a rank's workload control
  request (ShutdownWorkload stops, ExcludeThisNode leaves, Continue and unknown actions do nothing).
(How the supervisor gets there in a real job: tests/agent/jobs/test_failure_walk.py.)
"""
import signal

import pytest

from harness import monitored_ranks, round_protocol
from ft_launcher.agent.ranks.workers import Rank
from ft_launcher.agent.recovery.failure_cause import (CAUSES, dump_words, hang_place, peers_lost, rank_ended,
                                                      rank_raised, rank_request, request_words)
from ft_launcher.agent.recovery.hang_blame import HangBlame
from ft_launcher.agent.rounds.round_types import NodeInfo
from ft_launcher.rank_monitor.workload_requests import WorkloadAction

NODE = "node-a"


def rank(global_rank=3, local_rank=1):
    return Rank(local_rank=local_rank, rank=global_rank, proc=None, pidfd=-1, start_ns=0, output=None)


@pytest.fixture
def no_blame(events):
    """Hang blame with no cycle under way (off, or nothing decided): it adds nothing."""
    return HangBlame(events)


def test_a_hang_report_says_where_the_rank_hung_and_for_how_long(no_blame):
    first = {"kind": "hang", "section": "setup", "elapsed": 1.0, "timeout": 1}
    last = {"kind": "hang", "section": "step", "elapsed": 3.456, "timeout": 3}
    failure = rank_ended(rank(), -signal.SIGKILL, NODE, [first, {"kind": "stack_dump"}, last], no_blame)
    assert failure.cause == "rank_ended" and failure.cause in CAUSES
    assert failure.report == {"kind": "failure", "rank": 3, "exitcode": -9, "hang": last,
                              "what": "rank 3 on node-a hung in section 'step' for 3.46s (timeout 3s) and was "
                                      "stopped by its monitor"}


def test_the_place_of_a_hang_outside_a_section_is_its_timeout_and_the_innermost_open_section():
    assert hang_place({"section": "checkpointing", "reason": "section"}) == "section 'checkpointing'"
    assert hang_place({"reason": "heartbeat", "open_sections": ["setup", "fwd"]}) == "heartbeat (in section 'fwd')"
    assert hang_place({"reason": "out_of_section", "open_sections": []}) == "out of section"
    assert hang_place({}) == "?"


def test_the_hang_line_names_the_stack_dump_or_why_there_is_none():
    assert dump_words({"stack_file": "/logs/stack_local1_77.txt"}) == "stack dump: /logs/stack_local1_77.txt"
    assert dump_words({"stack_file": None}).startswith("no stack dump (the rank never used ft_launcher's client")


def test_a_dead_monitor_stops_its_rank_and_is_the_cause_over_the_exit_status(no_blame):
    died = {"kind": "monitor_died", "local_rank": 1, "pid": 4242, "exit_status": -9}
    report = rank_ended(rank(), -signal.SIGKILL, NODE, [died], no_blame).report
    assert report["monitor_died"] == died and report["exitcode"] == -9
    assert report["what"] == ("rank 3 on node-a was stopped because its monitor (pid 4242) died: it restarts under "
                              "the new monitor")


@pytest.mark.parametrize("code, words", [
    (1, "exited with code 1"), (0, "exited with code 0"), (-signal.SIGKILL, "was killed by SIGKILL"),
    (-signal.SIGSEGV, "was killed by SIGSEGV"), (-200, "was killed by signal 200"),
])
def test_without_a_report_the_exit_status_is_the_cause(no_blame, code, words):
    report = rank_ended(rank(), code, NODE, [], no_blame).report
    assert report == {"kind": "failure", "what": f"rank 3 on node-a {words}", "rank": 3, "exitcode": code}


def test_the_culprits_line_names_the_ranks_that_waited_on_it(launcher, tmp_path, events):
    """Both ranks' monitors fired; rank 0's stack waits inside torch.distributed, rank 1's runs the
    training code: the verdict (stack evidence) names rank 1 the culprit, and its line says so."""
    proto = round_protocol()
    blame = HangBlame(events)
    stacks = {0: WAITS, 1: RUNS}
    sleep = ["-c", "import time; time.sleep(120)"]
    with monitored_ranks(launcher, tmp_path / "run", [sleep, sleep]) as (monitors, ranks):
        blame.start_cycle(proto.store, 0, 2, NODE, False, lambda: True, lambda: [0, 1])
        hangs = [{"kind": "hang", "cycle": 0, "rank": r.rank, "pid": r.pid, "section": "step", "elapsed": 3.5,
                  "timeout": 3} for r in ranks]
        for r in ranks:
            blame.on_hang(r.local_rank, hangs[r.rank])
            blame.on_stack({"cycle": 0, "rank": r.rank, "complete": True, "stack": stacks[r.rank]})
        blame.tick(monitors, ranks, final=True)
        assert (blame.verdict["evidence"], blame.verdict["culprits"], blame.verdict["victims"]) == ("stacks", [1], [0])
        assert blame.released() == {0} and not blame.blamed(1)   # rank 1's own monitor stops it
        culprit = rank_ended(ranks[1], -signal.SIGKILL, NODE, [hangs[1]], blame).report
    assert culprit["what"] == ("rank 1 on node-a hung in section 'step' for 3.50s (timeout 3s) and was stopped by "
                               "its monitor; rank 0 was waiting on it (stack dumps: the waiting ranks are inside a "
                               "collective, the hung are not)")
    blame.end_cycle()
    assert rank_ended(ranks[1], -9, NODE, [hangs[1]], blame).report["what"].endswith("stopped by its monitor")


WAITS = """Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 327 in wait

Current thread 0x00007f0000000002 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2501 in all_reduce
  File "/job/train.py", line 88 in step
"""
RUNS = """Current thread 0x00007f0000000003 (most recent call first):
  File "/job/train.py", line 61 in load_batch
  File "/job/train.py", line 87 in step
"""


def test_a_rank_that_raised_under_restartable():
    failure = rank_raised(rank(), NODE, "RuntimeError: simulated exception in step")
    assert failure.cause == "rank_raised"
    assert failure.report == {"kind": "failure", "what": "rank 3 on node-a raised RuntimeError: simulated exception "
                              "in step", "rank": 3, "exception": "RuntimeError: simulated exception in step"}


def test_peers_that_stopped_answering_are_named_by_their_host_and_order():
    dead = [NodeInfo("node-b", "10.0.0.2", 1, 2), NodeInfo("node-c", "10.0.0.3", None, 2)]
    failure = peers_lost(dead)
    assert failure.cause == "peers_lost"
    assert failure.report["what"] == "node 10.0.0.2 order=1, node 10.0.0.3 stopped answering"
    assert [n["node_id"] for n in failure.report["dead_nodes"]] == ["node-b", "node-c"]
    assert "rank" not in failure.report                       # no rank to blame


def test_a_ranks_request_stops_the_job_or_leaves_its_node_and_continue_does_nothing():
    stop = rank_request(3, NODE, "id-a", {"action": WorkloadAction.ShutdownWorkload.value, "description": "loss NaN"})
    assert stop.cause == "rank_request"
    assert stop.report == {"kind": "stop", "what": "rank 3 on node-a sent ShutdownWorkload (loss NaN): stopping "
                           "the job", "rank": 3, "action": "ShutdownWorkload", "description": "loss NaN"}
    leave = rank_request(3, NODE, "id-a", {"action": WorkloadAction.ExcludeThisNode.value, "description": ""})
    assert leave.report["kind"] == "failure" and leave.report["leaving"] == "id-a"
    assert leave.report["what"] == "rank 3 on node-a sent ExcludeThisNode (no description): excluding its node"
    assert rank_request(3, NODE, "id-a", {"action": WorkloadAction.Continue.value, "description": "fine"}) is None
    assert rank_request(3, NODE, "id-a", {"action": 7, "description": "from a newer NVRx"}) is None
    assert request_words(3, NODE, {"action": 7, "description": ""}) == ("?", "rank 3 on node-a sent ? (no description)")
