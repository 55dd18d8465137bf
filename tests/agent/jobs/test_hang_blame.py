"""Hang blame end to end (agent/recovery.hang_blame.py): one rank hangs, its peers wait on it in a collective
and their monitors fire too; the agents tell culprit from victims and only the culprit is replaced.
HSDP (examples/hsdp_train.py, 2 agents x 2 ranks, mesh replicate 2 x shard 2): rank 3 hangs before
its shard reduce_scatter, its shard peer waits in that reduce_scatter and its replica peers in the
replicate all_reduce: the flight recorder's sequence numbers, compared within each process group,
name rank 3 alone, and the victims keep their live state (slow).

examples/ddp_train.py under `ft.restartable`, real agents, monitors and ranks (tests/harness.py's
Job). The hang: rank `--fail-rank` sleeps for an hour in a phase (ddp_train --hang-in), or the
test SIGSTOPs it while it steps. Then:
- the job ends with exactly the model of a fault-free run, after one in-place restart;
- every victim kept its process (cycle 1 reports it in place with its cycle-0 pid), the culprit's
  slot got a new process;
- one `hang_blame` event names the culprit, the victims and the evidence that decided;
- the failure line, and the report's incident, name the culprit and say the others were waiting on it.
"""
import contextlib
import os
import signal
import subprocess
import time

import pytest

from conftest import ROOT, SCRIPTS, wait_for
from harness import HOLD_STEP, Job, monitored_ranks, progress, started

T = 3.0
TIMEOUTS = ["--ft-rank-section-timeouts", f"setup:15,step:{T:g},checkpointing:{T:g}"]


def run_hang(launcher, tmp_path, topology, how, phase, env=None):
    culprit = 1 if topology == "1x2" else 3
    job_args = ["--restartable", "--fail-rank", culprit]
    if phase == "step":   # a step without a checkpoint after it: the victims wait in DDP's all-reduce
        job_args += ["--hold-step", HOLD_STEP + 1]
    if how == "sleep":
        job_args += ["--hang-in", phase]
    job = Job(launcher, tmp_path, topology, TIMEOUTS, job_args)
    if env:
        job.pet = dict(env, GROUP_RANK="0") if job.nodes == 1 else None
        assert job.nodes == 1, "env only for 1x2 here"
    job.launch()
    if how == "sigstop":   # stopped wherever it is inside a step after the held one
        wait_for(lambda: any(c == 0 and s >= HOLD_STEP + 2 for c, s, _ in progress(job.prog, culprit)), 90,
                 f"rank {culprit} stepping", interval=0.01)
        pid = started(job.events(), 0)[culprit][0]
        os.kill(pid, signal.SIGSTOP)
    return job, culprit


def check_blame(job, reference, culprit, evidence):
    results, elapsed = job.wait()
    errors = "\n".join(r[2][-4000:] for r in results)
    assert all(code == 0 for code, _, _ in results), errors
    assert job.final()["checksum"] == reference.checksum(job.topology), "the restart changed the model"
    evs = job.events()
    restarts = [e for e in evs if e["kind"] == "restart"]
    assert restarts and {(e["detail"]["rung"], e["detail"]["next_cycle"]) for e in restarts} == {("in_process", 1)}
    victims = [r for r in range(job.world) if r != culprit]
    before, after = started(evs, 0), started(evs, 1)
    for rank in victims:
        assert after[rank] == (before[rank][0], True), f"victim {rank} did not keep its process: {before} -> {after}"
    assert after[culprit][0] != before[culprit][0] and not after[culprit][1], after
    blame = [e for e in evs if e["kind"] == "hang_blame"]
    assert len(blame) == 1, blame
    d = blame[0]["detail"]
    assert d["culprits"] == [culprit] and d["victims"] == victims and d["evidence"] == evidence, d
    failure = [e for e in evs if e["kind"] == "failure"][0]
    assert failure["rank"] == culprit
    assert "waiting on it" in failure["detail"]["what"], failure
    assert any("waiting on it" in err for _, _, err in results)
    # the report's incident names the culprit and says the others were waiting on it
    from ft_launcher import report

    incidents = report.analyse([str(job.logs)], *report.load([str(job.logs)])).incidents
    assert len(incidents) == 1 and incidents[0].rank == culprit, incidents
    waiting = f"{'s' if len(victims) > 1 else ''} {', '.join(map(str, victims))} {'were' if len(victims) > 1 else 'was'}"
    assert incidents[0].what.startswith(f"rank {culprit} hung") and f"; rank{waiting} waiting on it" in incidents[0].what, \
        incidents[0].what
    hangs = {e["rank"] for e in evs if e["kind"] == "hang" and e["cycle"] == 0}
    print(f"\n{job.topology}: monitors fired for {sorted(hangs)}; {d}; {elapsed:.1f}s")
    return evs, hangs


