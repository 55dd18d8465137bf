"""Elastic mode (issue 41, `--elastic`): with no hot spare left, the survivors of a lost node go on
at once on fewer data-parallel replicas, in place, from their live state; below the minimum the
job ends with one line and exit 1; without `--elastic`, `--nnodes MIN:MAX` means hot spares.

1. DDP, 3 agents x 1 rank, `--elastic --nnodes 2:3`, examples/live_train.py (torchdata's
   StatefulDataLoader, everything in one LiveState): agent 2 and its rank SIGKILLed for good while
   step 137 runs, no spare: ranks 0 and 1 keep their processes and state, the job re-forms on 2
   replicas and steps again within 1 s of the kill from step 136 (0 completed steps redone); one
   line says so. The data rule is TorchFT's (a smaller global batch, the learning rate as it was):
   the model at the end equals, bit for bit, a fault-free run of 3 replicas to step 136 continued
   on 2 replicas from its checkpoint.
4. A torchrun user's `--nnodes 2:3`: without `--elastic`, 2 nodes train and the third waits as a
   hot spare, with one note saying so; with it, 3 train (the case above checks that too).
5. Below the minimum: two of three nodes lost: one line and exit 1 (docs/migrating-from-torchrun.md).
6. Dead means dead: a node whose liveness port does not answer for 2 s during a restart (connects
   time out, as across a network blip; agent.rounds.keepalive) stays in the job.
The flags' lines (no job): the default-suite case below, in-process.
"""
import json
import os
import shutil
import time

import psutil
import pytest

from conftest import EXAMPLE as DDP_EXAMPLE, ROOT, node_tree, read_events, wait_for
from harness import JOB, Job, SleeperJob, progress, started, unanswered

from ft_launcher import cli
from ft_launcher.agent.observation.live_recovery import per_rank
from ft_launcher.flags import UsageError, build_parser

LIVE_EXAMPLE = os.path.join(ROOT, "examples", "live_train.py")
STEPS, FAULT = 250, 137


class LiveJob(Job):
    """examples/live_train.py on `nodes` agents x 1 rank (a Job of tests/harness.py), or one
    agent of `nproc` ranks (`nodes` 1)."""

    def __init__(self, launcher, root, nodes, nproc=1, ft_args=(), job_args=(), max_restarts=1, elastic=None):
        root.mkdir(parents=True, exist_ok=True)
        super().__init__(launcher, root, "2x1" if nodes > 1 else "1x2", ft_args, job_args, max_restarts=max_restarts,
                         rdzv_conf="last_call_timeout=20" if nodes > 1 else None)
        i = self.args.index(DDP_EXAMPLE)
        self.args[i:i + len(JOB)] = [LIVE_EXAMPLE]
        self.nodes, self.nproc, self.world = nodes, nproc, nodes * nproc
        if nodes > 1:
            self.args[self.args.index("--nnodes") + 1] = elastic or nodes
            if elastic:
                self.args.insert(0, "--elastic")
        else:
            self.args[self.args.index("--nproc-per-node") + 1] = nproc

    def finals(self, ranks):
        return [json.loads((self.ckpt / f"final_rank_{r}.json").read_text()) for r in ranks]


def last_step(job, rank):
    rows = progress(job.prog, rank)
    return rows[-1][1] if rows else 0


def reference_continuation(launcher, root):
    """TorchFT's rule, fault-free: 3 replicas train to step 136 and save a checkpoint there; 2
    replicas load it and train on to the end. The final per-rank results."""
    first = LiveJob(launcher, root / "three", 1, 3, job_args=["--steps", FAULT - 1, "--ckpt-every", FAULT - 1])
    first.launch()
    results, _ = first.wait(bound=300)
    assert results[0][0] == 0, results[0][2][-3000:]
    then = LiveJob(launcher, root / "two", 1, 2, job_args=["--steps", STEPS, "--ckpt-every", 50])
    then.ckpt.mkdir(parents=True)
    shutil.copy(first.ckpt / "ckpt.pt", then.ckpt / "ckpt.pt")
    then.launch()
    results, _ = then.wait(bound=300)
    assert results[0][0] == 0 and f"resumed from step {FAULT - 1} (checkpoint)" in results[0][1], results[0][2][-3000:]
    return then.finals([0, 1])


