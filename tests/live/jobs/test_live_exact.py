"""Live recovery that is exact or says why (issue 30), on the loop a user writes from the guide:
examples/live_train.py (DDP on gloo, torchdata's StatefulDataLoader over a StatefulDistributedSampler,
the batch drawn at the top of each step, AdamW + LambdaLR, a checkpoint every 50 steps, RNG kept).
Each case ends with exactly the final model of a fault-free run (checksums, every rank), or with
the one line of an explicit fallback; real agents, monitors, ranks and rendezvous.

1. Faults at step 137 of 150: rank 0 killed (1 agent x 2 ranks), rank 1 raising after its commit,
   rank 1 hung after its commit (2 agents x 1 rank), rank 3 killed in 2 x 2: every kept rank rolls
   its loader back to its last commit, a healed rank continues its peer's position, no step twice.
2. BatchNorm + dropout (RNG kept): rank 1 killed heals exactly; rank 0 killed falls back (its
   BatchNorm statistics exist nowhere else) with one line saying so.
3. Two LiveStates in one function (the model's and an EMA teacher's), matched by name.
5. FSDP over every rank without `shard=`: the fallback line (no replica to heal from).
6. A second fault inside restore() (the healed rank dies while loading): the next cycle is live.
7. A scheduler whose state holds a lambda: one line at the start, live recovery off for it; the
   checkpoint fallback ends exact too (dropout).
8. Issue 39, after an in-place restart: (a) 1 x 3, rank 1 raises in cycle 0, rank 0 hangs in cycle 1:
   only cycle 1's evidence counts (the hung rank is named, the others keep their state, exact); the
   run ends with a closing all_gather_object with DDP alive (every rank ends by itself); (b) the
   same end after a kill, 2 x 2, twenty runs (slow); (c) a rank that hangs after its last step
   while its peers exit 0 is ended within teardown_hang_grace, with one line, and the job ends 0.
4. HSDP 2 x 2 and a warm reserve node; the first node in the order is lost, the survivor's ranks
   move up: kept where their new place holds the same shard, else every rank falls back.
The wire and plan units are in test_live_state.py; 20 live recoveries' memory in test_live_memory.
"""
import json
import os

import pytest

from conftest import EXAMPLE as DDP_EXAMPLE, ROOT, node_tree, read_events, wait_for
from harness import JOB, TOPOLOGIES, Job, progress, started
from ft_launcher.agent.observation.live_recovery import per_rank

LIVE_EXAMPLE = os.path.join(ROOT, "examples", "live_train.py")
STEPS, FAULT = 150, 137
BASE = ["--steps", STEPS, "--ckpt-every", 50]


class LiveJob(Job):
    """A Job (tests/harness.py) running examples/live_train.py instead of ddp_train.py."""

    def __init__(self, launcher, root, topology, ft_args=(), job_args=(), max_restarts=1):
        root.mkdir(parents=True, exist_ok=True)
        super().__init__(launcher, root, topology, ft_args, job_args, max_restarts=max_restarts)
        i = self.args.index(DDP_EXAMPLE)
        self.args[i:i + len(JOB)] = [LIVE_EXAMPLE]

    def run(self):
        self.launch()
        results, _ = self.wait()
        out = "".join(r[1] for r in results)
        err = "".join(r[2] for r in results)
        assert all(code == 0 for code, _, _ in results), err[-4000:]
        return out, err

    def finals(self):
        return [json.loads((self.ckpt / f"final_rank_{r}.json").read_text()) for r in range(self.world)]


class References:
    """The fault-free run of each (world size, flags), once per module."""

    def __init__(self, factory, launcher_factory):
        self.factory, self.cache = factory, {}

    def get(self, launcher, topology, flags):
        key = (TOPOLOGIES[topology][0] * TOPOLOGIES[topology][1], tuple(map(str, flags)))
        if key not in self.cache:
            root = self.factory.mktemp("reference")
            job = LiveJob(launcher, root, topology, job_args=BASE + list(flags))
            out, err = job.run()
            assert "no live state" not in err and "refused" not in err, err[-3000:]
            self.cache[key] = job.finals()   # per rank (BatchNorm's statistics differ between replicas)
        return self.cache[key]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return References(tmp_path_factory, None)


