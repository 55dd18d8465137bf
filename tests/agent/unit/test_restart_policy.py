"""The restart decision (agent/recovery/restart_policy.py), pure: `RestartPolicy.decide(report,
facts, inputs)` reads and writes nothing, so every rule is tested here from its inputs alone (the
round protocol that gathers them and carries the verdict out is tests/agent/unit/test_round_protocol.py).

What is decided: the rung (in place only when every training node declared its ranks restartable
and the granularity allows it); a rank that fails again at once in the same slot is replaced; a
node where failures keep beginning leaves when a spare can take its place; a straggler leaves when
a spare can take its place; a node's leaving is an exclusion, or a stop when too few can remain; a
failure after too many cycles without progress stops the job; the restart budget; the verdict's
JSON round trip. And a hang inside a cycle (`judge_hang`): which hung ranks are culprits and which
only waited on them, from the flight recorder or the stacks, and when it is worth waiting.
"""
import pytest

from ft_launcher.agent.recovery.restart_policy import (NODE_FAILURE_LIMIT, HangEvidence, PolicyInputs, RestartPolicy,
                                                       RoundFacts, Verdict, judge_hang, waiting_words)

NODES = ["node-a", "node-b", "node-c"]


def facts(number, nodes=2, spares=0):
    active, spare = NODES[:nodes], NODES[nodes:nodes + spares]
    return RoundFacts(number, active, spare, {n: 2 for n in active + spare})