# ---- the flags (default suite: in-process, no job) --------------------------------------------------
def test_elastic_flag_help_note_and_usage_lines(tmp_path, capsys):
    """--help names --elastic and both meanings of --nnodes MIN:MAX; MIN:MAX without --elastic
    gets one note (hot spares, NVRx's meaning); --elastic with a fixed N is a one-line usage error."""
    script = tmp_path / "train.py"
    script.write_text("")
    text = build_parser().format_help()
    assert "--elastic" in text and "torchrun's meaning" in " ".join(text.split())
    endpoint = ["--rdzv-endpoint", "127.0.0.1:1"]
    cfg = cli.launch_config(["--nnodes", "2:3"] + endpoint + [str(script)])
    err = capsys.readouterr().err
    assert not cfg.elastic and err.count("note:") == 1 and "hot spares (NVRx's meaning)" in err and "--elastic" in err
    cfg = cli.launch_config(["--nnodes", "2:3", "--elastic"] + endpoint + [str(script)])
    assert cfg.elastic and "elastic (up to 3 train, down to 2 go on)" in cfg.summary()
    assert "note:" not in capsys.readouterr().err
    with pytest.raises(UsageError, match=r"--elastic needs --nnodes MIN:MAX with MIN < MAX"):
        cli.launch_config(["--nnodes", "3", "--elastic"] + endpoint + [str(script)])


# ---- 1. DDP 3 x 1, a node lost for good at step 137 ------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_node_lost_for_good_the_survivors_go_on_at_once_in_place_on_two_replicas(launcher, tmp_path):
    ref = reference_continuation(launcher, tmp_path / "reference")
    job = LiveJob(launcher, tmp_path / "job", 3, ft_args=["--ft-warm-reserves", 0],
                  job_args=["--steps", STEPS, "--ckpt-every", 50, "--step-time", 0.1], max_restarts=3,
                  elastic="2:3").launch()
    wait_for(lambda: last_step(job, 2) >= FAULT - 10, 300, "rank 2 near the fault", interval=0.05)
    while last_step(job, 2) < FAULT - 1:
        time.sleep(0.005)
    assert last_step(job, 2) == FAULT - 1
    for proc in node_tree(job.agents[2].pid):   # the node of rank 2: its agent and its rank, for good
        proc.kill()
    killed = time.time()
    results, _ = job.wait(bound=400)
    assert results[0][0] == 0 and results[1][0] == 0, "\n".join(r[2][-3000:] for r in results)
    err = results[0][2] + results[1][2]
    evs = job.events()
    c0, c1 = started(evs, 0), started(evs, 1)
    assert len(c0) == 3 and all(c1[r] == (c0[r][0], True) for r in (0, 1)) and 2 not in c1, (c0, c1)
    live = [e["detail"] for e in evs if e["kind"] == "live_recovery"]
    assert len(live) == 1 and live[0]["resume_step"] == FAULT - 1 and live[0]["steps_redone"] == 0, live
    assert per_rank(live[0]["sources"]) == {"0": "kept", "1": "kept"}, live
    again = []
    for rank in (0, 1):
        rows = progress(job.prog, rank)
        assert [s for c, s, _ in rows if c == 0][-1] == FAULT - 1, rank
        assert [s for c, s, _ in rows if c == 1] == list(range(FAULT, STEPS + 1)), rank
        again.append(min(t for c, _, t in rows if c == 1) - killed)
    print(f"\nkill -> first step completed again: {', '.join(f'{a:.3f}' for a in again)} s; {live[0]}")
    assert max(again) < 1.0, again
    resized = [ln for ln in err.splitlines() if "training on 2 of 3 nodes" in ln]
    assert len(resized) == 1 and "lost, no spare" in resized[0] and "global batch is 2/3" in resized[0], resized
    assert "no live state" not in err
    finals = job.finals([0, 1])
    assert [f["world_size"] for f in finals] == [2, 2]
    assert [(f["checksum"], f["loss"]) for f in finals] == [(r["checksum"], r["loss"]) for r in ref], (finals, ref)