def told(job):
    return [e["detail"] for e in job.events() if e["kind"] == "live_recovery"]


def check_exact(job, ref, fault_rank, resume, source=None):
    """Every rank ends with its fault-free counterpart's model; one live recovery, resumed at
    `resume`, the fault rank from a peer (or `source`), every other rank kept; no healthy rank
    trains a completed step twice."""
    finals = job.finals()
    assert [f["checksum"] for f in finals] == [r["checksum"] for r in ref], (finals, ref)
    assert [f["loss"] for f in finals] == [r["loss"] for r in ref]
    live = told(job)
    assert len(live) == 1 and live[0]["resume_step"] == resume and live[0]["steps_redone"] == 0, live
    sources = per_rank(live[0]["sources"])
    got = sources.pop(str(fault_rank))
    assert got == source if source else got.startswith("peer "), live
    assert set(sources.values()) == {"kept"}, live
    for rank in range(job.world):
        rows = progress(job.prog, rank)
        after = [s for c, s, _ in rows if c == 1]
        assert after == list(range(resume + 1, STEPS + 1)), (rank, after[:3])
        if rank != fault_rank:
            before = [s for c, s, _ in rows if c == 0]
            assert before[-1] <= resume, (rank, before[-3:])
    return live[0]


# ---- 1. the torchdata loop, each fault at step 137 ---------------------------------------------------
def test_killed_rank_0_heals_from_its_peer_and_the_loader_continues_exactly(launcher, tmp_path, references):
    """1 agent x 2 ranks, rank 0 killed at the top of step 137 (its batch not yet drawn; every rank
    held 0.5 s after step 136's commit, so rank 1 has committed it: on a busy machine it once had
    not, and the job rightly resumed at 135; rank 1 has drawn its batch 137 and waits in the all-reduce): rank 1 rolls its loader back to the commit of
    136, rank 0 (a new process) receives model, optimizer, scheduler, loader position and RNG."""
    ref = references.get(launcher, "1x2", [])
    job = LiveJob(launcher, tmp_path, "1x2", job_args=BASE + ["--fail-at-step", FAULT, "--fail-rank", 0])
    out, err = job.run()
    live = check_exact(job, ref, 0, FAULT - 1)
    assert "no live state" not in err and live["check"]["bytes"] > 0, live
    print(f"\n{live}")


@pytest.mark.slow
def test_a_rank_raising_after_its_commit_heals_exactly(launcher, tmp_path, references):
    """Rank 1 raises after the commit of step 137 (every rank holds 0.5 s first): its state is
    suspect, the job resumes at 137, rank 1 receives the state from rank 0 in its own process."""
    ref = references.get(launcher, "1x2", [])
    job = LiveJob(launcher, tmp_path, "1x2", job_args=BASE + ["--raise-at-step", FAULT, "--fail-rank", 1])
    job.run()
    check_exact(job, ref, 1, FAULT, source="peer 0")


@pytest.mark.slow
def test_a_hang_after_the_commit_keeps_the_waiting_rank_and_heals_the_hung_one(launcher, tmp_path, references):
    """2 agents x 1 rank: rank 1 hangs after the commit of step 137; rank 0 waits in step 138's
    all-reduce (its batch 138 drawn) until the step timeouts find the hang: rank 0 restarts in
    place with its loader rolled back to 137, rank 1 is replaced and heals from it."""
    ref = references.get(launcher, "2x1", [])
    job = LiveJob(launcher, tmp_path, "2x1", ["--ft-rank-section-timeouts", "setup:30,step:3,checkpointing:30"],
                  job_args=BASE + ["--hang-at-step", FAULT, "--fail-rank", 1])
    job.run()
    check_exact(job, ref, 1, FAULT, source="peer 0")


@pytest.mark.slow
def test_a_killed_rank_in_2x2_heals_exactly(launcher, tmp_path, references):
    ref = references.get(launcher, "2x2", [])
    job = LiveJob(launcher, tmp_path, "2x2", job_args=BASE + ["--fail-at-step", FAULT, "--fail-rank", 3])
    job.run()
    check_exact(job, ref, 3, FAULT - 1)