def _cases():
    default = {("sleep", "step", "1x2")}
    for how, phase, topology in [("sleep", "step", "1x2"), ("sleep", "step", "2x2"), ("sigstop", "step", "1x2"),
                                 ("sigstop", "step", "2x2"), ("sleep", "checkpointing", "1x2"),
                                 ("sleep", "checkpointing", "2x2")]:
        marks = () if (how, phase, topology) in default else (pytest.mark.slow,)
        yield pytest.param(how, phase, topology, marks=marks, id=f"{how}-{phase}-{topology}")


@pytest.mark.parametrize("how,phase,topology", list(_cases()))
def test_only_the_rank_that_hung_is_replaced(launcher, tmp_path, reference, how, phase, topology):
    job, culprit = run_hang(launcher, tmp_path, topology, how, phase)
    evs, hangs = check_blame(job, reference, culprit, "flight recorder")
    if how == "sleep" and phase == "step":
        # the victims' monitors fired too (they entered the next step ~20 ms after the culprit
        # began to sleep, well inside the time the dumps take): they were released, not killed
        assert len(hangs) >= 2, hangs


@pytest.mark.slow
def test_without_the_flight_recorder_the_stacks_decide(launcher, tmp_path, reference):
    job, culprit = run_hang(launcher, tmp_path, "1x2", "sleep", "step", env={"TORCH_FR_BUFFER_SIZE": "0"})
    check_blame(job, reference, culprit, "stacks")


@pytest.mark.slow
def test_a_hang_in_setup_is_told_by_the_stacks(launcher, tmp_path, reference):
    # before init_process_group completes there is no collective to record: the victims' stacks
    # wait inside torch.distributed (the rendezvous), the culprit's does not
    job, culprit = run_hang(launcher, tmp_path, "1x2", "sleep", "setup")
    check_blame(job, reference, culprit, "stacks")


HSDP = os.path.join(ROOT, "examples", "hsdp_train.py")


@pytest.mark.slow
def test_an_hsdp_hang_in_the_shard_group_blames_the_rank_that_hung_and_the_victims_keep_their_state(
        launcher, tmp_path):
    """Rank 3 (replica 1, shard 1) hangs before the shard reduce_scatter of step 17: rank 2 waits on
    it in the shard group, rank 0 on rank 2 and rank 1 on rank 3 in the replicate groups. The verdict
    names rank 3 alone; ranks 0-2 keep their processes and their state (resume at step 16, rank 3
    from rank 1, its shard in the other replica); the job ends with the fault-free run's parameters."""
    def job(name, extra):
        j = Job(launcher, tmp_path / name, "2x2", TIMEOUTS)
        j.args = j.args[:j.args.index(TIMEOUTS[0])] + TIMEOUTS + [HSDP, "--steps", 30] + extra
        return j

    clean = job("clean", []).launch()
    results, _ = clean.wait()
    assert all(code == 0 for code, _, _ in results), results[0][2][-3000:]
    final = [ln for _, out, _ in results for ln in out.splitlines() if "FINAL" in ln]
    fault = job("fault", ["--fail-at-step", 17, "--fail-rank", 3, "--fail-in", "reduce_scatter"]).launch()
    results, elapsed = fault.wait()
    errors = "\n".join(r[2][-4000:] for r in results)
    assert all(code == 0 for code, _, _ in results), errors
    assert [ln for _, out, _ in results for ln in out.splitlines() if "FINAL" in ln] == final and len(final) == 1
    evs = fault.events()
    blame = [e["detail"] for e in evs if e["kind"] == "hang_blame"]
    assert len(blame) == 1, blame
    assert (blame[0]["culprits"], blame[0]["victims"], blame[0]["evidence"]) == ([3], [0, 1, 2], "flight recorder"), \
        blame
    restarts = [e["detail"] for e in evs if e["kind"] == "restart"]
    assert {(r["rung"], r["next_cycle"]) for r in restarts} == {("in_process", 1)}, restarts
    before, after = started(evs, 0), started(evs, 1)
    for rank in (0, 1, 2):
        assert after[rank] == (before[rank][0], True), f"victim {rank} did not keep its process: {before} -> {after}"
    told = [e["detail"] for e in evs if e["kind"] == "live_recovery"]
    assert len(told) == 1 and told[0]["resume_step"] == 16, told
    from ft_launcher.agent.observation.live_recovery import per_rank

    assert per_rank(told[0]["sources"]) == {"0": "kept", "1": "kept", "2": "kept", "3": "peer 1"}, told
    print(f"\nHSDP 2x2: {blame[0]}; {elapsed:.1f}s")