# ---- 4, 5: --nnodes 2:3 with and without --elastic; below the minimum (sleeper ranks) -----------------
def sleepers(launcher, tmp_path, elastic, seconds=60):
    job = SleeperJob(launcher, tmp_path, "2:3", max_restarts=2)
    job.args[job.args.index("--rdzv-conf") + 1] = "join_timeout=30,last_call_timeout=20"
    job.args[-1] = seconds
    if elastic:
        job.args.insert(0, "--elastic")
    for order in range(3):
        job.start(order)
    return job


@pytest.mark.slow
@pytest.mark.parametrize("elastic", [False, True])
def test_nnodes_2_3_means_hot_spares_and_with_elastic_three_train(launcher, tmp_path, elastic):
    job = sleepers(launcher, tmp_path, elastic, seconds=3)
    outs = [p.communicate(timeout=90) for p in job.agents]
    assert [p.returncode for p in job.agents] == [0, 0, 0], [o[1][-2000:] for o in outs]
    starts = read_events(job.logs, "cycle_start")
    assert {e["detail"]["world_size"] for e in starts} == {3 if elastic else 2}, starts
    notes = [ln for _, err in outs for ln in err.splitlines() if "note: --nnodes 2:3" in ln]
    if elastic:
        assert not notes and not read_events(job.logs, "spare_waiting")
    else:
        assert len(notes) == 3 and "hot spares (NVRx's meaning)" in notes[0], notes
        assert len(read_events(job.logs, "spare_waiting")) == 1


@pytest.mark.slow
def test_below_the_minimum_one_line_and_exit_1(launcher, tmp_path):
    """--elastic --nnodes 2:3, three nodes train; agents 1 and 2 are lost for good: agent 0 alone is
    fewer than MIN: one line, exit 1, at once (not after join_timeout)."""
    job = sleepers(launcher, tmp_path, True)
    wait_for(lambda: all(job.rows(r) for r in range(3)), 60, "three nodes to run their ranks")
    for agent in job.agents[1:]:
        for proc in node_tree(agent.pid):
            proc.kill()
    lost = time.monotonic()
    out, err = job.agents[0].communicate(timeout=60)
    took = time.monotonic() - lost
    for agent in job.agents[1:]:
        agent.communicate()
    assert job.agents[0].returncode == 1, err[-3000:]
    lines = [ln for ln in err.splitlines() if "the job cannot go on" in ln]
    assert len(lines) == 1 and "1 node left, fewer than the 2 --nnodes 2:3 needs" in lines[0], err[-3000:]
    assert took < 10, took


# ---- 2. the lost node comes back at step 200: the job grows back in place ----------------------------
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_lost_node_comes_back_and_the_job_grows_back_in_place(launcher, tmp_path):
    """As above (agent 2 killed at step 137), then agent 2 started again once step 200 is done: it
    waits as a spare until its warm reserve is ready, then asks the job to grow; ranks 0 and 1 keep
    their processes and state (no completed step redone), the new rank 2 heals from a replica and
    the replicas' digests agree; back on 3 replicas within 1 s of its asking."""
    steps, step_time = 900, 0.05
    job = LiveJob(launcher, tmp_path / "job", 3,
                  job_args=["--steps", steps, "--ckpt-every", 50, "--step-time", step_time, "--step-time-always"],
                  max_restarts=3, elastic="2:3").launch()
    wait_for(lambda: last_step(job, 2) >= FAULT - 10, 300, "rank 2 near the fault", interval=0.05)
    while last_step(job, 2) < FAULT - 1:
        time.sleep(0.005)
    for proc in node_tree(job.agents[2].pid):
        proc.kill()
    wait_for(lambda: last_step(job, 0) >= 200, 120, "rank 0 at step 200", interval=0.02)
    job.launch_agent(2)   # the lost node's agent, started again (GROUP_RANK 2)
    results, _ = job.wait(bound=400)
    assert [results[i][0] for i in (0, 1, 3)] == [0, 0, 0], "\n".join(r[2][-3000:] for r in results)
    err = "".join(r[2] for r in results)
    evs = job.events()
    c0, c1, c2 = started(evs, 0), started(evs, 1), started(evs, 2)
    assert all(c2[r] == (c0[r][0], True) for r in (0, 1)), (c0, c2)   # kept: the same processes
    assert 2 in c2 and not c2[2][1], c2                                 # the newcomer's rank
    live = [e["detail"] for e in evs if e["kind"] == "live_recovery"]
    assert len(live) == 2 and all(t["steps_redone"] == 0 for t in live), live
    grown = live[1]
    sources = per_rank(grown["sources"])
    assert sources["0"] == sources["1"] == "kept" and sources["2"].startswith("peer "), grown
    assert grown["check"]["bytes"] > 0, grown   # rank 2's restored state's digest compared with the replicas'
    resume = grown["resume_step"]
    for rank in (0, 1):
        rows = progress(job.prog, rank)
        assert [s for c, s, _ in rows if c == 1][-1] == resume, rank            # no completed step lost ...
        assert [s for c, s, _ in rows if c == 2] == list(range(resume + 1, steps + 1)), rank   # ... or redone
    asked = [e["time"] for e in evs if e["kind"] == "elastic_join"]
    assert len(asked) == 1, asked
    back = max(min(t for c, _, t in progress(job.prog, r) if c == 2) for r in range(3)) - asked[0]
    print(f"\nasked to grow -> every rank's first step on 3 replicas completed: {back:.3f} s "
          f"(step time {step_time} s); {grown}")
    assert back < 1.0 + step_time, back
    resized = [ln for ln in err.splitlines() if "training on 3 of 3 nodes" in ln]
    assert len(resized) == 1 and "joined" in resized[0], resized
    finals = job.finals([0, 1, 2])
    assert len({f["checksum"] for f in finals}) == 1 and {f["world_size"] for f in finals} == {3}, finals


