"""The job outlives the node hosting its store (agent/rounds.store_failover.py), with real agents on one
machine sharing a rendezvous and a log dir.

By default, with a rank that does not import torch (tests/scripts/cycle_sleeper.py):
- 3 agents, --nnodes 2:3: two run ranks, the third waits as a hot spare; the store host is
  SIGKILLed with its whole process tree. The survivor and the spare fail over to the successor
  store (the survivor, first in order, on rdzv port + 1) and finish cycle 1: exit 0.
- 2 agents, --nnodes 2: the survivor cannot go on; it exits 1 within a bound with one line.
- the policy's history outlives the store host (ranks of tests/scripts/cycle_plan.py): a job that
  failed the same way twice before the loss stops at the same failure after it (93); slow: the
  same for cycles without progress. Exactly what a failover carries: tests/agent/unit/test_store_keys.py.
Slow (the example DDP job, tests/harness.py's Job, checked against a fault-free run):
- the same SIGKILL mid-training ends with exactly the model of a fault-free run; the time from
  the kill to every rank stepping again is printed;
- split brain: the store host and its ranks are paused (SIGSTOP) instead; the others fail over,
  and when the old host resumes it finds the successor and stops its ranks (exit 1).
"""
import os
import signal
import socket
import time

import psutil
import pytest

from conftest import SCRIPTS, node_tree, read_events, wait_for
from harness import HOLD_STEP, STEPS, Job, SleeperJob, await_spare, paused, progress, sleepers_with_spare

FAILOVER_TO_STEPPING = 6.0  # goal: store host SIGKILL -> every remaining rank stepping again
HOLD = 40.0                 # cycle 0 holds step HOLD_STEP this long: the faults land inside it
TIMEOUTS = ["--ft-rank-section-timeouts", f"setup:60,step:{HOLD + 10:g},checkpointing:60"]


_tree = node_tree   # a node's processes, its orphan watchdog spared (conftest)


def _with_spare(launcher, tmp_path, script_args=()):
    """Two trainers and a hot spare; agent 0 (order 0) hosts the store."""
    job = Job(launcher, tmp_path, "2x2", TIMEOUTS, ["--hold", f"step:{HOLD}", *script_args], max_restarts=2)
    job.args[job.args.index("--nnodes") + 1] = "2:3"
    job.launch()
    wait_for(lambda: all(any(s == HOLD_STEP - 1 for c, s, _ in progress(job.prog, r)) for r in range(4)),
             60, "two nodes to train")
    job.launch_agent(2)
    await_spare(job.logs)
    return job


def _stepping_again(job, after_cycle):
    """The time each of the 4 ranks first stepped in a cycle after `after_cycle`, or None."""
    firsts = []
    for rank in range(4):
        times = [t for c, s, t in progress(job.prog, rank) if c > after_cycle]
        if not times:
            return None
        firsts.append(min(times))
    return firsts


def _reserves_ready(job):
    """The survivor (node 1) and the spare each have a warm reserve per local rank."""
    ready = read_events(job.logs, "reserve_ready")
    spare = read_events(job.logs, "spare_waiting")[0]["node"]
    return all(len({e["detail"]["local_rank"] for e in ready if e["node"] == node}) == 2 for node in (1, spare))


def _kill_the_host_and_wait_for_the_others(job):
    """SIGKILL agent 0 (the store host) with its processes; the other agents' stderr once they end."""
    for proc in _tree(job.agents[0].pid):
        proc.kill()
    outs = []
    for proc in job.agents[1:]:
        _, err = proc.communicate(timeout=60)
        outs.append(err)
    job.agents[0].communicate()
    return outs


@pytest.mark.slow
def test_a_successor_that_cannot_host_is_skipped_and_everyone_reaches_the_next(launcher, tmp_path):
    # The first successor's port (rdzv port + 1) is the local port of another connection: it
    # cannot host, and moves on at once. The spare, next in order, waits its window for it, then
    # hosts on port + 2; the first successor must still be waiting for the spare then (CI: it gave
    # up on the spare exactly when the spare started hosting, and both exited 1).
    job = sleepers_with_spare(launcher, tmp_path)
    with socket.socket() as listener, socket.socket() as taken:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        taken.bind(("127.0.0.1", job.port + 1))
        taken.connect(listener.getsockname())
        outs = _kill_the_host_and_wait_for_the_others(job)
    assert [p.returncode for p in job.agents[1:]] == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert f"cannot host the successor store on port {job.port + 1}" in outs[0], outs[0][-3000:]
    failovers = read_events(job.logs, "store_failover")
    assert {(e["detail"]["port"], e["detail"]["generation"]) for e in failovers} == {(job.port + 2, 2)}, failovers
    assert sorted(e["detail"]["hosted_here"] for e in failovers) == [False, True], failovers


