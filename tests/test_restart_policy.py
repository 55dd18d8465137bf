"""The restart decision (agent/recovery.restart_policy.py) on a real TCPStore: the round protocol's own
store calls, reporters racing in threads (each with its own store connection, as agents have).

What is decided: one verdict per round whoever reports; the rung (in place only when every
training node declared its ranks restartable and the granularity allows it); a rank that fails
again at once in the same slot is replaced; a node where failures keep beginning leaves when a
spare can take its place; a straggler leaves when a spare can take its place; a failure after
too many cycles without progress stops the job; the restart budget; the verdict's JSON round trip.
"""
import gc
import threading

import pytest

from ft_launcher.agent.launch_config import LaunchConfig
from ft_launcher.agent.recovery.no_restart import mark_excluded
from ft_launcher.agent.rounds.rendezvous import JobStore, RoundProtocol
from ft_launcher.agent.recovery.restart_policy import NODE_FAILURE_LIMIT, RoundFacts, Verdict
from ft_launcher.agent.rounds.round_types import NodeInfo
from ft_launcher.rank_monitor.config import FaultToleranceConfig

NODES = ["node-a", "node-b", "node-c"]
# One store for the module, each job under its own run id. A process that holds ~24 open client
# connections to one TCPStore has its next connection reset and retried 5 s later (torch 2.13):
# each test's connections are closed when it ends (the fixture below).
_HOST = {}
_JOBS = [0]
# ... and past ~24 connections made to it in one process, torch resets one and retries it 5 s later:
# past the agents' 4 s handshake limit (meant for a listener that is not a store), so wait longer here
JobStore.HANDSHAKE_LIMIT = 12.0


@pytest.fixture(autouse=True)
def _close_connections():
    yield
    gc.collect()   # a round protocol and its policy refer to each other: collected, not refcounted


