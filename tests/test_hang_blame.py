"""Hang blame end to end (agent/hang_blame.py): one rank hangs, its peers wait on it in a collective
and their monitors fire too; the agents tell culprit from victims and only the culprit is replaced.

examples/ddp_train.py under `ft.restartable`, real agents, monitors and ranks (test_fault_matrix's
Job). The hang: rank `--fail-rank` sleeps for an hour in a phase (ddp_train --hang-in), or the
test SIGSTOPs it while it steps. Then:
- the job ends with exactly the model of a fault-free run, after one in-place restart;
- every victim kept its process (cycle 1 reports it in place with its cycle-0 pid), the culprit's
  slot got a new process;
- one `hang_blame` event names the culprit, the victims and the evidence that decided;
- the failure line names the culprit and says the others were waiting on it.
"""
import os
import signal

import pytest

from conftest import wait_for
from test_fault_matrix import HOLD_STEP, Job, References, progress
from test_inprocess_restart import started

T = 3.0
TIMEOUTS = ["--ft-rank-section-timeouts", f"setup:15,step:{T:g},checkpointing:{T:g}"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return References(tmp_path_factory)


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
    assert [e["detail"]["rung"] for e in restarts] == ["in_process"], restarts
    victims = [r for r in range(job.world) if r != culprit]
    blame = [e for e in evs if e["kind"] == "hang_blame"]
    assert len(blame) == 1, blame
    d = blame[0]["detail"]
    assert d["culprits"] == [culprit] and d["victims"] == victims and d["evidence"] == evidence, d
    before, after = started(evs, 0), started(evs, 1)
    for rank in victims:
        assert after[rank] == (before[rank][0], True), f"victim {rank} did not keep its process: {before} -> {after}"
    assert after[culprit][0] != before[culprit][0] and not after[culprit][1], after
    failure = [e for e in evs if e["kind"] == "failure"][0]
    assert failure["rank"] == culprit
    assert "waiting on it" in failure["detail"]["what"], failure
    assert "waiting on it" in errors
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


def test_without_the_flight_recorder_the_stacks_decide(launcher, tmp_path, reference):
    job, culprit = run_hang(launcher, tmp_path, "1x2", "sleep", "step", env={"TORCH_FR_BUFFER_SIZE": "0"})
    check_blame(job, reference, culprit, "stacks")


@pytest.mark.slow
def test_a_hang_in_setup_is_told_by_the_stacks(launcher, tmp_path, reference):
    # before init_process_group completes there is no collective to record: the victims' stacks
    # wait inside torch.distributed (the rendezvous), the culprit's does not
    job, culprit = run_hang(launcher, tmp_path, "1x2", "sleep", "setup")
    check_blame(job, reference, culprit, "stacks")