def test_store_host_sigkilled_the_survivor_and_the_spare_go_on(launcher, tmp_path):
    job = sleepers_with_spare(launcher, tmp_path)
    killed_at = time.time()
    outs = _kill_the_host_and_wait_for_the_others(job)
    assert [p.returncode for p in job.agents[1:]] == [0, 0], "\n".join(o[-3000:] for o in outs)
    restarted = [min(t for c, t in job.rows(rank) if c == 1) for rank in (0, 1)]
    print(f"\nstore host SIGKILL -> both ranks of cycle 1 started: {max(restarted) - killed_at:.2f}s")
    failovers = read_events(job.logs, "store_failover")
    assert sorted(e["detail"]["hosted_here"] for e in failovers) == [False, True], failovers
    assert {(e["detail"]["port"], e["detail"]["generation"]) for e in failovers} == {(job.port + 1, 1)}
    assert "generation 1 of the store at" in outs[0] and "(hosted here)" in outs[0], outs[0][-3000:]
    assert "(restart 1/1)" in outs[1], outs[1][-3000:]


@pytest.mark.slow   # long (10-40 s); the default suite keeps a shorter test of the same path
def test_store_host_paused_for_good_the_survivors_end_with_their_own_code(launcher, tmp_path):
    """The store host is paused (SIGSTOP) and stays paused: the survivor and the spare fail over
    and finish. Their first watcher is still inside a torch store call to the paused host, which
    never returns; the agent used to abort at interpreter exit (SIGABRT, 'terminate called
    without an active exception') instead of exiting 0."""
    job = sleepers_with_spare(launcher, tmp_path)
    host = _tree(job.agents[0].pid)
    for proc in host:
        proc.send_signal(signal.SIGSTOP)
    try:
        outs = []
        for proc in job.agents[1:]:
            _, err = proc.communicate(timeout=60)
            outs.append(err)
    finally:
        for proc in host:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        job.agents[0].communicate()
    assert [p.returncode for p in job.agents[1:]] == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert not any("terminate called" in o for o in outs), "\n".join(o[-3000:] for o in outs)
    assert len(read_events(job.logs, "store_failover")) == 2


@pytest.mark.slow
def test_store_host_sigkilled_the_job_fails_over_and_ends_exactly(launcher, tmp_path, reference):
    expected = reference.checksum("2x2")
    job = _with_spare(launcher, tmp_path)
    host = job.agents[0]
    wait_for(lambda: _reserves_ready(job), 40, "warm reserves on the survivor and the spare")
    killed_at = time.time()
    for proc in _tree(host.pid):   # the node dies: agent, monitors, ranks, reserves at once
        proc.kill()
    results, _ = job.wait(bound=150)
    codes = [code for code, _, _ in results]
    assert codes[1:] == [0, 0], "\n".join(r[2][-3000:] for r in results)
    final = job.final()
    assert final["step"] == STEPS and final["world_size"] == 4 and final["cycle"] == 1, final
    assert final["checksum"] == expected, "the resumed run differs from the fault-free run"
    firsts = _stepping_again(job, 0)
    assert firsts, "not every rank stepped after the failover"
    took = max(firsts) - killed_at
    evs = job.events()
    started = max(e["time"] for e in evs if e["kind"] == "ranks_started" and e["cycle"] == 1)
    warm = [r["warm"] for e in evs if e["kind"] == "ranks_started" and e["cycle"] == 1 for r in e["detail"]["ranks"]]
    print(f"\nstore host SIGKILL -> every remaining rank stepping again: {took:.2f}s "
          f"(goal <= {FAILOVER_TO_STEPPING:g}s); of which kill -> new ranks started (failover and "
          f"rendezvous): {started - killed_at:.2f}s; {warm.count(True)} of 4 ranks from warm reserves")
    failovers = [e for e in evs if e["kind"] == "store_failover"]
    assert len(failovers) == 2 and {e["detail"]["generation"] for e in failovers} == {1}, failovers
    assert [e["detail"]["hosted_here"] for e in failovers].count(True) == 1, failovers
    assert {e["detail"]["port"] for e in failovers} == {job.port + 1}, failovers
    starts = [e for e in evs if e["kind"] == "cycle_start" and e["cycle"] == 1]
    assert len(starts) == 2 and all("restart 1/2" in "".join(r[2] for r in results[1:]) for _ in starts)
    assert "Traceback" not in "".join(line for r in results[1:] for line in r[2].splitlines(True)
                                      if not line.startswith("[rank"))


def test_two_nodes_without_spare_survivor_exits_1_below_minimum(launcher, tmp_path):
    job = SleeperJob(launcher, tmp_path, "2", max_restarts=2)
    job.start(0)
    job.start(1)
    wait_for(lambda: job.rows(0) and job.rows(1), 60, "both nodes to run their ranks")
    killed_at = time.monotonic()
    for proc in _tree(job.agents[0].pid):
        proc.kill()
    survivor = job.agents[1]
    _, err = survivor.communicate(timeout=30)
    took = time.monotonic() - killed_at
    job.agents[0].communicate()
    assert survivor.returncode == 1, err[-3000:]
    assert took < 10, f"the survivor needed {took:.1f}s"
    lines = [line for line in err.splitlines() if "below its minimum" in line]
    assert len(lines) == 1 and "--nnodes needs at least 2 -> exiting 1" in lines[0], err[-3000:]
    assert not [line for line in err.splitlines() if "Traceback" in line and not line.startswith("[rank")]