def failure(rank, **extra):
    return {"kind": "failure", "what": f"rank {rank} died", "rank": rank, "node_id": NODES[rank // 2], **extra}


def decide(policy, number, rank, inputs=None, spares=0, **extra):
    return policy.decide(failure(rank, **extra), facts(number, spares=spares), inputs or PolicyInputs())


def test_in_place_only_when_every_training_node_declared_its_ranks_restartable():
    policy = RestartPolicy(5)
    assert decide(policy, 0, 1).rung == "job"                                        # nobody declared
    assert decide(policy, 0, 1, PolicyInputs(restartable=1)).rung == "job"           # one node of two
    verdict = decide(policy, 0, 1, PolicyInputs(restartable=2))
    assert verdict.rung == "in_process" and verdict.in_process
    assert verdict.keeps(0, "node-a") and not verdict.replace_ranks and not verdict.replace_nodes
    assert policy.in_place_possible(facts(0), 2) and not policy.in_place_possible(facts(0), 1)
    assert not RestartPolicy(5, "job").in_place_possible(facts(0), 2)


def test_a_grow_restarts_in_place_where_a_failure_would_and_spends_no_budget():
    """--elastic: a node joined a job below MAX nodes (kind grow): every healthy rank kept, no budget."""
    grow = {"kind": "grow", "what": "node-c joined", "node_id": "node-c"}
    policy = RestartPolicy(1)
    verdict = policy.decide(grow, facts(4, spares=1), PolicyInputs(restarts_used=1, restartable=2))
    assert verdict.restart and verdict.in_process and verdict.restarts_used == 1 and verdict.next_round == 5
    assert verdict.keeps(0, "node-a") and verdict.keeps(3, "node-b")
    assert policy.decide(grow, facts(4, spares=1), PolicyInputs(restartable=1)).rung == "job"


@pytest.mark.parametrize("granularity,rung,replaced_nodes", [
    ("auto", "in_process", []), ("rank", "in_process", []), ("node", "in_process", ["node-b"]), ("job", "job", []),
])
def test_granularity(granularity, rung, replaced_nodes):
    verdict = decide(RestartPolicy(5, granularity), 0, 3, PolicyInputs(restartable=2))   # rank 3: node-b's second
    assert verdict.rung == rung and verdict.replace_nodes == replaced_nodes
    if rung == "in_process":
        assert verdict.keeps(0, "node-a") and verdict.keeps(2, "node-b") == (granularity != "node")


def test_an_unknown_granularity_is_refused():
    with pytest.raises(ValueError, match="restart granularity 'rack'"):
        RestartPolicy(1, "rack")


def test_a_rank_that_fails_again_at_once_is_replaced_and_one_that_progressed_is_not():
    policy = RestartPolicy(5)
    first = decide(policy, 0, 1, PolicyInputs(restartable=2, progress=["none"]))
    assert first.replace_ranks == [] and first.origin == {"rank": 1, "node_id": "node-a"}
    before = {0: first.origin}
    again = decide(policy, 1, 1, PolicyInputs(restartable=2, origins=before, progress=["none", "none"]))
    assert again.replace_ranks == [1] and not again.keeps(1, "node-a") and again.keeps(0, "node-a")
    progressed = PolicyInputs(restartable=2, origins=before, progress=["progress"])   # round 1 made progress
    assert decide(policy, 1, 1, progressed).replace_ranks == []
    other = PolicyInputs(restartable=2, origins=before, progress=["none", "none"])
    assert decide(policy, 1, 0, other).replace_ranks == []                           # another rank


def test_a_node_where_failures_keep_beginning_leaves_when_a_spare_can_take_over():
    policy = RestartPolicy(5)
    on_b = {"rank": 2, "node_id": "node-b"}
    streak = PolicyInputs(origins={k: on_b for k in range(NODE_FAILURE_LIMIT - 1)},
                          progress=["none"] * NODE_FAILURE_LIMIT)
    number = NODE_FAILURE_LIMIT - 1
    assert decide(policy, number, 2, streak, spares=1).exclude == ["node-b"]
    assert "began on node node-b 3 times in a row" in decide(policy, number, 2, streak, spares=1).what
    assert decide(policy, number, 2, streak).exclude == []                            # no spare
    shorter = PolicyInputs(origins={number - 1: on_b}, progress=["none"] * NODE_FAILURE_LIMIT)
    assert decide(policy, number, 2, shorter, spares=1).exclude == []
    progressed = PolicyInputs(origins=streak.origins, progress=["none", "progress"])
    assert decide(policy, number, 2, progressed, spares=1).exclude == []


def test_a_straggler_is_left_out_when_a_spare_can_take_its_place():
    for spares, on, left_out in ((1, True, ["node-b"]), (0, True, []), (1, False, [])):
        verdict = decide(RestartPolicy(5, straggler_exclude=on), 0, 0, PolicyInputs(slow=["node-b"]), spares=spares)
        assert verdict.restart and verdict.exclude == left_out
        assert ("straggling node node-b is left out" in verdict.what) == bool(left_out), verdict.what


def test_a_node_that_asks_to_leave_is_excluded_or_the_job_stops_when_too_few_remain():
    """ExcludeThisNode: the policy, not the asking agent, decides the node leaves or the job stops."""
    for spares, stops in ((1, False), (0, True)):
        policy = RestartPolicy(5, nodes=(2, 2 + spares))
        verdict = decide(policy, 0, 2, PolicyInputs(excluded=1), spares=spares, leaving="node-b",
                         what="rank 2 sent ExcludeThisNode")
        assert "leaving" not in verdict.detail
        if stops:   # 2 nodes needed, at most 1 can remain: restarting is pointless, the budget untouched
            assert verdict.kind == "stop" and not verdict.restart and verdict.restarts_used == 0
            assert verdict.what == ("rank 2 sent ExcludeThisNode; 1 node excluded: at most 1 of the 2 needed "
                                    "can remain") and verdict.detail["failure"] == "rank 2 sent ExcludeThisNode"
        else:       # the spare takes its place
            assert verdict.kind == "failure" and verdict.restart and verdict.exclude == ["node-b"]


def test_too_few_left_is_the_one_check_of_joining_and_leaving_nodes():
    policy = RestartPolicy(1, nodes=(2, 3))
    assert policy.too_few_left(0) is None and policy.too_few_left(1) is None
    assert policy.too_few_left(2) == "2 nodes excluded: at most 1 of the 2 needed can remain"


def test_a_failure_after_cycles_without_progress_is_a_stop_that_spends_no_budget():
    policy = RestartPolicy(5, no_progress_limit=2)
    assert decide(policy, 1, 0, PolicyInputs(progress=["none", "none"])).restart   # never made progress
    assert decide(policy, 2, 0, PolicyInputs(progress=["none", "progress"])).restart   # one cycle without
    verdict = decide(policy, 3, 1, PolicyInputs(restarts_used=3, progress=["none", "none", "progress"]))
    assert verdict.kind == "stop" and not verdict.restart and verdict.what.startswith("no progress: 2 cycles")
    assert verdict.detail["failure"] == "rank 1 died" and verdict.restarts_used == 0 and verdict.origin is None
    assert decide(RestartPolicy(5), 3, 1, PolicyInputs(progress=["none"] * 9 + ["progress"])).restart   # limit 0


def test_progress_by_a_checkpoint_file_counts_what_it_could_not_tell_as_neither():
    policy = RestartPolicy(5, no_progress_limit=2, min_progress_iterations=5, iteration_file="ckpt/latest.txt")
    assert decide(policy, 2, 0, PolicyInputs(progress=["none", "unknown"])).restart
    verdict = decide(policy, 2, 0, PolicyInputs(progress=["none", "unknown", "none"], last_iteration=104))
    assert verdict.kind == "stop" and verdict.what == (
        "no progress: 2 cycles in a row ended without the checkpoint iteration in ckpt/latest.txt rising by "
        "min_progress_iterations=5 (it reads 104; max_no_progress_cycles=2); restarting is pointless")


def test_the_budget_and_the_kinds_that_never_restart():
    policy = RestartPolicy(1)
    first = decide(policy, 0, 0)
    assert first.restart and first.restarts_used == 1 and first.next_round == 1
    spent = decide(policy, 1, 0, PolicyInputs(restarts_used=1))
    assert not spent.restart and spent.restarts_used == 2 and spent.origin == {"rank": 0, "node_id": "node-a"}
    for number, kind in ((2, "complete"), (3, "stop"), (4, "shutdown")):
        verdict = policy.decide({"kind": kind, "what": kind, "signal": 15}, facts(number), PolicyInputs(restarts_used=2))
        assert verdict.kind == kind and not verdict.restart and verdict.next_round == number + 1
        assert verdict.restarts_used == 0 and verdict.origin is None


def test_where_a_failure_began():
    policy = RestartPolicy(5)
    assert decide(policy, 0, 3).origin == {"rank": 3, "node_id": "node-b"}
    silent = policy.decide({"kind": "failure", "what": "node-b went silent", "node_id": "node-a",
                            "dead_nodes": [{"node_id": "node-b"}]}, facts(0), PolicyInputs())
    assert silent.origin == {"rank": None, "node_id": "node-b"}


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


def test_the_same_error_again_before_any_progress_stops_the_job_with_the_budget_untouched():
    """PolicyInputs.repeats (the round protocol's: earlier rounds, in a row, that failed with this
    failure's traceback, no progress since): the max_identical_failures-th such failure is a stop."""
    policy = RestartPolicy(5, identical_failure_limit=2)
    first = decide(policy, 0, 1, PolicyInputs(progress=["none"]))
    assert first.kind == "failure" and first.restart
    again = decide(policy, 1, 1, PolicyInputs(restarts_used=1, progress=["none", "none"], repeats=[0]))
    assert again.kind == "stop" and not again.restart and again.restarts_used == 0
    assert again.what.endswith(": the same error as in cycle 0, 2 failures in a row before any progress "
                               "(max_identical_failures=2); restarting cannot help"), again.what
    assert again.detail["failure"] == failure(1)["what"]
    assert decide(RestartPolicy(5, identical_failure_limit=3), 1, 1, PolicyInputs(repeats=[0])).restart
    assert decide(RestartPolicy(5), 1, 1, PolicyInputs(repeats=[0])).restart   # 0: off


FR = {"evidence": "flight recorder", "culprits": [1], "victims": [0, 2, 3], "collective": "allreduce", "sequence": 7}


def test_a_hang_is_judged_from_the_flight_recorder_first_then_the_stacks():
    # a cycle that cannot restart in place: every hung rank stops, nothing to tell
    verdict, quiet = judge_hang(HangEvidence(world=4, late=False, in_place=False))
    assert quiet and verdict["culprits"] == [] and "does not restart in place" in verdict["why"]
    # the flight recorder, complete: culprit 1 reported its hang, victims released at once
    verdict, quiet = judge_hang(HangEvidence(world=4, late=False, in_place=True, hung={0, 1}, flight_recorder=True,
                                             fr=dict(FR), fr_complete=True))
    assert not quiet and (verdict["culprits"], verdict["victims"]) == ([1], [0, 2, 3])
    assert waiting_words(verdict) == ("; ranks 0, 2, 3 were waiting on it (flight recorder: the hung never joined "
                                      "allreduce (sequence 7))")
    # the dumps on their way: wait; incomplete dumps blaming a rank that did not report: not sure
    assert judge_hang(HangEvidence(world=4, late=False, in_place=True, hung={0}, flight_recorder=True)) is None
    ev = HangEvidence(world=2, late=True, in_place=True, hung={0}, flight_recorder=True, fr=dict(FR),
                      stacks={0: "wait"})
    verdict, _ = judge_hang(ev)
    assert verdict["culprits"] == [] and verdict["why"].startswith("the flight recorder found no collective")
    # the stacks: a rank running outside a collective hung, the waiting one is its victim
    stacks = {0: "wait", 1: "run"}
    assert judge_hang(HangEvidence(world=3, late=False, in_place=True, hung={0, 1}, stacks=stacks)) is None  # rank 2?
    verdict, _ = judge_hang(HangEvidence(world=2, late=False, in_place=True, hung={0, 1}, stacks=stacks))
    assert (verdict["evidence"], verdict["culprits"], verdict["victims"]) == ("stacks", [1], [0])
    # every stack waits (or none does): no evidence, every hung rank is stopped
    verdict, _ = judge_hang(HangEvidence(world=2, late=True, in_place=True, hung={0, 1}, stacks={0: "wait", 1: "wait"}))
    assert verdict["culprits"] == [] and verdict["why"] == "every hung rank's stack waits inside a collective"


def test_victims_are_released_only_when_every_culprit_will_be_stopped():
    # culprit 3 did not report a hang and is not on the deciding node: wait, then stop everyone
    ev = HangEvidence(world=4, late=False, in_place=True, mine={0, 1}, hung={0, 2}, flight_recorder=True,
                      fr=dict(FR, culprits=[3], victims=[0, 1, 2]), fr_complete=True)
    assert judge_hang(ev) is None
    ev.late = True
    verdict, _ = judge_hang(ev)
    assert verdict["culprits"] == [] and "blames rank(s) 3, whose monitor did not report a hang in time" in verdict["why"]
    # ... unless the culprit is on the deciding node, which kills it
    ev.mine = {2, 3}
    verdict, _ = judge_hang(ev)
    assert verdict["culprits"] == [3] and verdict["victims"] == [0, 1, 2]
