"""Megatron's exit codes 16 and 17 under our launcher (agent/recovery/rerun_exits.py, decided by
RestartPolicy.decide): the decisions from their inputs (no store, no processes), then short real
jobs (tests/scripts/rerun_exit_rank.py, no torch, ranks under ft.restartable): the swap of two slots,
16 again, 17 with no spare. The Megatron-shaped jobs through NVRx's client (every rank restarts:
the rotation; 17 with a spare) are tests/third_party/nvrx/test_nvrx_client.py's `test_megatron_exit_*`, slow.

- 16: the rank re-runs on other hardware, never the same device: a swap of two slots (ranks
  restart in place), a rotation of every node's slots (every rank restarts), a hot spare (one rank
  a node), else a stop with one line; 16 again for the same iteration stops with one line.
- 17: the suspect node (its own, or the 16's whose re-run it ends) leaves for a spare, else the job
  stops with one line; 17 again before any progress stops.
- Neither counts as a cycle without progress.
- Under `--elastic --nnodes MIN:MAX` with no spare, the node that must leave (a 17's suspect, a 16's
  node of one rank) is dropped and the job goes on while MIN remain (real jobs: 3 agents x 1 rank,
  the others finish on 2 nodes; 2 agents, fewer than MIN would remain: one line, exit 93).
"""
import os

import pytest

from conftest import SCRIPTS, read_events
from ft_launcher.agent.recovery.restart_policy import PolicyInputs, RestartPolicy, RoundFacts, Verdict
from ft_launcher.agent.ranks.gpu_env import slot_device

NODES = ["node-a", "node-b", "node-c"]


def facts(number, nodes=2, spares=0, nproc=2):
    active, spare = NODES[:nodes], NODES[nodes:nodes + spares]
    return RoundFacts(number, active, spare, {n: nproc for n in active + spare}, {n: f"host-{n[-1]}" for n in NODES})


