"""The round's end (agent/recovery/round_end.py, RoundEnd.interrupt on agent/rounds/rendezvous.py's protocol) on a
real TCPStore: reporters racing in threads (each with its own store connection, as agents have) get
one verdict; what the protocol reads for the policy (PolicyInputs: restartable nodes, origins and
progress of earlier rounds, stragglers, exclusions, the budget) and what it writes after (the
budget, the origin) carry a job's history from round to round. The rules themselves are
tests/agent/unit/test_restart_policy.py's, without a store.
"""
import json
import threading

import pytest

from ft_launcher.agent.launch_config import LaunchConfig
from ft_launcher.agent.recovery.no_restart import mark_excluded
from ft_launcher.agent.recovery.round_end import RoundEnd
from ft_launcher.agent.rounds.job_store import JobStore
from ft_launcher.agent.rounds.rendezvous import RoundProtocol
from ft_launcher.agent.recovery.restart_policy import NODE_FAILURE_LIMIT, RoundFacts
from ft_launcher.agent.rounds.round_types import NodeInfo
from ft_launcher.rank_monitor.config import FaultToleranceConfig

NODES = ["node-a", "node-b", "node-c"]
# One store for the module, each job under its own run id. A process that holds ~24 open client
# connections to one TCPStore has its next connection reset and retried 5 s later (torch 2.13):
# each test's connections are closed when it ends (the fixture below).
_HOST = {}
_JOBS = [0]


@pytest.fixture(autouse=True, scope="module")
def _patient_handshake():
    """Past ~24 connections made to one store from one process, torch resets one and retries it 5 s
    later: past the agents' 4 s handshake limit (meant for a listener that is not a store), so wait
    longer here, for this module's tests only."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(JobStore, "HANDSHAKE_LIMIT", 12.0)
        yield


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
        report = {"kind": "failure", "what": f"rank {rank} died", "rank": rank, "node_id": self.nodes[rank // 2]}
        return RoundEnd(proto, self.cfg).interrupt(number, report, self.facts(number))


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


def test_the_protocol_reads_which_nodes_declared_their_ranks_restartable():
    job = Job()
    proto = job.proto()
    assert job.fail(0, 1, proto).rung == "job"              # nobody declared
    proto.declare_restartable(1)                            # one node of two
    assert job.fail(1, 0, proto).rung == "job"
    assert not RoundEnd(proto, job.cfg).in_place_possible(1, job.facts(1))
    proto.declare_restartable(2)
    job.proto("node-b").declare_restartable(2)
    assert RoundEnd(proto, job.cfg).in_place_possible(2, job.facts(2))
    assert job.fail(2, 1, proto).rung == "in_process"


def test_origins_and_progress_carry_from_round_to_round():
    job = Job(max_restarts=10, spares=1, max_no_progress_cycles=0)
    proto = job.proto()
    for number in range(5):
        proto.declare_restartable(number)
        proto.declare_restartable(number)
    assert job.fail(0, 1, proto).replace_ranks == []
    assert json.loads(job.proto("node-b").get("r0/origin")) == {"node_id": "node-a", "rank": 1}
    assert job.fail(1, 1, proto).replace_ranks == [1]        # no step completed in round 1: replaced
    proto.put("r2/progress", "1")                             # round 2 made progress
    assert job.fail(2, 1, proto).replace_ranks == []
    verdicts = [job.fail(n, 2, proto) for n in range(3, 3 + NODE_FAILURE_LIMIT)]   # rank 2: node-b
    assert [v.exclude for v in verdicts] == [[]] * (NODE_FAILURE_LIMIT - 1) + [["node-b"]]
    assert proto.restarts_used() == 3 + NODE_FAILURE_LIMIT


def test_stragglers_exclusions_and_no_progress_come_from_the_store():
    job = Job(spares=1, straggler_exclude=True, max_no_progress_cycles=2)
    proto = job.proto("node-b")
    proto.put("slow/node-b", "node-b: 2.1x the median step time")
    proto.put("r0/progress", "1")
    assert job.fail(0, 0, proto).exclude == ["node-b"]
    mark_excluded(proto, "node-b")                          # what an asking agent records first
    verdict = RoundEnd(proto, job.cfg).interrupt(1, {"kind": "failure", "what": "rank 2 sent ExcludeThisNode",
                                                     "rank": 2, "node_id": "node-b", "leaving": "node-b"}, job.facts(1))
    assert verdict.restart and verdict.exclude == ["node-b"]
    assert RoundEnd(proto, job.cfg).policy.too_few_left(proto.count("excluded")) is None
    stop = job.fail(2, 0, proto)                             # rounds 1 and 2 without progress
    assert stop.kind == "stop" and stop.what.startswith("no progress: 2 cycles") and proto.restarts_used() == 2


def test_reports_that_never_restart_spend_no_budget():
    job = Job(max_restarts=1)
    proto = job.proto()
    assert job.fail(0, 0, proto).restart
    assert not job.fail(1, 0, proto).restart
    for number, kind in ((2, "complete"), (3, "stop"), (4, "shutdown")):
        verdict = RoundEnd(proto, job.cfg).interrupt(number, {"kind": kind, "what": kind, "signal": 15},
                                                     job.facts(number))
        assert verdict.kind == kind and not verdict.restart and verdict.next_round == number + 1
    assert proto.restarts_used() == 2