class Job:
    """A run id on the module's store and one round protocol per simulated agent (its own connection)."""

    def __init__(self, max_restarts=5, granularity="auto", nodes=2, spares=0, **ft_keys):
        ft = FaultToleranceConfig(restart_granularity=granularity, **ft_keys)
        self.cfg = LaunchConfig(min_nodes=nodes, max_nodes=nodes + spares, nproc_per_node=2, entrypoint=["x"],
                                is_host=False, rdzv_host="127.0.0.1", max_restarts=max_restarts,
                                rdzv_id=f"policy{_JOBS[0]}", ft=ft)
        _JOBS[0] += 1
        if not _HOST:
            host_cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, entrypoint=["x"], standalone=True,
                                    rdzv_port=0)
            _HOST["store"] = JobStore(host_cfg, lambda line: None)
        self.cfg.rdzv_port = _HOST["store"].port
        self.nodes, self.spares = NODES[:nodes], NODES[nodes:nodes + spares]

    def proto(self, node_id="node-a"):
        return RoundProtocol(JobStore(self.cfg, lambda line: None), self.cfg, NodeInfo(node_id, "127.0.0.1", None, 2))

    def facts(self, number):
        return RoundFacts(number, list(self.nodes), list(self.spares), {n: 2 for n in self.nodes + self.spares})

    def fail(self, number, rank, proto=None):
        proto = proto or self.proto()
        return proto.interrupt(number, {"kind": "failure", "what": f"rank {rank} died", "rank": rank,
                                        "node_id": self.nodes[rank // 2]}, self.facts(number))


def test_racing_reporters_get_one_verdict_and_spend_one_restart():
    job = Job()
    protos = [job.proto(f"node-{i}") for i in range(8)]
    verdicts, barrier = [None] * 8, threading.Barrier(8)

    def report(i):
        barrier.wait()
        verdicts[i] = job.fail(0, i % 4, protos[i])

    threads = [threading.Thread(target=report, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(v is not None for v in verdicts)
    assert len({v.to_json() for v in verdicts}) == 1, "the agents disagree on the verdict"
    assert verdicts[0].restart and verdicts[0].restarts_used == 1 and verdicts[0].next_round == 1
    assert job.proto().restarts_used() == 1


def test_in_place_only_when_every_training_node_declared_its_ranks_restartable():
    job = Job()
    proto = job.proto()
    assert job.fail(0, 1, proto).rung == "job"              # nobody declared
    proto.policy.declare_restartable(1)                     # one node of two
    assert job.fail(1, 0, proto).rung == "job"
    proto.policy.declare_restartable(2)
    proto.policy.declare_restartable(2)
    verdict = job.fail(2, 1, proto)
    assert verdict.rung == "in_process" and verdict.in_process
    assert verdict.keeps(0, "node-a") and not verdict.replace_ranks and not verdict.replace_nodes


@pytest.mark.parametrize("granularity,rung,replaced_nodes", [
    ("auto", "in_process", []), ("rank", "in_process", []), ("node", "in_process", ["node-b"]), ("job", "job", []),
])
def test_granularity(granularity, rung, replaced_nodes):
    job = Job(granularity=granularity)
    proto = job.proto()
    proto.policy.declare_restartable(0)
    proto.policy.declare_restartable(0)
    verdict = job.fail(0, 3, proto)                          # rank 3: node-b's second rank
    assert verdict.rung == rung and verdict.replace_nodes == replaced_nodes
    if rung == "in_process":
        assert verdict.keeps(0, "node-a") and verdict.keeps(2, "node-b") == (granularity != "node")


def test_a_rank_that_fails_again_at_once_is_replaced_and_one_that_progressed_is_not():
    job = Job()
    proto = job.proto()
    for number in range(4):
        proto.policy.declare_restartable(number)
        proto.policy.declare_restartable(number)
    assert job.fail(0, 1, proto).replace_ranks == []
    again = job.fail(1, 1, proto)                             # no step completed in round 1
    assert again.replace_ranks == [1] and not again.keeps(1, "node-a") and again.keeps(0, "node-a")
    proto.put("r2/progress", "1")                             # round 2 made progress
    assert job.fail(2, 1, proto).replace_ranks == []
    assert job.fail(3, 0, proto).replace_ranks == []          # another rank


def test_a_node_where_failures_keep_beginning_leaves_when_a_spare_can_take_over():
    with_spare, without = Job(spares=1), Job()
    for job in (with_spare, without):
        proto = job.proto()
        verdicts = [job.fail(n, 2, proto) for n in range(NODE_FAILURE_LIMIT)]   # rank 2: node-b
        assert all(v.restart for v in verdicts)
        assert not any(v.exclude for v in verdicts[:-1])
        assert verdicts[-1].exclude == (["node-b"] if job is with_spare else [])
    progressed = Job(spares=1)
    proto = progressed.proto()
    progressed.fail(0, 2, proto)
    proto.put("r1/progress", "1")
    assert [progressed.fail(n, 2, proto).exclude for n in (1, 2)] == [[], []]


def test_a_straggler_is_left_out_when_a_spare_can_take_its_place():
    for spares, on, left_out in ((1, True, ["node-b"]), (0, True, []), (1, False, [])):
        job = Job(spares=spares, straggler_exclude=on)
        proto = job.proto()
        proto.put("slow/node-b", "node-b: 2.1x the median step time")
        verdict = job.fail(0, 0, proto)                      # the failure began elsewhere
        assert verdict.restart and verdict.exclude == left_out
        assert ("straggling node node-b is left out" in verdict.what) == bool(left_out), verdict.what


def test_a_node_that_asks_to_leave_is_excluded_or_the_job_stops_when_too_few_remain():
    """ExcludeThisNode: the policy, not the asking agent, decides the node leaves or the job stops."""
    for spares, stops in ((1, False), (0, True)):
        job = Job(spares=spares)
        proto = job.proto("node-b")
        mark_excluded(proto, "node-b")                      # what the asking agent records first
        verdict = proto.interrupt(0, {"kind": "failure", "what": "rank 2 sent ExcludeThisNode", "rank": 2,
                                      "node_id": "node-b", "leaving": "node-b"}, job.facts(0))
        assert "leaving" not in verdict.detail
        if stops:   # 2 nodes needed, at most 1 can remain: restarting is pointless, the budget untouched
            assert verdict.kind == "stop" and not verdict.restart and proto.restarts_used() == 0
            assert verdict.what == ("rank 2 sent ExcludeThisNode; 1 node excluded: at most 1 of the 2 needed "
                                    "can remain") and verdict.detail["failure"] == "rank 2 sent ExcludeThisNode"
        else:       # the spare takes its place
            assert verdict.kind == "failure" and verdict.restart and verdict.exclude == ["node-b"]


def test_a_failure_after_cycles_without_progress_is_a_stop_that_spends_no_budget():
    job = Job(max_no_progress_cycles=2)
    proto = job.proto()
    assert job.fail(0, 0, proto).restart                     # never made progress: not "no progress"
    proto.put("r1/progress", "1")
    assert job.fail(1, 0, proto).restart
    assert job.fail(2, 0, proto).restart                     # one cycle without progress
    verdict = job.fail(3, 1, proto)                          # two in a row
    assert verdict.kind == "stop" and not verdict.restart and verdict.what.startswith("no progress: 2 cycles")
    assert verdict.detail["failure"] == "rank 1 died" and proto.restarts_used() == 3


def test_the_budget_and_the_kinds_that_never_restart():
    job = Job(max_restarts=1)
    proto = job.proto()
    assert job.fail(0, 0, proto).restart
    spent = job.fail(1, 0, proto)
    assert not spent.restart and spent.restarts_used == 2
    for number, kind in ((2, "complete"), (3, "stop"), (4, "shutdown")):
        verdict = proto.interrupt(number, {"kind": kind, "what": kind, "signal": 15}, job.facts(number))
        assert verdict.kind == kind and not verdict.restart and verdict.next_round == number + 1
    assert proto.restarts_used() == 2


def test_verdict_json_round_trip_keeps_the_report():
    report = {"kind": "failure", "what": "rank 3 hung", "rank": 3, "node_id": "node-b", "exitcode": -9,
              "hang": {"section": "step"}, "exclude": ["node-c"]}
    verdict = Verdict.from_report(report)
    verdict.restart, verdict.rung, verdict.replace_ranks = True, "in_process", [3]
    again = Verdict.from_json(verdict.to_json())
    assert again == verdict
    assert again.detail == {"exitcode": -9, "hang": {"section": "step"}}
    fields = again.event_fields()
    assert fields["exitcode"] == -9 and fields["rung"] == "in_process" and fields["replace_ranks"] == [3]