def exited(code, rank, nproc=2, slots=None):
    node = NODES[rank // nproc]
    slots = slots or list(range(nproc))
    slot = slots.index(rank % nproc)   # the slot that runs it
    hw = {"node_id": node, "host": f"host-{node[-1]}", "slot": slot, "device": str(slot), "slots": slots}
    return {"kind": "failure", "what": f"rank {rank} on {node} exited {code}", "rank": rank, "node_id": node,
            "exitcode": code, "hardware": hw}


def decide(policy, number, report, inputs=None, **kw):
    return policy.decide(report, facts(number, **kw), inputs or PolicyInputs())


def test_a_16_under_in_place_restarts_swaps_the_rank_with_its_neighbour_slot_and_replaces_both():
    v = decide(RestartPolicy(5), 0, exited(16, 3), PolicyInputs(restartable=2))   # rank 3: node-b, slot 1
    assert v.kind == "failure" and v.restart and v.in_process
    assert v.rerun["swap"] == {"node_id": "node-b", "slots": [1, 0]} and not v.rerun["rotate"]
    assert v.replace_ranks == [2, 3] and v.keeps(0, "node-a") and not v.keeps(2, "node-b")
    assert v.rerun["suspect"] == {"node_id": "node-b", "host": "host-b", "device": "1"}
    assert "rank 3 re-runs on the device of slot 0 of its node, rank 2 takes slot 1" in v.what
    assert v.origin["exitcode"] == 16 and v.origin["hardware"]["device"] == "1"
    # after an earlier swap the slots hold other ranks: the partner is the rank in the other slot
    again = decide(RestartPolicy(5), 0, exited(16, 2, slots=[1, 0]), PolicyInputs(restartable=2))
    assert again.replace_ranks == [2, 3] and again.rerun["swap"]["slots"] == [1, 0]
    assert again.rerun["suspect"]["device"] == "1"


def test_a_16_when_every_rank_restarts_rotates_every_node():
    v = decide(RestartPolicy(5), 0, exited(16, 0))
    assert v.rung == "job" and v.restart and v.rerun["rotate"] and v.rerun["swap"] is None
    assert "every rank re-runs on another device" in v.what


def test_a_16_on_a_node_of_one_rank_takes_a_spare_or_stops_with_one_line():
    v = decide(RestartPolicy(5), 0, exited(16, 1, nproc=1), spares=1, nproc=1)
    assert v.restart and v.exclude == ["node-b"] and "leaves for a hot spare" in v.what
    stop = decide(RestartPolicy(5), 0, exited(16, 1, nproc=1), nproc=1)
    assert stop.kind == "stop" and not stop.restart and stop.restarts_used == 0 and not stop.rerun
    assert "no other hardware to re-run rank 1 on" in stop.what and stop.detail["failure"].endswith("exited 16")


def test_16_twice_for_the_same_iteration_stops_with_one_line_and_a_later_iteration_does_not():
    policy = RestartPolicy(5)
    first = decide(policy, 4, exited(16, 3), PolicyInputs(restartable=2))
    before = {4: first.origin}
    again = decide(policy, 5, exited(16, 3, slots=[1, 0]),
                   PolicyInputs(restartable=2, origins=before, progress=["none", "progress"]))
    assert again.kind == "stop" and not again.restart
    assert "exit 16 again for the same iteration (cycle 4)" in again.what
    assert "cycle 4's: rank 3 on host-b device 1; this one: rank 3 on host-b device 0" in again.what
    assert "data or the model" in again.what
    # progress since (a step completed in cycle 5): another iteration, another re-run
    later = decide(policy, 5, exited(16, 2, slots=[1, 0]),
                   PolicyInputs(restartable=2, origins=before, progress=["progress"]))
    assert later.restart and later.rerun["swap"]
    # by the checkpoint iteration: another iteration although no step completed in between
    by_file = dict(first.origin, iteration=130)
    other = decide(policy, 5, exited(16, 2), PolicyInputs(origins={4: by_file}, progress=["none"], last_iteration=140))
    assert other.restart
    same = decide(policy, 5, exited(16, 2), PolicyInputs(origins={4: by_file}, progress=["none"], last_iteration=130))
    assert same.kind == "stop" and "checkpoint iteration 130" in same.what


def test_a_17_sends_its_node_to_a_spare_or_stops_with_one_line():
    v = decide(RestartPolicy(5), 0, exited(17, 1), spares=1)
    assert v.restart and v.exclude == ["node-a"] and "its node (host-a device 1), leaves the job" in v.what
    stop = decide(RestartPolicy(5), 0, exited(17, 1))
    assert stop.kind == "stop" and "must not restart in place and no hot spare can take its place" in stop.what


def test_with_elastic_and_no_spare_a_17s_node_is_dropped_while_min_remain_else_the_job_stops():
    elastic = RestartPolicy(5, nodes=(2, 3), elastic=True)
    v = decide(elastic, 0, exited(17, 5), PolicyInputs(restartable=3), nodes=3)   # rank 5: node-c
    assert v.kind == "failure" and v.restart and v.in_process and v.exclude == ["node-c"]
    assert v.detail["dropped"] == {"node_id": "node-c", "nodes": 2, "exitcode": 17}
    assert ("the suspect, its node (host-c device 1), is dropped (--elastic, no hot spare): the job goes on with "
            "2 nodes (--nnodes 2:3)") in v.what
    assert v.keeps(0, "node-a") and not v.keeps(4, "node-c") and not v.rerun
    # a spare there: it takes the node's place, nothing dropped
    spare = decide(elastic, 0, exited(17, 3), spares=1)
    assert spare.exclude == ["node-b"] and "a hot spare takes its place" in spare.what and "dropped" not in spare.detail
    # below MIN: the job stops with one line that says why
    stop = decide(elastic, 0, exited(17, 3), nodes=2)
    assert stop.kind == "stop" and not stop.restart and not stop.exclude and stop.restarts_used == 0
    assert stop.what.endswith("must not restart in place and no hot spare can take its place, and without it "
                              "1 node would remain, fewer than the 2 of --elastic --nnodes 2:3; stopping the job")
    # a fixed-size job (no --elastic) with the same nodes: stops as before
    fixed = decide(RestartPolicy(5, nodes=(2, 3)), 0, exited(17, 5), nodes=3)
    assert fixed.kind == "stop" and fixed.what.endswith("no hot spare can take its place; stopping the job")
    # a 17 after an elastic drop, with progress between: the next node may go too, down to MIN only
    two = RestartPolicy(5, nodes=(1, 3), elastic=True)
    assert decide(two, 1, exited(17, 3), PolicyInputs(progress=["progress"]), nodes=2).exclude == ["node-b"]
    assert decide(two, 1, exited(17, 1), nodes=1).kind == "stop"


def test_with_elastic_and_no_spare_a_16_on_a_node_of_one_rank_drops_the_node():
    elastic = RestartPolicy(5, nodes=(2, 3), elastic=True)
    v = decide(elastic, 0, exited(16, 2, nproc=1), nodes=3, nproc=1)
    assert v.restart and v.exclude == ["node-c"] and v.detail["dropped"]["nodes"] == 2
    assert v.rerun["suspect"] == {"node_id": "node-c", "host": "host-c", "device": "0"} and not v.rerun["swap"]
    assert ("exited 16; its node (one rank: no other device there) is dropped (--elastic, no hot spare): the job goes "
            "on with 2 nodes (--nnodes 2:3), rank 2's step re-runs without that GPU") in v.what
    stop = decide(elastic, 0, exited(16, 1, nproc=1), nproc=1)
    assert stop.kind == "stop" and "1 node would remain, fewer than the 2 of --elastic --nnodes 2:3" in stop.what
    # the 16 again for the same iteration, on the nodes that went on: the data or the model
    again = decide(elastic, 1, exited(16, 1, nproc=1), PolicyInputs(origins={0: v.origin}, progress=["none"]),
                   nproc=1)
    assert again.kind == "stop" and "exit 16 again for the same iteration" in again.what


def test_a_17_that_ends_a_16s_rerun_blames_the_16s_node_and_17_again_stops():
    policy = RestartPolicy(5)
    sixteen = decide(policy, 0, exited(16, 3), PolicyInputs(restartable=2), spares=1)
    v = decide(policy, 1, exited(17, 3, slots=[1, 0]), PolicyInputs(origins={0: sixteen.origin}, progress=["none"]),
               spares=1)
    assert v.exclude == ["node-b"] and "the node of cycle 0's exit 16 (host-b device 1)" in v.what
    on_a = decide(policy, 1, exited(17, 0), PolicyInputs(origins={0: sixteen.origin}, progress=["none"]), spares=1)
    assert on_a.exclude == ["node-b"]   # its re-run ended on node-a: node-b, the 16's, is the suspect
    seventeen = decide(policy, 1, exited(17, 1), spares=1)
    again = decide(policy, 2, exited(17, 0), PolicyInputs(origins={1: seventeen.origin}, progress=["none"]), spares=1)
    assert again.kind == "stop" and "exit 17 again before any progress" in again.what
    # the suspect already left (its spare took over): the job goes on
    gone = dict(sixteen.origin, hardware=dict(sixteen.origin["hardware"], node_id="node-c"))
    on = decide(policy, 1, exited(17, 3), PolicyInputs(origins={0: gone}, progress=["none"]))
    assert on.restart and "has already left the job" in on.what


def test_reruns_are_not_cycles_without_progress():
    policy = RestartPolicy(5, no_progress_limit=1)
    ever = ["none", "none", "progress"]
    assert decide(policy, 2, exited(16, 3), PolicyInputs(progress=ever)).restart   # a 16 is never "no progress"
    sixteen = decide(policy, 1, exited(16, 3))
    plain = {"kind": "failure", "what": "rank 1 died", "rank": 1, "node_id": "node-a"}
    # cycle 1 ended in a 16 (not counted); cycle 2, this failure's, made no progress: 1 in a row
    two = RestartPolicy(5, no_progress_limit=2)
    assert two.decide(plain, facts(2), PolicyInputs(origins={1: sixteen.origin}, progress=ever)).restart
    stop = two.decide(plain, facts(2), PolicyInputs(origins={1: {"rank": 1, "node_id": "node-a"}}, progress=ever))
    assert stop.kind == "stop" and "no progress" in stop.what


def test_the_verdicts_rerun_travels_and_the_slots_device():
    v = decide(RestartPolicy(5), 0, exited(16, 3), PolicyInputs(restartable=2))
    assert Verdict.from_json(v.to_json()).rerun == v.rerun
    assert slot_device(1, {"CUDA_VISIBLE_DEVICES": "4,5"}) == "5" and slot_device(1, {}) == "1"
    assert slot_device(2, {"CUDA_VISIBLE_DEVICES": "4,5"}) == "2"


# ---- real jobs (no torch: a few seconds each) ----------------------------------------------------
RANK_SCRIPT = os.path.join(SCRIPTS, "rerun_exit_rank.py")


def calls(out, rank):
    """[(cycle, LOCAL_RANK, pid, FT_LAUNCHER_RERUN_OF, FT_LAUNCHER_RERUN_MOVED)] of `rank`'s calls."""
    rows = [line.split() for line in (out / f"rank_{rank}.txt").read_text().splitlines()]
    return [(int(c), int(lr), int(pid), of, moved) for c, _, lr, pid, of, moved in rows]


def run_job(launcher, tmp_path, *script_args):
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    res = launcher.run(["--standalone", "--nproc-per-node", 2, "--max-restarts", 3, "--log-dir", logs,
                        RANK_SCRIPT, out, *script_args], timeout=60)
    return res, out, logs


def test_a_rank_that_exits_16_reruns_on_the_other_slots_device_and_its_peer_takes_its_own(launcher, tmp_path):
    res, out, logs = run_job(launcher, tmp_path, 1, 16, 5)
    assert res.returncode == 0, res.stderr[-3000:]
    one, zero = calls(out, 1), calls(out, 0)
    assert [c[:2] for c in one] == [(0, 1), (1, 0)] and [c[:2] for c in zero] == [(0, 0), (1, 1)]
    assert one[1][3:] == ("0", "127.0.0.1:1") and zero[1][3:] == ("0", "127.0.0.1:0")
    assert len(read_events(logs, "cycle_start")) == 2
    [rerun] = read_events(logs, "rerun")
    assert rerun["detail"]["move"]["swap"] == {"node_id": rerun["detail"]["hardware"]["node_id"], "slots": [1, 0]}
    assert {e["rank"] for e in read_events(logs, "rank_moved")} == {0, 1}
    assert "rank 1 re-runs on the device of slot 0 of its node, rank 0 takes slot 1 -> restarting in place" in res.stderr
    from ft_launcher.report.analysis import analyse   # the report's incident tells it
    from ft_launcher.report.reading import load
    events, statuses, notes = load([str(logs)])
    [incident] = analyse([str(logs)], events, statuses, notes).incidents
    assert incident.cause.startswith("exit 16: resume to disambiguate on a different GPU")
    assert "rank 1 re-ran on device 0 (it left 127.0.0.1:1)" in incident.action


@pytest.mark.slow   # the rule: test_16_twice_for_the_same_iteration_stops_with_one_line_and_a_later_iteration_does_not
def test_16_again_for_the_same_iteration_stops_with_one_line(launcher, tmp_path):
    res, out, logs = run_job(launcher, tmp_path, 1, 16, 5, "again")
    assert res.returncode == 93, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert "exit 16 again for the same iteration (cycle 0)" in last and "exiting 93" in last
    assert "cycle 0's: rank 1 on 127.0.0.1 device 1; this one: rank 1 on 127.0.0.1 device 0" in last
    assert len(read_events(logs, "cycle_start")) == 2


@pytest.mark.slow   # the rule: test_a_17_sends_its_node_to_a_spare_or_stops_with_one_line
def test_17_with_no_spare_stops_with_one_line(launcher, tmp_path):
    res, out, logs = run_job(launcher, tmp_path, 0, 17, 5)
    assert res.returncode == 93, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert ("exited 17 (failed result validation: its node is suspect): the suspect, its node (127.0.0.1 "
            "device 0), must not restart in place and no hot spare can take its place") in last, last
    assert len(read_events(logs, "cycle_start")) == 1


def elastic_agents(launcher, tmp_path, nodes, nnodes, *script_args):
    """`nodes` agents x 1 rank of RANK_SCRIPT under `--elastic --nnodes nnodes`, no hot spare."""
    from harness import ExampleAgents
    out = tmp_path / "out"
    out.mkdir()
    agents = ExampleAgents(launcher, tmp_path, nodes, 1, RANK_SCRIPT, [out, *script_args], ["--elastic"],
                           max_restarts=3)
    agents.args[agents.args.index("--nnodes") + 1] = nnodes
    # every agent in the first round (it closes once all MAX joined), whatever their start's skew
    agents.args[agents.args.index("--rdzv-conf") + 1] = f"join_timeout=30,last_call_timeout={20 if nodes == 3 else 1}"
    return agents.launch(), out


def test_with_elastic_a_rank_that_exits_17_drops_its_node_and_the_others_go_on(launcher, tmp_path):
    """3 agents x 1 rank, `--elastic --nnodes 2:3`, no spare: rank 2 exits 17 at its 100th step. Its node
    leaves (its agent exits 93, this node's own line), ranks 0 and 1 keep their processes and finish
    on 2 nodes (exit 0); one line says the node was dropped for the 17 and the job goes on with 2 nodes."""
    agents, out = elastic_agents(launcher, tmp_path, 3, "2:3", 2, 17, 100)
    results = agents.wait(bound=120, lost=(2,))
    assert results[2][0] == 93, results[2][2][-3000:]
    dropped = ("exited 17 (failed result validation: its node is suspect); the suspect, its node (localhost device 0), "
               "is dropped (--elastic, no hot spare): the job goes on with 2 nodes (--nnodes 2:3)")
    for i, (code, _, err) in enumerate(results):   # one line on each node; the leaving node's last says why it left
        lines = [ln for ln in err.splitlines() if dropped in ln and "exiting 93" not in ln]
        assert len(lines) == 1, err[-3000:]
        assert lines[0].endswith("-> this node leaves the job" if i == 2 else
                                 "(on another node) -> restarting this node's ranks in place"), lines
    last = results[2][2].strip().splitlines()[-1]
    assert "error: this node leaves the job: " in last and dropped in last and "exiting 93 (no restart)" in last
    [rerun] = read_events(agents.logs, "rerun")
    assert rerun["detail"]["dropped"]["nodes"] == 2 and rerun["detail"]["exclude"] == [rerun["detail"]["dropped"]["node_id"]]
    [resize] = read_events(agents.logs, "elastic_resize")
    assert resize["detail"]["world_size"] == 2 and resize["detail"]["previous_world_size"] == 3
    resized = [ln for ln in results[0][2].splitlines() if "training on 2 of 3 nodes, world size 2 instead of 3" in ln]
    assert len(resized) == 1 and "(node localhost order=2 dropped, no spare)" in resized[0], resized
    assert resize["detail"]["dropped"] == ["localhost order=2"] and resize["detail"]["lost"] == []
    zero, one = calls(out, 0), calls(out, 1)
    assert [c[0] for c in zero] == [0, 1] and [c[0] for c in one] == [0, 1]   # cycle 1 on 2 nodes, in place
    assert zero[1][2] == zero[0][2] and one[1][2] == one[0][2]
    assert [c[0] for c in calls(out, 2)] == [0]
    from ft_launcher.report.analysis import analyse   # the report's incident tells it
    from ft_launcher.report.reading import load
    events, statuses, notes = load([str(agents.logs)])
    [incident] = analyse([str(agents.logs)], events, statuses, notes).incidents
    assert incident.cause.startswith("exit 17: failed result validation")
    assert "the suspect node was dropped (--elastic, no hot spare): the job went on with 2 nodes" in incident.action


def test_with_elastic_a_17_that_would_leave_fewer_than_min_stops_with_one_line(launcher, tmp_path):
    """2 agents x 1 rank, `--elastic --nnodes 2:3`: rank 1 exits 17; dropping its node would leave 1 of the 2
    needed: the job stops, every agent exits 93 with the line that says so."""
    agents, out = elastic_agents(launcher, tmp_path, 2, "2:3", 1, 17, 25)
    results = agents.wait(bound=120, lost=(0, 1))
    for code, _, err in results:
        last = err.strip().splitlines()[-1]
        assert code == 93 and ("no hot spare can take its place, and without it 1 node would remain, fewer than "
                               "the 2 of --elastic --nnodes 2:3; stopping the job") in last and "exiting 93" in last, err[-3000:]
    assert len(read_events(agents.logs, "cycle_start")) == 2   # cycle 0 on both nodes, no other