# ---- 2. BatchNorm + dropout -------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("fault_rank", [1, 0])
def test_batchnorm_and_dropout(launcher, tmp_path, references, fault_rank):
    """Dropout draws from torch's generator (kept with the state); BatchNorm's running statistics
    change in every forward (rolled back to the commit). Rank 1 killed: exact. Rank 0 killed: its
    BatchNorm statistics (per rank; DDP makes rank 0's everyone's at the next step) exist nowhere
    else: the checkpoint, with one line that says so, and exact too."""
    flags = ["--batchnorm", "--dropout", 0.2]
    ref = references.get(launcher, "1x2", flags)
    job = LiveJob(launcher, tmp_path, "1x2", job_args=BASE + flags + ["--fail-at-step", FAULT, "--fail-rank",
                                                                      fault_rank])
    out, err = job.run()
    if fault_rank == 1:
        check_exact(job, ref, 1, FAULT - 1, source="peer 0")
        return
    lines = [ln for ln in err.splitlines() if "no live state to resume from" in ln]
    assert len(lines) == 1 and "BatchNorm running statistics" in lines[0] and "rank 0 would heal" in lines[0], lines
    assert told(job)[0]["resume_step"] is None
    assert "resumed from step 100 (checkpoint)" in out
    assert [f["checksum"] for f in job.finals()] == [r["checksum"] for r in ref]   # the fallback is exact too


# ---- 3. two LiveStates --------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_live_states_in_one_function_match_by_name(launcher, tmp_path, references):
    """The model's LiveState and an EMA teacher's (name='teacher'), committed together: rank 1
    killed, both heal from rank 0; the teacher (in the checksum) ends exact too."""
    ref = references.get(launcher, "1x2", ["--ema"])
    job = LiveJob(launcher, tmp_path, "1x2", job_args=BASE + ["--ema", "--fail-at-step", FAULT, "--fail-rank", 1])
    out, _ = job.run()
    check_exact(job, ref, 1, FAULT - 1, source="peer 0")
    assert f"resumed from live state at step {FAULT - 1} (cycle 1)" in out


# ---- 5. FSDP without replicas ------------------------------------------------------------------------
@pytest.mark.slow
def test_fsdp_without_replicas_falls_back_with_one_line(launcher, tmp_path, references):
    """fully_shard over both ranks, LiveState without shard=: the parameters' mesh coordinates say
    each rank holds its own shard; rank 1 killed has no peer holding its shard: every rank falls
    back (this example keeps no sharded checkpoint: step 0), and rank 0 says why in one line."""
    ref = references.get(launcher, "1x2", ["--fsdp"])
    job = LiveJob(launcher, tmp_path, "1x2", job_args=BASE + ["--fsdp", "--fail-at-step", FAULT, "--fail-rank", 1])
    out, err = job.run()
    lines = [ln for ln in err.splitlines() if "no live state to resume from" in ln]
    assert len(lines) == 1, err[-3000:]
    assert "no rank holds the shard rank 1 needs at step 136: every rank's state is a different shard" in lines[0]
    assert [f["checksum"] for f in job.finals()] == [r["checksum"] for r in ref]
    assert told(job)[0]["resume_step"] is None and per_rank(told(job)[0]["sources"]) == {"0": "disk", "1": "disk"}


# ---- 6. a second fault inside restore() ---------------------------------------------------------------
@pytest.mark.slow
def test_a_fault_inside_restore_leaves_the_next_cycle_live(launcher, tmp_path, references):
    """Rank 1 killed at step 137; in cycle 1 the new rank 1 dies inside restore() (while loading its
    objects): rank 0 already holds the state in its new objects, so cycle 2 recovers live at 136
    and the job ends exact."""
    ref = references.get(launcher, "1x2", ["--die-in-restore", 1])
    job = LiveJob(launcher, tmp_path, "1x2", job_args=BASE + ["--fail-at-step", FAULT, "--fail-rank", 1,
                                                              "--die-in-restore", 1], max_restarts=2)
    out, err = job.run()
    assert "dying inside restore() on purpose" in out
    finals = job.finals()
    assert [f["checksum"] for f in finals] == [r["checksum"] for r in ref] and finals[0]["cycle"] == 2, finals
    live = [t for t in told(job)]
    assert live[-1]["resume_step"] == FAULT - 1 and per_rank(live[-1]["sources"]) == {"0": "kept", "1": "peer 0"}, live
    assert all(t["resume_step"] is not None for t in live), live
    assert "no live state" not in err