@pytest.mark.slow
def test_paused_store_host_finds_it_was_replaced_and_stops_its_ranks(launcher, tmp_path, reference):
    expected = reference.checksum("2x2")
    # slow steps (the model is the same): the others must still be training on the successor
    # store when the old host resumes and looks for it (a finished job's store is gone)
    job = _with_spare(launcher, tmp_path, ["--step-time", "0.5"])
    old = job.agents[0]
    host = _tree(old.pid)
    old_ranks = [p.pid for p in host[1:] if any(a.endswith("ddp_train.py") for a in p.cmdline()[:3])]
    assert len(old_ranks) == 2, [p.cmdline() for p in host]
    with paused(host):   # the others notice the silent host, fail over and train again without it
        wait_for(lambda: _stepping_again(job, 0), 60, "the survivor and the spare to step again")
    _, err = old.communicate(timeout=30)
    assert old.returncode == 1, err[-3000:]
    assert "moved the job to generation 1 of the store" in err, err[-3000:]
    assert not [pid for pid in old_ranks if psutil.pid_exists(pid) and
                psutil.Process(pid).status() != psutil.STATUS_ZOMBIE], "the old host's ranks still run"
    results, _ = job.wait(bound=150)
    assert [code for code, _, _ in results] == [1, 0, 0], "\n".join(r[2][-3000:] for r in results)
    final = job.final()
    assert final["step"] == STEPS and final["checksum"] == expected, final
    assert any(e["kind"] == "store_replaced" for e in job.events())


# ---- the policy's history outlives the store host -----------------------------------------------
def _planned_job_loses_its_host_in_cycle_2(launcher, tmp_path, plan, ft_flags):
    """Three agents (--nnodes 2:3: two train, one waits as a spare) whose ranks follow `plan`
    (tests/scripts/cycle_plan.py), cycle 2 held; once both ranks of cycle 2 run, the store host
    (agent 0) is SIGKILLed with its processes. The survivors' (returncode, stderr)."""
    job = SleeperJob(launcher, tmp_path, "2:3", max_restarts=6)
    script = job.args.index(os.path.join(SCRIPTS, "cycle_sleeper.py"))
    job.args[script:] = [*ft_flags, os.path.join(SCRIPTS, "cycle_plan.py"), job.out, plan]
    for order in range(3):
        job.start(order)
    wait_for(lambda: all(any(c == 2 for c, _ in job.rows(r)) for r in (0, 1)), 60, "both ranks in cycle 2")
    outs = _kill_the_host_and_wait_for_the_others(job)
    return [p.returncode for p in job.agents[1:]], outs, job


def test_identical_failures_before_and_after_a_store_failover_stop_the_job(launcher, tmp_path):
    # The same error in cycles 0 and 1, the store host lost in cycle 2, the same error in cycle 3:
    # the third identical failure in a row stops the job (93), as it would have without the
    # failover (the failover's own cycle is no failure of the script: it neither counts nor
    # breaks the row). A successor that forgot cycles 0 and 1 restarted twice more.
    codes, outs, job = _planned_job_loses_its_host_in_cycle_2(
        launcher, tmp_path, "fail,fail,hold,fail", ["--ft-max-identical-failures", "3"])
    assert codes == [93, 93], "\n".join(o[-3000:] for o in outs)
    assert len(read_events(job.logs, "store_failover")) == 2
    last = outs[0].strip().splitlines()[-1]
    assert "the same error as in cycle 0, 3 failures in a row before any progress (max_identical_failures=3)" \
        in last and "exiting 93" in last, outs[0][-3000:]
    assert max(c for r in (0, 1) for c, _ in job.rows(r)) == 3


@pytest.mark.slow   # the identical-failure test above covers the same failover path by default
def test_cycles_without_progress_before_and_after_a_store_failover_stop_the_job(launcher, tmp_path):
    # A step in cycle 0, none in cycles 1 to 3 (the store host lost in cycle 2): the failure of
    # cycle 3 ends the third cycle in a row without progress, and the job stops (93), as it would
    # have without the failover. A successor that forgot cycle 0's progress never stops (a job
    # that never stepped is never stopped for it) and spends its budget.
    codes, outs, job = _planned_job_loses_its_host_in_cycle_2(
        launcher, tmp_path, "step,fail,hold,fail", ["--ft-max-identical-failures", "0",
                                                    "--ft-max-no-progress-cycles", "3"])
    assert codes == [93, 93], "\n".join(o[-3000:] for o in outs)
    last = outs[0].strip().splitlines()[-1]
    assert "no progress: 3 cycles in a row ended without a completed 'step' section" in last, outs[0][-3000:]
    assert max(c for r in (0, 1) for c, _ in job.rows(r)) == 3