# ---- the monitor's hold, without an agent's verdict ------------------------------------------
@contextlib.contextmanager
def _held_rank(launcher, tmp_path, monkeypatch):
    """A monitor with hang blame on (no agent: the test holds its channel) and a rank that hangs in
    'step' (1 s timeout): yields (handle, rank process, monotonic time of the hang report)."""
    from ft_launcher.rank_monitor.config import FaultToleranceConfig
    from ft_launcher.rank_monitor.shm_layout import ENV_HANG_VERDICT

    monkeypatch.setenv(ENV_HANG_VERDICT, "1")
    cfg = FaultToleranceConfig()
    cfg.rank_section_timeouts = {"setup": 20.0, "step": 1.0, "checkpointing": 20.0}
    (tmp_path / "out").mkdir()
    hangs = [os.path.join(SCRIPTS, "monitored_rank.py"), tmp_path / "out", "--fault", "step", "--rank", "0"]
    with monitored_ranks(launcher, tmp_path / "run", [hangs], cfg) as ([handle], [rank]):
        reports = []
        wait_for(lambda: reports.extend(handle.read_reports()) or any(r.get("kind") == "hang" for r in reports),
                 30, "the hang report", interval=0.005)
        yield handle, rank.proc, time.monotonic()


def test_a_held_rank_is_stopped_when_no_verdict_comes(launcher, tmp_path, monkeypatch):
    from ft_launcher.rank_monitor.monitor_side.server import VERDICT_HOLD

    with _held_rank(launcher, tmp_path, monkeypatch) as (handle, rank, reported):
        rank.wait(timeout=10)
        held = time.monotonic() - reported
        assert VERDICT_HOLD - 0.2 <= held <= VERDICT_HOLD + 0.5, held   # held for a verdict, then stopped


def test_a_released_rank_is_left_alone_and_an_agent_gone_stops_a_held_one(launcher, tmp_path, monkeypatch):
    with _held_rank(launcher, tmp_path, monkeypatch) as (handle, rank, _):
        handle.hang_verdict(rank.pid, kill=False)
        with pytest.raises(subprocess.TimeoutExpired):
            rank.wait(timeout=2.5)   # well past the hold: released, the monitor does not stop it
    # the held process restarted in place for the next cycle: that hang's cycle is over, it is released
    (tmp_path / "c").mkdir()
    with _held_rank(launcher, tmp_path / "c", monkeypatch) as (handle, rank, _):
        handle.rank_started(rank.pid, 0, 1, time.monotonic_ns())
        handle.rank_stopped()   # (this rank is still in its step: the test stops watching its cycle 1)
        with pytest.raises(subprocess.TimeoutExpired):
            rank.wait(timeout=2.5)   # past the hold: the stale hang stops nothing
    # a monitor whose agent is gone stops the rank it holds at once, verdict or not
    (tmp_path / "b").mkdir()
    with _held_rank(launcher, tmp_path / "b", monkeypatch) as (handle, rank, reported):
        handle.stop()
        rank.wait(timeout=5)
        assert time.monotonic() - reported < 0.6


# ---- the evidence, as pure functions ---------------------------------------------------------
def _dump(seqs, pending=None, ranks="[0, 1, 2]", group=("0", "default_pg")):
    import pickle

    entries = [{"process_group": group, "collective_seq_id": s, "profiling_name": "gloo:all_reduce",
                "state": "scheduled", "retired": s != pending, "is_p2p": False} for s in seqs]
    return pickle.dumps({"pg_config": {group[0]: {"name": group[0], "ranks": ranks}}, "entries": entries})


def test_the_flight_recorder_blames_the_ranks_that_never_entered_the_stuck_collective():
    from ft_launcher.agent.recovery.hang_blame import from_flight_recorder

    dumps = {0: _dump([4, 5], pending=5), 1: _dump([4]), 2: _dump([4, 5], pending=5)}
    found = from_flight_recorder(dumps, 3)
    assert (found["culprits"], found["victims"], found["sequence"]) == ([1], [0, 2], 5)
    # a rank without a dump (stopped) never entered it either
    found = from_flight_recorder({0: _dump([4, 5], pending=5), 2: _dump([4, 5], pending=5)}, 3)
    assert found["culprits"] == [1]
    # nothing pending, or everyone in it: no finding
    assert from_flight_recorder({0: _dump([4]), 1: _dump([4])}, 2) is None
    assert from_flight_recorder({0: _dump([5], 5, "[0, 1]"), 1: _dump([5], 5, "[0, 1]")}, 2) is None
    assert from_flight_recorder({0: b"not a pickle"}, 2) is None