# ---- 7. state a peer could not receive ------------------------------------------------------------------
@pytest.mark.slow
def test_an_unsendable_scheduler_is_refused_at_once_with_one_line(launcher, tmp_path):
    """LambdaLR over a callable object that holds a lambda: its state_dict() holds the lambda. The
    LiveState refuses it before training (one line naming where), the job trains on; the fault at
    step 17 falls back to the checkpoint, saying why, and ends exactly as the run without the fault,
    with dropout: the example restores the checkpoint's RNG state after the loaded loader's new
    iterator drew its seed from it (restored before, the dropout masks after step 10 differed)."""
    flags = ["--steps", 20, "--ckpt-every", 10, "--unsendable-scheduler", "--dropout", 0.2]
    ref = LiveJob(launcher, tmp_path / "reference", "1x2", job_args=flags)
    ref.run()
    job = LiveJob(launcher, tmp_path / "faulty", "1x2", job_args=flags + ["--fail-at-step", 17, "--fail-rank", 1])
    out, err = job.run()
    assert [f["checksum"] for f in job.finals()] == [f["checksum"] for f in ref.finals()]
    assert [f["loss"] for f in job.finals()] == [f["loss"] for f in ref.finals()]
    refused = [ln for ln in err.splitlines() if "refused:" in ln]
    assert len(refused) == 1, err[-3000:]
    assert "'scheduler' holds a function at ['lr_lambdas'][0]['curve']" in refused[0], refused
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if "no live state to resume from" in ln]
    assert len(lines) == 1 and "was refused on ranks 0, 1: 'scheduler' holds a function" in lines[0], lines
    assert "resumed from step 10 (checkpoint)" in out


# ---- 4. HSDP: the first node lost, the survivor moves up, a reserve node takes the last place -------------
HSDP_EXAMPLE = os.path.join(ROOT, "examples", "hsdp_train.py")


class HsdpReserveJob(Job):
    """hsdp_train.py on 3 agents x 2 ranks with --ft-active-world-size 4: two nodes train, the
    third waits as a warm reserve node. Node order (GROUP_RANK): the first agent started (it hosts
    the store) 1, the second 0, the reserve 2; when the second (ranks 0, 1) is lost, the first moves
    from ranks 2, 3 to 0, 1 and the reserve node takes 2, 3."""

    ORDER = {0: 1, 1: 0, 2: 2}

    def __init__(self, launcher, root, job_args):
        super().__init__(launcher, root, "2x2", ["--ft-rank-section-timeouts", "setup:60,step:60,checkpointing:60",
                                                 "--ft-active-world-size", 4])
        i = self.args.index(DDP_EXAMPLE)
        self.args = self.args[:i] + [HSDP_EXAMPLE] + [str(a) for a in job_args]
        self.args[self.args.index("--nnodes") + 1] = 3
        self.nodes = 3

    def group_rank(self, node):
        return self.ORDER[node]


def hsdp_final(out):
    return [ln.split("] ", 1)[-1] for ln in out.splitlines() if "FINAL" in ln]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["replicate,shard", "shard,replicate"])
