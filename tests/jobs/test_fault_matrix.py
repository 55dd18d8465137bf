"""The fault-injection matrix: every recovery path end to end, with real agents, monitors and ranks.

Each case runs examples/ddp_train.py under ft_launcher (1 agent x 2 ranks, or 2 agents x 2 ranks
sharing one rendezvous, log dir and checkpoint dir), puts one fault into one phase of cycle 0 and
checks the outcome: the job ends within a bound; it reaches the target step with exactly the model
of a fault-free run with the same seed (computed once per module and topology); the restarts and
the events (events.jsonl) are the expected ones; no process is left (the launcher fixture). The
job, its constants and the fault-free reference runs are tests/harness.py's.

How a fault lands in a phase:
- rank_killed / rank_hung: the launcher's simulated faults (`--ft-simulate-fault`), due DELAY s
  after the rank starts, while every rank spends HOLD s in the phase (ddp_train `--hold`, at step
  HOLD_STEP for step, oos and checkpointing). The progress files and the hang report confirm it.
  DELAY is large because a loaded 2-core machine can take ~9.5 s from spawn to the first step (2x2).
- raise / exit0: ddp_train `--raise-in` / `--exit0-in` PHASE (deterministic).
- monitor_killed / agent_killed: the test SIGKILLs the process once rank progress shows the rank
  inside the held step (where does not matter to a monitor or an agent, so only 'step' is run).

Detection per phase for rank_hung: the section timeout of that phase, or the out-of-section
timeout. In step and out of section the hung rank's timer expires first (its peers enter the next
section later), so the hang must name it. In setup and checkpointing every rank waits in the same
section from about the same moment, so whichever timer expires first is blamed: the test asserts
the section, not the rank. (A heartbeat timeout could tell them apart, but this job's setup and
final teardown run seconds without a heartbeat on a loaded machine, so it is not used here.)

A rank that exits 0 early is not an error by itself (rank 0 may legitimately finish last), but it
leaves its peers waiting: gloo fails them at their next collective, or a section timeout catches
them (setup: before init_process_group completes nobody notices otherwise). Either way the job
restarts once and the failure names the rank that left early.

Every combination is slow (the default suite runs each path once elsewhere, see DEFAULT):
    python -m pytest -q -m "slow or not slow" tests/jobs/test_fault_matrix.py   # the full matrix
"""
import os
import signal
import time

import psutil
import pytest

from conftest import monitor_of, tagged, wait_for
from harness import (BOUND, DELAY, HANG_TIMEOUTS, HOLD, HOLD_STEP, STEPS, Job, check_one_restart, fault_rank,
                     progress)

# Faults that need no hold: short timeouts, so a peer left waiting in setup is found quickly.
QUICK_TIMEOUTS = ["--ft-rank-section-timeouts", "setup:10,step:10,checkpointing:10"]
MATRIX_TOPOLOGIES = ("1x2", "2x2")


# ---- the matrix ------------------------------------------------------------------------------
FAULTS = ("rank_killed", "rank_hung", "raise", "exit0", "monitor_killed", "agent_killed")
PHASES = ("setup", "step", "checkpointing", "oos")
DEFAULT = set()   # every combination is slow. By default elsewhere: a killed rank (test_live_exact, test_failure_walk,
#                   test_warm_reserves), a hang in every section and a killed monitor (test_rank_monitor), a lost
#                   agent (test_survivor_of_a_killed_agent_exits_1_in_bounded_time, test_store_failover)


def _cases():
    for fault in FAULTS:
        for phase in PHASES:
            if fault in ("monitor_killed", "agent_killed") and phase != "step":
                continue
            for topology in MATRIX_TOPOLOGIES:
                if fault == "agent_killed" and topology == "1x2":
                    continue
                marks = () if (fault, phase, topology) in DEFAULT else (pytest.mark.slow,)
                yield pytest.param(fault, phase, topology, marks=marks, id=f"{fault}-{phase}-{topology}")