def _mesh_dump(rank, entered, pending=None, config=True, at=100):
    """A gloo HSDP 2x2 dump as torch 2.13 writes it (with our pg_config, unless config=False):
    `entered` {group: last sequence}, `pending` the group whose last collective is not retired
    (created at `at`).
    Groups as init_device_mesh names them: '1' = replicate {0, 2}, '2' = replicate {1, 3},
    '3' = shard {0, 1}, '4' = shard {2, 3}."""
    import json
    import pickle

    groups = {"0": ("default_pg", [0, 1, 2, 3]), "1": ("mesh_replicate", [0, 2]), "2": ("mesh_replicate", [1, 3]),
              "3": ("mesh_shard", [0, 1]), "4": ("mesh_shard", [2, 3])}
    mine = {name: g for name, g in groups.items() if rank in g[1]}
    entries = []
    for name, last in entered.items():
        for seq in range(1, last + 1):
            entries.append({"process_group": (name, mine[name][0]), "pg_id": int(name), "collective_seq_id": seq,
                            "profiling_name": "gloo:all_reduce", "state": "scheduled", "is_p2p": False,
                            "retired": not (name == pending and seq == last),
                            "time_created_ns": at if name == pending and seq == last else seq})
    cfg = ({name: {"name": name, "desc": d, "ranks": json.dumps(r)} for name, (d, r) in mine.items()} if config
           else {"": {"name": "", "desc": "", "ranks": "[]"}})
    return pickle.dumps({"version": "2.10", "pg_config": cfg, "entries": entries})


def test_sequence_numbers_are_compared_within_each_process_group():
    """HSDP 2x2, rank 3 hung before the shard reduce_scatter of a step: rank 2 waits in the shard
    group on rank 3; ranks 0 and 1 did their shard group's reduce_scatter and wait in the replicate
    all_reduce, on ranks 2 and 3. Sequence numbers differ between groups (a step runs more shard
    collectives than replicate ones): compared across groups they blamed rank 2, or ranks 0, 2, 3."""
    from ft_launcher.agent.recovery.hang_blame import from_flight_recorder

    dumps = {0: _mesh_dump(0, {"0": 1, "3": 9, "1": 4}, pending="1", at=102),
             1: _mesh_dump(1, {"0": 1, "3": 9, "2": 4}, pending="2", at=101),
             2: _mesh_dump(2, {"0": 1, "4": 9, "1": 3}, pending="4"),
             3: _mesh_dump(3, {"0": 1, "4": 8, "2": 3})}
    found = from_flight_recorder(dumps, 4)
    assert (found["culprits"], found["victims"]) == ([3], [0, 1, 2]), found
    assert found["group"] == "4:mesh_shard" and found["sequence"] == 9, found   # the oldest wait on rank 3
    # rank 3 could not dump (stopped): it entered nothing, and is still the one the waits lead to
    assert from_flight_recorder({r: dumps[r] for r in (0, 1, 2)}, 4)["culprits"] == [3]
    # without our pg_config (a rank not running our client), the groups' members are who recorded them
    bare = {r: _mesh_dump(r, *args, config=False) for r, args in
            ((0, ({"0": 1, "3": 9, "1": 4}, "1")), (1, ({"0": 1, "3": 9, "2": 4}, "2")),
             (2, ({"0": 1, "4": 9, "1": 3}, "4")), (3, ({"0": 1, "4": 8, "2": 3}, None)))}
    assert from_flight_recorder(bare, 4)["culprits"] == [3]
    # waits in a circle (rank 0 on rank 1 in one group, rank 1 on rank 0 in another): nobody is blamed
    import pickle

    def two_groups(a, b, pending):
        entries = [{"process_group": (g, "x"), "collective_seq_id": seq, "profiling_name": "gloo:all_reduce",
                    "state": "scheduled", "is_p2p": False, "retired": not (g == pending and seq == last)}
                   for g, last in (("a", a), ("b", b)) for seq in range(1, last + 1)]
        return pickle.dumps({"pg_config": {g: {"name": g, "desc": "x", "ranks": "[0, 1]"} for g in "ab"},
                             "entries": entries})

    assert from_flight_recorder({0: two_groups(2, 1, "a"), 1: two_groups(1, 2, "b")}, 2) is None
    assert from_flight_recorder({0: two_groups(2, 1, "a"), 1: two_groups(1, 1, None)}, 2)["culprits"] == [1]