def test_hsdp_the_first_node_lost_moves_the_survivor_and_it_keeps_or_falls_back_never_mixed(launcher, tmp_path,
                                                                                            mesh):
    """replicate,shard: a node holds one replica (both shards); the survivor's ranks move from 2, 3
    to 0, 1, where the mesh puts the same shards: they keep their state (in place), the reserve
    node's ranks heal from them. shard,replicate: a node holds both replicas of one shard; the lost
    node took all of shard 0 and the survivor's ranks (shard 1) now sit where shard 0 goes: no rank
    holds what ranks 0, 1 need, and every rank falls back (here: step 0) with one line. Both end
    with the fault-free run's model."""
    args = ["--steps", 100, "--mesh", mesh]
    ref = launcher.run(["--standalone", "--nproc-per-node", 4, "--log-dir", tmp_path / "ref", HSDP_EXAMPLE] + args,
                       timeout=200)
    assert ref.returncode == 0, ref.stderr[-3000:]
    job = HsdpReserveJob(launcher, tmp_path / "job", args + ["--step-time", 0.3]).launch()
    wait_for(lambda: len(read_events(job.logs, "reserve_ready")) >= 2, 120, "the reserve node's warm reserves")
    for proc in node_tree(job.agents[1].pid):   # the node of ranks 0, 1: its agent and ranks
        proc.kill()
    results, _ = job.wait(bound=300)
    assert results[0][0] == 0 and results[2][0] == 0, "\n".join(r[2][-3000:] for r in results)
    out = "".join(r[1] for r in results)
    err = "".join(r[2] for r in results)
    assert hsdp_final(out) == hsdp_final(ref.stdout) and len(hsdp_final(out)) == 1, (out[-2000:], ref.stdout[-500:])
    live = [e["detail"] for e in job.events() if e["kind"] == "live_recovery"]
    starts = [e["detail"] for e in job.events() if e["kind"] == "ranks_started" and e["cycle"] == 1]
    print(f"\n{live}\n{starts}")
    assert len(live) == 1, live
    moved = {r["rank"]: r["in_place"] for s in starts for r in s["ranks"]}
    assert moved[0] and moved[1] and not moved[2] and not moved[3], starts   # the survivor kept its processes
    if mesh == "replicate,shard":
        assert live[0]["resume_step"] is not None, live
        assert per_rank(live[0]["sources"])["0"] == per_rank(live[0]["sources"])["1"] == "kept", live
        assert {per_rank(live[0]["sources"])["2"], per_rank(live[0]["sources"])["3"]} == {"peer 0", "peer 1"}, live
        assert "no live state" not in err
    else:
        assert live[0]["resume_step"] is None and "no rank holds the shard ranks 0, 1 need" in live[0]["reason"], live
        lines = [ln for ln in err.splitlines() if "no live state to resume from" in ln]
        assert len(lines) == 1, lines


