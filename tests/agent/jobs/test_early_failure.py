"""A failure in the first seconds of a job, before any warm reserve is ready: the restart takes the
reserve that is still warming (agent.ranks.reserve_pool) instead of starting a second, cold process that
would compete with it for the CPU; it is raised to the agent's priority and becomes the rank.
Real agent, reserves and ranks (examples/ddp_train.py). The other branch (a reserve stuck warming
is not taken: the restart starts cold) is in test_warm_reserves.
"""
import os
import signal

import pytest

from conftest import read_events, wait_for
from harness import Job, progress, ranks_started


@pytest.mark.slow   # the early-failure rung's other tests and the starved-reserve test (test_warm_reserves) take a warming reserve
def test_an_early_kill_takes_the_reserve_still_warming(launcher, tmp_path, reference):
    job = Job(launcher, tmp_path, "1x2", ["--ft-rank-section-timeouts", "setup:60,step:30,checkpointing:30"]).launch()
    # rank 1 has stepped and its slot's reserve has started, but it is not ready yet
    wait_for(lambda: progress(job.prog, 1) and any(e["detail"]["local_rank"] == 1
                                                  for e in read_events(job.logs, "reserve_started")),
             90, "rank 1 stepping and its slot's reserve started", interval=0.01)
    pid = [r for e in read_events(job.logs, "ranks_started") for r in e["detail"]["ranks"] if r["rank"] == 1][0]["pid"]
    os.kill(pid, signal.SIGKILL)
    assert not [e for e in read_events(job.logs, "reserve_ready") if e["detail"]["local_rank"] == 1]
    results, _ = job.wait()
    assert all(code == 0 for code, _, _ in results), results[0][2][-3000:]
    assert job.final()["checksum"] == reference.checksum("1x2")
    # the killed rank's slot took the reserve warming for it, timed against the slot's cold start
    taken = {e["detail"]["local_rank"]: e["detail"] for e in read_events(job.logs, "reserve_taken_warming")}
    assert 1 in taken, read_events(job.logs)
    assert 0 < taken[1]["warming"] < taken[1]["cold_start"], taken
    cycle1 = ranks_started(job.logs, 1)
    assert cycle1[1]["warm"] and cycle1[1]["pid"] == taken[1]["pid"], (cycle1, taken)
    # a full restart (no ft.restartable): slot 0 took its reserve too, ready or still warming
    assert cycle1[0]["warm"], cycle1
    assert not read_events(job.logs, "reserve_lost"), read_events(job.logs, "reserve_lost")
    assert "taking the one warming for" in results[0][2]