def test_a_dump_that_is_not_plain_data_is_never_unpickled():
    """A dump comes from a peer through the store: a pickle naming a callable is refused, not run."""
    import pickle

    from ft_launcher.agent.recovery.hang_blame import from_flight_recorder
    from ft_launcher.rank_monitor.flight_recorder import load_trace

    class Boom:
        def __reduce__(self):
            return (os.system, ("echo pwned > /dev/null",))

    hostile = pickle.dumps({"entries": [Boom()]})
    assert load_trace(hostile) is None and load_trace(b"junk") is None
    assert load_trace(_dump([4])) is not None
    found = from_flight_recorder({0: _dump([4, 5], pending=5), 1: hostile, 2: _dump([4, 5], pending=5)}, 3)
    assert found["culprits"] == [1]   # the hostile dump counts as no dump


def test_a_stack_waits_inside_a_collective_or_not():
    from ft_launcher.agent.recovery.hang_blame import stack_waits

    def dump(*frames):
        return ('Thread 0x1 (most recent call first):\n  File "/x/rank_monitor/flight_recorder.py", line 89 in _serve\n\n'
                "Current thread 0x2 (most recent call first):\n"
                + "".join(f'  File "{f}", line 1 in {fn}\n' for f, fn in frames) + "\n")

    assert stack_waits(dump(("/v/torch/distributed/distributed_c10d.py", "all_reduce"), ("/t/train.py", "main")))
    assert stack_waits(dump(("/v/torch/autograd/graph.py", "_engine_run_backward"), ("/t/train.py", "main")))
    assert stack_waits(dump(("/t/train.py", "at"), ("/t/train.py", "main"))) is False
    assert stack_waits("") is None and stack_waits("no frames") is None


def test_the_report_names_the_rank_that_hung_even_when_a_victims_monitor_fired_first():
    """The incident row of a hang the blame decided: the culprit (also one its agent killed
    before its own monitor fired, so only a victim's hang was reported), and who waited on it."""
    from ft_launcher import report

    def ev(t, kind, rank=None, cycle=0, **detail):
        return {"time": 1000.0 + t, "node": "n0", "rank": rank, "cycle": cycle, "kind": kind, "detail": detail}

    hang0 = ev(3.0, "hang", 0, section="step", elapsed=2.0, timeout=2.0)
    blame = ev(3.5, "hang_blame", culprits=[1], victims=[0], evidence="stacks")
    restart = ev(3.7, "restart", next_cycle=1, restarts_used=1, rung="in_process", replace_ranks=[],
                 replace_nodes=[])
    for failure, what, hangs in (
            (ev(3.6, "failure", 1, what="rank 1 hung and was killed by its agent", exitcode=-9,
                hang_blame={"culprits": [1], "victims": [0]}),
             "rank 1 hung (killed by its agent on the hang blame before its monitor fired)", [hang0]),
            (ev(3.6, "failure", 1, what="rank 1 hung in section 'step'", exitcode=-9, hang={"rank": 1}),
             "rank 1 hung in section 'step'", [hang0, ev(3.1, "hang", 1, section="step", elapsed=2.1, timeout=2.0)])):
        events = [ev(0, "cycle_start", world_size=2), *hangs, blame, failure, restart,
                  ev(3.8, "cycle_start", cycle=1, world_size=2), ev(4.0, "stepping", cycle=1)]
        inc = report.analyse(["x"], sorted(events, key=lambda e: e["time"]), [], []).incidents[0]
        assert inc.rank == 1, inc
        assert inc.what == what + ("; rank 0 was waiting on it (stack dumps: the waiting ranks are inside a collective, "
                                   "the hung are not)"), inc.what
    # the verdict without evidence blames nobody: the first hang, as before
    nobody = ev(3.5, "hang_blame", culprits=[], victims=[], evidence="none")
    events = [ev(0, "cycle_start", world_size=2), hang0, nobody,
              ev(3.6, "failure", 0, what="rank 0 hung", exitcode=-15, hang={"rank": 0}), restart]
    inc = report.analyse(["x"], events, [], []).incidents[0]
    assert inc.rank == 0 and inc.what == "rank 0 hung in section 'step'", inc.what