# ---- memory: 20 live recoveries with ~234 MB of model + AdamW state ------------------------------------
@pytest.mark.slow
def test_live_memory_twenty_recoveries_leave_a_kept_rank_within_1_1x_of_its_memory_before(launcher, tmp_path):
    """bench/live_train.py at width 3000 (19.5 M parameters: 234 MB of model + AdamW state), rank 1
    killed at the top of step 6 in cycles 0..19, rank 0 kept every time. Rank 0's RSS after the last
    step of cycle 20 is within 1.1x of its RSS after step 5 of cycle 0 (model, gradients and AdamW
    state all made); each restore's peak is printed. The model ends exact."""
    restarts, width = 20, 3000
    script = os.path.join(ROOT, "bench", "live_train.py")
    common = ["--width", width, "--steps", 8, "--ckpt-every", 100, "--batch", 8]
    ref = launcher.run(["--standalone", "--nproc-per-node", 2, "--log-dir", tmp_path / "ref", script] + common
                       + ["--ckpt-dir", tmp_path / "ref_ckpt", "--progress-dir", tmp_path / "ref_prog"], timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    expected = json.loads((tmp_path / "ref_ckpt" / "final.json").read_text())
    res = launcher.run(["--standalone", "--nproc-per-node", 2, "--max-restarts", restarts + 2, "--log-dir",
                        tmp_path / "logs", "--ft-max-no-progress-cycles", 0, "--ft-warm-reserves", 2, script] + common
                       + ["--live", "--kill-at-step", 6, "--kill-rank", 1, "--kill-cycles", restarts,
                          "--ckpt-dir", tmp_path / "ckpt", "--progress-dir", tmp_path / "prog"], timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    final = json.loads((tmp_path / "ckpt" / "final.json").read_text())
    assert final["checksum"] == expected["checksum"] and final["cycle"] == restarts, (final, expected)
    assert final["state_bytes"] >= 200e6, final
    told = [e["detail"] for e in read_events(str(tmp_path / "logs")) if e["kind"] == "live_recovery"]
    assert len(told) == restarts and all(per_rank(t["sources"]) == {"0": "kept", "1": "peer 0"} for t in told), told
    rss = {}
    with open(tmp_path / "prog" / "rss_rank_0.txt") as fh:
        for line in fh:
            cycle, step, value = map(int, line.split())
            rss[(cycle, step)] = value
    before, after = rss[(0, 5)], rss[(restarts, 8)]
    print(f"\nstate {final['state_bytes'] / 1e6:.0f} MB; rank 0 RSS {before / 2**20:.0f} MB before the first fault, "
          f"{after / 2**20:.0f} MB after {restarts} live recoveries ({after / before:.3f}x)")
    print("cycle  rss_before_restore_MB  restore_peak_MB")
    for cycle in range(1, restarts + 1):
        rec = json.loads((tmp_path / "prog" / f"restore_rank_0_cycle_{cycle}.json").read_text())
        print(f"{cycle:5d}  {rec['rss_before'] / 2**20:21.0f}  {rec['rss_peak'] / 2**20:15.0f}")
    assert after <= 1.1 * before, f"rank 0's RSS grew: {before / 2**20:.0f} -> {after / 2**20:.0f} MB"


# ---- 8. issue 39: one cycle's evidence only; the end of ranks restarted in place -------------------
SHORT = ["--steps", 30, "--ckpt-every", 50]   # no checkpoint before the end: a fallback would train from step 0


@pytest.mark.slow
def test_a_hang_in_the_cycle_after_an_in_place_restart_blames_the_rank_that_hung(launcher, tmp_path, references):
    """1 agent x 3 ranks, in place, LiveState: rank 1 raises after the commit of step 12 (cycle 0;
    the three stay in their processes, rank 1 heals from a peer); in cycle 1 rank 0 hangs after the
    commit of step 20 and ranks 1, 2 wait in step 21's all-reduce. The ranks' flight-recorder dumps
    hold cycle 1's collectives only (issue 39: cycle 0's unfinished all_reduce, missing rank 1, was in
    them, and all three ranks were stopped and trained again from step 0): the hang blame names rank
    0, ranks 1 and 2 keep their processes and state (resume at 20), rank 0 heals from a peer, the
    model is exact. The failure of cycle 1 names rank 0 and carries no exception of cycle 0. The run
    ends with a closing all_gather_object, DDP alive (the short form of the twenty 2 x 2 runs below:
    every rank restarted in place ends by itself)."""
    ref = references.get(launcher, "1x3", SHORT)
    job = LiveJob(launcher, tmp_path, "1x3", ["--ft-rank-section-timeouts", "setup:30,step:3,checkpointing:30"],
                  job_args=SHORT + ["--raise-at-step", 12, "--fail-rank", 1, "--hang-at-step", 20, "--hang-rank", 0,
                                    "--hang-cycle", 1, "--gather-at-end"], max_restarts=2)
    out, err = job.run()
    assert "GATHERED 1 distinct checksum(s) of 3 ranks" in out, out[-2000:]
    finals = job.finals()
    assert [f["checksum"] for f in finals] == [r["checksum"] for r in ref], (finals, ref)
    evs = job.events()
    blame = [e["detail"] for e in evs if e["kind"] == "hang_blame"]
    assert len(blame) == 1 and (blame[0]["culprits"], blame[0]["victims"]) == ([0], [1, 2]), blame
    assert blame[0]["evidence"] == "flight recorder", blame
    failures = [e for e in evs if e["kind"] == "failure"]
    assert [(e["cycle"], e["rank"]) for e in failures] == [(0, 1), (1, 0)], failures
    assert "simulated exception" not in str(failures[1]["detail"].get("error")), failures[1]
    fr = [e["detail"] for e in evs if e["kind"] == "flight_recorder" and e["cycle"] == 1]
    assert fr and set(fr[0]["waiting"]) == {"1", "2"}, fr   # the victims of cycle 1, not rank 0 waiting in cycle 0's
    c0, c1, c2 = started(evs, 0), started(evs, 1), started(evs, 2)
    assert all(c1[r] == (c0[r][0], True) for r in range(3)), (c0, c1)
    assert all(c2[r] == (c0[r][0], True) for r in (1, 2)) and c2[0][0] != c0[0][0], (c0, c2)
    live = told(job)
    assert [t["resume_step"] for t in live] == [12, 20], live
    sources = per_rank(live[1]["sources"])
    assert sources["1"] == sources["2"] == "kept" and sources["0"].startswith("peer "), live
    for rank in (1, 2):   # no step from 0 again
        assert [s for c, s, _ in progress(job.prog, rank) if c == 2] == list(range(21, 31)), rank


@pytest.mark.slow
@pytest.mark.timeout(900)   # twenty 2 x 2 jobs, ~25 s each on 2 cores
def test_twenty_2x2_runs_that_end_with_a_gather_after_an_in_place_recovery_all_end(launcher, tmp_path, references):
    """Issue 39: DDP 2 x 2, rank 3 killed at the top of step 20 (the other three restart in place),
    the run ends with all_gather_object and destroy_process_group(), DDP alive: a rank restarted in
    place once never exited (the Reducer freed the gloo group, the group's worker waited for the
    GIL). Twenty runs, each ends by itself, exact, no teardown_hang."""
    ref = references.get(launcher, "2x2", SHORT)
    for run in range(20):
        job = LiveJob(launcher, tmp_path / f"run{run}", "2x2",
                      job_args=SHORT + ["--fail-at-step", 20, "--fail-rank", 3, "--gather-at-end"])
        job.run()
        assert [f["checksum"] for f in job.finals()] == [r["checksum"] for r in ref], run
        evs = job.events()
        assert not [e for e in evs if e["kind"] == "teardown_hang"], run
        assert any(r[1] for r in started(evs, 1).values()), run   # some ranks restarted in place


@pytest.mark.slow
def test_a_rank_that_hangs_after_its_last_step_is_ended_within_the_grace(launcher, tmp_path):
    """1 agent x 2 ranks; rank 1 sleeps for ever after its last step, outside any section, while
    rank 0 exits 0. With teardown_hang_grace 2 s the agent dumps its stack, ends it, says so in one
    line, and the job ends as finished (exit 0)."""
    job = LiveJob(launcher, tmp_path, "1x2", ["--ft-teardown-hang-grace", 2],
                  job_args=["--steps", 6, "--ckpt-every", 50, "--linger-rank", 1])
    job.launch()
    results, elapsed = job.wait(bound=60)
    assert [code for code, _, _ in results] == [0], results[0][2][-3000:]
    err = results[0][2]
    lines = [ln for ln in err.splitlines() if "hung in its teardown" in ln]
    assert len(lines) == 1 and "rank 1" in lines[0] and "stack dump:" in lines[0], err[-3000:]
    evs = job.events()
    hung = [e for e in evs if e["kind"] == "teardown_hang"]
    assert len(hung) == 1 and hung[0]["rank"] == 1 and 2 <= hung[0]["detail"]["idle"] < 4, hung
    assert os.path.getsize(hung[0]["detail"]["stack_file"]) > 0
    assert "at_end" in open(hung[0]["detail"]["stack_file"]).read()   # the dump shows where it hung
    exits = {e["rank"]: e["detail"] for e in evs if e["kind"] == "rank_exit"}
    assert exits[0]["exitcode"] == 0 and exits[1].get("teardown_hang"), exits
    assert [e for e in evs if e["kind"] == "job_complete"] and not [e for e in evs if e["kind"] == "failure"]
    ends = [e["time"] for e in evs if e["kind"] in ("rank_exit", "job_complete")]
    assert max(ends) - min(ends) < 8, ends   # ended within the grace (plus the dump), not an hour later