# ---- 3. HSDP 2 x 2: a whole replica lost goes on; a shard lost falls back with one line -----------------
HSDP_EXAMPLE = os.path.join(ROOT, "examples", "hsdp_train.py")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mesh", ["replicate,shard", "shard,replicate"])
def test_hsdp_a_lost_replica_goes_on_and_a_lost_shard_falls_back_with_one_line(launcher, tmp_path, mesh):
    """examples/hsdp_train.py, 2 agents x 2 ranks, `--elastic --nnodes 1:2`, the second node (ranks 2,
    3) lost for good at step 20. replicate,shard: it held replica 1 (both shards); the first node's
    ranks hold replica 0 on the new (1, 2) mesh, same shards: they keep their state and go on alone
    from step 19 (nothing redone). shard,replicate: it held both replicas of shard 1 (a shard group
    broken): on the new mesh rank 1 needs shard 1, which nobody holds: every rank falls back (this
    run keeps no checkpoint: step 0) with one line naming the shard, and the job still ends 0."""
    from harness import ExampleAgents

    prog = tmp_path / "progress"
    agents = ExampleAgents(launcher, tmp_path, 2, 2, HSDP_EXAMPLE,
                           ["--steps", 40, "--mesh", mesh, "--step-time", 0.2, "--progress-dir", prog],
                           ["--elastic", "--ft-rank-section-timeouts", "setup:60,step:60,checkpointing:60"],
                           max_restarts=2)
    agents.args[agents.args.index("--nnodes") + 1] = "1:2"
    agents.args[agents.args.index("--rdzv-conf") + 1] = "join_timeout=30,last_call_timeout=20"
    agents.launch()
    wait_for(lambda: (progress(prog, 2) or [(0, 0, 0)])[-1][1] >= 19, 240, "rank 2 at step 19", interval=0.01)
    for proc in node_tree(agents.agents[1].pid):
        proc.kill()
    results = agents.wait(bound=300, lost=(1,))
    err = results[0][2]
    evs = agents.events()
    live = [e["detail"] for e in evs if e["kind"] == "live_recovery"]
    assert len(live) == 1, live
    resized = [ln for ln in err.splitlines() if "training on 1 of 2 nodes, world size 2 instead of 4" in ln]
    assert len(resized) == 1, err[-3000:]
    c0, c1 = started(evs, 0), started(evs, 1)
    assert all(c1[r] == (c0[r][0], True) for r in (0, 1)), (c0, c1)   # in place, both ways
    lines = [ln for ln in err.splitlines() if "no live state to resume from" in ln]
    if mesh == "replicate,shard":
        assert live[0]["resume_step"] is not None and live[0]["steps_redone"] == 0, live
        assert per_rank(live[0]["sources"]) == {"0": "kept", "1": "kept"}, live
        assert not lines, lines
        done = [s for c, s, _ in progress(prog, 0) if c == 1]
        assert done == list(range(live[0]["resume_step"] + 1, 41)), done
    else:
        assert live[0]["resume_step"] is None, live
        assert len(lines) == 1 and "no rank holds the shard rank 1 needs" in lines[0], lines
        print(f"\n{lines[0]}")


