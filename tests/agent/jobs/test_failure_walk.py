"""A failure's walk through the agent's parts (the map in agent/agent.py's docstring), on a real
job: rank 1 of 2 dies at step 5 under `ft.restartable`. The agent runs under a profiler
(tests/scripts/traced_agent.py) that records every call its main thread makes into
ft_launcher.agent; from the death to the next cycle's supervision each step of the walk is made
once, by its part, in this order, and the failure is classified and decided nowhere else."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, SCRIPTS, read_events

WALK = [   # the step, and the call that makes it
    ("the death is classified", "failure_cause.rank_ended"),
    ("this node reports it", "cycle_end.CycleEnd.failed"),
    ("to the round's end", "round_end.RoundEnd.interrupt"),
    ("the verdict is decided", "restart_policy.RestartPolicy.decide"),
    ("the verdict is applied on this node", "in_place_carrier.InPlaceCarrier.ask"),
    ("the healthy rank is kept by the verdict", "round_types.Verdict.stays"),
    ("the rest are stopped", "workers.WorkerGroup.stop"),
    ("the next round is joined", "rendezvous.RoundProtocol.join"),
    ("the carried rank is adopted", "in_place_carrier.InPlaceCarrier.adopt"),
    ("the dead slot looks for a warm reserve", "reserve_pool.ReservePool.take"),
    ("and gets its new rank", "workers.WorkerGroup.start"),
]


@pytest.mark.slow   # a killed rank's path runs by default in test_live_exact and test_warm_reserves
def test_a_killed_rank_walks_through_each_part_once(launcher, tmp_path):
    walk_file = tmp_path / "walk.json"
    args = ["--standalone", "--nproc-per-node", 2, "--max-restarts", 2, "--log-dir", tmp_path / "logs",
            os.path.join(ROOT, "examples", "ddp_train.py"), "--restartable", "--steps", 8, "--ckpt-every", 1,
            "--fail-at-step", 5, "--fail-rank", 1, "--ckpt-dir", tmp_path / "ckpt"]
    proc = subprocess.Popen([sys.executable, os.path.join(SCRIPTS, "traced_agent.py")] + [str(a) for a in args],
                            env=launcher.env({"FT_TEST_WALK_FILE": str(walk_file)}), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    launcher.procs.append(proc)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    restarts = read_events(str(tmp_path / "logs"), "restart")
    assert [e["detail"]["rung"] for e in restarts] == ["in_process"], restarts

    calls = json.loads(walk_file.read_text())
    begin = calls.index("failure_cause.rank_ended")
    end = calls.index("supervisor.Supervisor.__init__", begin)   # cycle 1 is supervised
    window = calls[begin:end]
    steps = [c for c in window if c in {call for _, call in WALK}]
    assert steps == [call for _, call in WALK], "\n".join(steps)
    # once the job runs (imports done), the failure is classified only before its report; each
    # report to the round (the failure, then the job's completion) is decided once
    report = calls.index("cycle_end.CycleEnd.failed", begin)
    running = calls.index("supervisor.Supervisor.__init__")
    classified = [i for i, c in enumerate(calls) if c.startswith("failure_cause.") and i > running]
    assert classified and all(begin <= i < report for i in classified), [calls[i] for i in classified]
    assert calls.count("restart_policy.RestartPolicy.decide") == calls.count("round_end.RoundEnd.interrupt") == 2
    assert window.count("workers.WorkerGroup.adopt") == 1   # rank 0, in its own process