@pytest.mark.parametrize("fault,phase,topology", list(_cases()))
def test_fault_matrix(launcher, tmp_path, reference, fault, phase, topology):
    expected_checksum = reference.checksum(topology)
    rank = fault_rank(topology)
    if fault in ("rank_killed", "rank_hung"):
        ft = HANG_TIMEOUTS[phase] + ["--ft-simulate-fault", "true", "--ft-simulated-fault-type", fault,
                                     "--ft-simulated-fault-rank", rank,
                                     "--ft-simulated-fault-base-delay", DELAY]
        job = Job(launcher, tmp_path, topology, ft, ["--hold", f"{phase}:{HOLD}"]).launch()
    elif fault in ("raise", "exit0"):
        flag = "--raise-in" if fault == "raise" else "--exit0-in"
        job = Job(launcher, tmp_path, topology, QUICK_TIMEOUTS, [flag, phase, "--fail-rank", rank]).launch()
    else:
        job = Job(launcher, tmp_path, topology, HANG_TIMEOUTS["step"], ["--hold", f"step:{HOLD}"]).launch()
        in_held_step = lambda: any(s == HOLD_STEP - 1 for c, s, _ in progress(job.prog, rank))  # noqa: E731
        wait_for(in_held_step, 40, f"rank {rank} to reach the held step")
        if fault == "monitor_killed":
            victim = monitor_of(job.agents[rank // job.nproc].pid, rank % job.nproc)
            assert victim is not None, f"no monitor found for rank {rank}"
        else:
            victim = job.agents[rank // job.nproc]
        os.kill(victim.pid, signal.SIGKILL)
        if fault == "agent_killed":
            # a scheduler would start the node again: do so once the survivor has seen the failure
            wait_for(lambda: any(e["kind"] == "failure" for e in job.events()), 30, "the survivor to see the failure")
            job.launch_agent(rank // job.nproc)

    results, elapsed = job.wait()
    errors = "\n".join(r[2][-4000:] for r in results)
    live = [r for i, r in enumerate(results) if not (fault == "agent_killed" and i == rank // job.nproc)]
    assert all(code == 0 for code, _, _ in live), errors
    assert elapsed < BOUND[topology], f"took {elapsed:.1f}s\n{errors}"
    final = job.final()
    assert final["step"] == STEPS and final["world_size"] == job.world
    assert final["checksum"] == expected_checksum, "resumed run differs from the fault-free run"
    evs = job.events()
    check_one_restart(evs, job)
    _check_events(evs, fault, phase, rank, job)


def _check_events(evs, fault, phase, rank, job):
    injected = [e for e in evs if e["kind"] == "fault_injected"]
    failures = [e for e in evs if e["kind"] == "failure" and e["cycle"] == 0]
    assert failures, "no failure recorded"
    if fault in ("rank_killed", "rank_hung"):
        assert len(injected) == 1, injected
        assert injected[0]["rank"] == rank and injected[0]["detail"]["fault"] == fault
        _check_landing(injected[0], phase, rank, job)
    else:
        assert not injected
    first = failures[0]
    if fault == "rank_killed":
        assert first["rank"] == rank and "killed by SIGKILL" in first["detail"]["what"]
    elif fault == "rank_hung":
        hangs = [e for e in evs if e["kind"] == "hang" and e["cycle"] == 0]
        assert hangs, "no hang detected"
        detail = hangs[0]["detail"]
        if phase == "oos":
            assert detail["reason"] == "out_of_section" and not detail["open_sections"]
        else:
            assert detail["reason"] == "section" and detail["section"] == phase, detail
        assert "hung" in first["detail"]["what"]
        if phase in ("step", "oos"):   # in setup and checkpointing the peers wait in the same section
            assert hangs[0]["rank"] == rank and first["rank"] == rank, hangs
        else:
            assert all(h["detail"]["section"] == phase for h in hangs), hangs
        dumps = [e for e in evs if e["kind"] == "stack_dump" and e["rank"] == hangs[0]["rank"]]
        assert dumps and "ddp_train.py" in (dumps[0]["detail"].get("stack") or ""), "no stack dump of the hung rank"
    elif fault == "raise":
        assert first["rank"] == rank and "exited with code 1" in first["detail"]["what"]
    elif fault == "exit0":
        early = [e for e in evs if e["kind"] == "rank_exit" and e["cycle"] == 0]
        assert [e["rank"] for e in early] == [rank], early
        assert [e["rank"] for e in evs if e["kind"] == "early_exit"] == [rank]
        if job.nodes == 1:
            assert f"rank {rank} exited 0 early" in first["detail"]["what"], first
    elif fault == "monitor_killed":
        died = [e for e in evs if e["kind"] == "monitor_died"]
        assert len(died) == 1 and died[0]["rank"] == rank, died
        assert first["rank"] == rank and "monitor" in first["detail"]["what"]
        assert "hung" not in first["detail"]["what"], first
    elif fault == "agent_killed":
        assert any(f["node"] != rank // job.nproc for f in failures)


def _check_landing(injected, phase, rank, job):
    """The simulated fault hit the phase it was meant for (cycle 0 progress of the faulty rank)."""
    steps = [s for c, s, t in progress(job.prog, rank) if c == 0 and t < injected["time"]]
    last = max(steps, default=0)
    want = {"setup": 0, "step": HOLD_STEP - 1, "oos": HOLD_STEP - 1, "checkpointing": HOLD_STEP}[phase]
    assert last == want, f"the fault landed after step {last}, not in {phase} (machine too loaded?)"


# ---- agent loss without a replacement ----------------------------------------------------------
@pytest.mark.slow   # by default a lost store host: test_store_failover, test_slow_is_not_dead
@pytest.mark.parametrize("victim", ["worker_node", "store_host"])
def test_survivor_of_a_killed_agent_exits_1_in_bounded_time(launcher, tmp_path, victim):
    """2 agents; one is SIGKILLed and never comes back. With no restart left (or no store), the
    survivor must not hang: it stops its ranks and exits 1 within a bound."""
    restarts = 0 if victim == "worker_node" else 1
    job = Job(launcher, tmp_path, "2x2", HANG_TIMEOUTS["step"], ["--hold", f"step:{HOLD}"],
              max_restarts=restarts).launch()
    wait_for(lambda: any(s == HOLD_STEP - 1 for c, s, _ in progress(job.prog, 0)), 40, "training")
    dead = 1 if victim == "worker_node" else 0
    killed_at = time.monotonic()
    job.agents[dead].kill()
    survivor = job.agents[1 - dead]
    try:
        _, err = survivor.communicate(timeout=30)
    except Exception:
        survivor.kill()
        pytest.fail(f"the survivor of a killed {victim} agent hung")
    took = time.monotonic() - killed_at
    job.agents[dead].communicate()
    assert survivor.returncode == 1, err[-3000:]
    assert took < 15, f"survivor needed {took:.1f}s"
    agent_lines = [line for line in err.splitlines() if not line.startswith("[rank")]
    assert not [line for line in agent_lines if "Traceback" in line], err[-3000:]
    kinds = [e["kind"] for e in job.events()]
    assert ("job_failed" if victim == "worker_node" else "store_lost") in kinds, kinds


def test_orphan_check_sees_the_monitors_and_the_watchdog(launcher, tmp_path):
    """The fixture finds leftovers by FT_TEST_TOKEN in /proc/<pid>/environ, so the processes that
    rename themselves (monitors, orphan watchdog, warm reserves) must keep their environment readable."""
    job = Job(launcher, tmp_path, "1x2", job_args=["--hold", f"step:{HOLD}"]).launch()
    wait_for(lambda: progress(job.prog, 0), 40, "training")
    def helpers():
        return [p for p in psutil.Process(job.agents[0].pid).children() if "ft_launcher: " in " ".join(p.cmdline())]

    def kinds():
        return sorted(" ".join(p.cmdline()).split()[1] for p in helpers())
    # warm reserves start once the ranks step: one per slot at least (more while a newer one warms)
    wait_for(lambda: kinds().count("warm_reserve") >= 2, 30, "the warm reserves")
    assert kinds().count("rank_monitor") == 2 and kinds().count("orphan_watchdog") == 1, kinds()
    seen = {p.pid for p in tagged(launcher.token)}
    assert [p.pid for p in helpers() if p.pid not in seen] == []
    job.agents[0].send_signal(signal.SIGTERM)
    job.agents[0].communicate(timeout=60)