# ---- 6. dead means dead: a liveness port unanswered for 2 s during a restart --------------------------
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_node_unreachable_for_2s_during_a_restart_stays(launcher, tmp_path):
    """--elastic --nnodes 2:3, 3 agents x 1 rank, examples/live_train.py. Agent 1's liveness port
    stops answering (connects time out, never refused: as across a network blip, the usual cause
    of a restart; tests/harness.py's `unanswered`), rank 0 is killed, and the port stays unanswered
    for 2 s after agent 0 decided the restart, then answers again. Nobody is taken for dead: no
    elastic_resize, one restart, every agent exits 0, ranks 1 and 2 kept in their processes, no
    live state lost (resumed at the last committed step, none redone: rank 2 keeps its state, rank
    0, a new process, heals from a replica), the replicas equal at the end. (Making the port
    unanswered stops agent 1 for the blip, longer than its rank waits for the restart after its
    peer's death, inprocess.PEER_GRACE: rank 1's state is suspect then and heals from a replica
    too; across a real blip its agent would run.) Before the fix agent 0 took agent 1 for dead on
    its first 1 s probe: the job shrank to 2 nodes, and agent 1 then asked to grow: two restarts."""
    steps = 400
    job = LiveJob(launcher, tmp_path / "job", 3, ft_args=["--ft-warm-reserves", 0],
                  job_args=["--steps", steps, "--ckpt-every", 50, "--step-time", 0.05, "--step-time-always"],
                  max_restarts=3, elastic="2:3").launch()
    wait_for(lambda: all(last_step(job, r) >= 40 for r in range(3)), 300, "every rank at step 40", interval=0.05)
    rank0 = started(job.events(), 0)[0][0]
    with unanswered(psutil.Process(job.agents[1].pid)):
        os.kill(rank0, 9)
        decided = wait_for(lambda: [e for e in job.events() if e["kind"] == "restart"], 60, "the restart decided")
        hold = decided[0]["time"] + 2.0
        while time.time() < hold:   # the blip's length, watching for a round closed without agent 1
            assert not [e for e in job.events() if e["kind"] == "elastic_resize"], "agent 1 taken for dead"
            time.sleep(0.05)
    results, _ = job.wait(bound=300)
    assert [r[0] for r in results] == [0, 0, 0], "\n".join(r[2][-3000:] for r in results)
    evs = job.events()
    assert not [e for e in evs if e["kind"] in ("elastic_resize", "elastic_join")], [
        e["detail"] for e in evs if e["kind"].startswith("elastic")]
    assert not [e for e in evs if e["kind"] == "cycle_start" and e["cycle"] > 1]
    c0, c1 = started(evs, 0), started(evs, 1)
    assert set(c1) == {0, 1, 2} and all(c1[r] == (c0[r][0], True) for r in (1, 2)), (c0, c1)   # in place
    live = [e["detail"] for e in evs if e["kind"] == "live_recovery"]
    assert len(live) == 1 and live[0]["steps_redone"] == 0, live
    sources = per_rank(live[0]["sources"])
    print(f"\nafter a 2 s unanswered liveness port: {sources}; resumed at step {live[0]['resume_step']}")
    assert sources["2"] == "kept" and sources["0"].startswith("peer ") and sources["1"] != "disk", live
    resume = live[0]["resume_step"]
    for rank in range(3):
        assert [s for c, s, _ in progress(job.prog, rank) if c == 1] == list(range(resume + 1, steps + 1)), rank
    assert [s for c, s, _ in progress(job.prog, 2) if c == 0][-1] == resume
    finals = job.finals(range(3))
    assert len({f["checksum"] for f in finals}) == 1 and {f["world_size"] for f in finals} == {3}, finals
