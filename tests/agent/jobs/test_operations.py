"""Operations (issue 14): stragglers from section timings, stopping when restarting is pointless
(no progress, a rank's WorkloadControlRequest) with exit code 93 on every agent, leaving a node
out (ExcludeThisNode, failed health checks), and preemption reaching the training code.
Real agents, a real rendezvous, real ranks and real signals."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, SCRIPTS, free_port, read_events, wait_for
from harness import listening

OPS = os.path.join(SCRIPTS, "ops_rank.py")
QUIET = ["--ft-warm-reserves", "0"]   # nothing here needs warm interpreters: spare the shared CPU


def two_agents(launcher, tmp_path, nnodes, script_args, extra=(), extra_first=(), extra_second=()):
    """Two agents on one endpoint: the first (GROUP_RANK 1, second in rank order) hosts the store;
    the second (GROUP_RANK 0) trains first. Returns (first, second, logs)."""
    port = free_port()
    logs = tmp_path / "logs"
    common = ["--nnodes", nnodes, "--nproc-per-node", 1, "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", f"ops{port}", "--rdzv-conf", "join_timeout=60,last_call_timeout=20",
              "--log-dir", logs, *QUIET, *extra]
    first = launcher.start(common + list(extra_first) + [OPS, tmp_path / "out", *script_args],
                           extra_env={"GROUP_RANK": "1"})
    wait_for(lambda: listening(port) or first.poll() is not None, 30, "the store host to listen")
    second = launcher.start(common + list(extra_second) + [OPS, tmp_path / "out", *script_args],
                            extra_env={"GROUP_RANK": "0"})
    return first, second, logs


def finish(*procs, timeout=90):
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=timeout)
        out.append((proc.returncode, stdout, stderr))
    return out


def last_line(stderr):
    return stderr.strip().splitlines()[-1]


# ---- bad values are one-line errors --------------------------------------------------------------
@pytest.mark.parametrize("flag,value,message", [
    ("--ft-straggler-threshold", "0.9", "straggler_threshold must be above 1 (a ratio to the median), got 0.9"),
    ("--ft-straggler-windows", "0", "straggler_windows must be at least 1, got 0"),
    ("--ft-no-restart-exit-code", "300", "no_restart_exit_code must be 1-255, got 300"),
    ("--ft-max-no-progress-cycles", "x", "max_no_progress_cycles must be a number, got 'x'"),
    ("--ft-straggler-section", " ", "straggler_section must be a section name, got ' '"),
])
def test_bad_operations_settings_are_one_line_errors(launcher, tmp_path, flag, value, message):
    res = launcher.run([flag, value, OPS, tmp_path], timeout=60)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert lines[0].startswith("ft_launcher: error: ") and lines[0].endswith(message)


# ---- stragglers --------------------------------------------------------------------------------
STRAGGLER = ["--ft-straggler-window", "0.5", "--ft-straggler-windows", "2"]


@pytest.mark.slow   # the detection itself: tests/agent/unit/test_stragglers.py
def test_a_slow_rank_is_reported_as_a_straggler_naming_rank_node_and_ratio(launcher, tmp_path):
    first, second, logs = two_agents(launcher, tmp_path, "2", ["--steps", 40, "--step-time", 0.05,
                                                               "--slow-rank", 1, "--slow-time", 0.15],
                                     extra=STRAGGLER)
    (rc1, _, err1), (rc2, _, err2) = finish(first, second)
    assert rc1 == 0 and rc2 == 0, err1 + err2
    found = read_events(logs, "straggler")
    assert [e["rank"] for e in found] == [1], found
    detail = found[0]["detail"]
    assert detail["node_rank"] == 1 and 3.0 < detail["ratio"] < 5.5 and detail["windows"] == 2
    # node 0 judges: its agent says it, naming the rank, the node and the ratio
    line = next(l for l in err2.splitlines() if "straggler:" in l)
    assert line.startswith("ft_launcher: warning: straggler: rank 1 on node 1 (")
    assert "x slower than the median of the other ranks in section 'step'" in line
    # within the windows: reported while the job still ran (40 steps of >= 0.2 s on rank 1)
    ranks = {e["rank"]: e["time"] for e in read_events(logs, "rank_exit")}
    assert found[0]["time"] < min(ranks.values())


@pytest.mark.slow
def test_a_straggling_node_is_left_out_at_the_next_restart_when_a_spare_exists(launcher, tmp_path):
    """--nnodes 2:3 --ft-straggler-exclude true: rank 1 (node 1) straggles and is reported; then
    rank 0 fails, and the restart puts the spare in node 1's place. Node 1 exits 93 saying why."""
    port = free_port()
    logs = tmp_path / "logs"
    common = ["--nnodes", "2:3", "--nproc-per-node", 1, "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", f"slow{port}", "--rdzv-conf", "join_timeout=90,last_call_timeout=60",
              "--max-restarts", 1, "--log-dir", logs, *QUIET, *STRAGGLER, "--ft-straggler-exclude", "true",
              OPS, tmp_path / "out", "--steps", 80, "--step-time", 0.05, "--slow-rank", 1, "--slow-time", 0.15,
              "--fail-rank", 0, "--fail-at-step", 60, "--fail-cycles", 1]
    spare = launcher.start(common, extra_env={"GROUP_RANK": "2"})
    wait_for(lambda: listening(port) or spare.poll() is not None, 30, "the store host to listen")
    node0 = launcher.start(common, extra_env={"GROUP_RANK": "0"})
    node1 = launcher.start(common, extra_env={"GROUP_RANK": "1"})
    (rc0, _, err0), (rc1, _, err1), (rcs, _, errs) = finish(node0, node1, spare, timeout=150)
    assert rc0 == 0 and rcs == 0, err0 + errs
    assert rc1 == 93, err1
    assert "error: this node leaves the job: excluded as a straggler: rank 1 on node 1 (" in last_line(err1)
    assert "straggling node" in err0 and "is left out" in err0
    straggler = [e for e in read_events(logs, "straggler") if e["cycle"] == 0]
    assert [e["rank"] for e in straggler] == [1]
    cycle1 = [e for e in read_events(logs, "cycle_start") if e["cycle"] == 1]
    assert len(cycle1) == 2 and {e["detail"]["world_size"] for e in cycle1} == {2}


def test_a_fault_free_job_reports_no_straggler(launcher, tmp_path):
    logs = tmp_path / "logs"
    res = launcher.run(["--standalone", "--nproc-per-node", 3, "--log-dir", logs, *QUIET, *STRAGGLER,
                        OPS, tmp_path / "out", "--steps", 40, "--step-time", 0.05], timeout=90)
    assert res.returncode == 0, res.stderr
    assert not read_events(logs, "straggler") and "straggler" not in res.stderr
    assert (tmp_path / "out" / "steps_2").read_text().count("\n") == 40


# ---- stopping for good: exit code 93 on every agent ----------------------------------------------
def test_no_progress_stops_the_job_with_93_on_every_agent(launcher, tmp_path):
    """Cycle 0 steps, then rank 1 fails; from cycle 1 it fails before any step: after 2 such cycles
    (max_no_progress_cycles=2) the job stops although 5 restarts were allowed."""
    first, second, logs = two_agents(launcher, tmp_path, "2", ["--fail-rank", 1, "--fail-at-step", 3],
                                     extra=["--max-restarts", 5, "--ft-max-no-progress-cycles", 2])
    results = finish(first, second)
    for rc, _, err in results:
        assert rc == 93, err
        assert "no progress: 2 cycles in a row ended without a completed 'step' section" in last_line(err)
        assert "the job stops without a restart: exiting 93" in last_line(err)
        assert err.count("GPU health check skipped") <= 1   # said once, not every round
    starts = {e["cycle"] for e in read_events(logs, "cycle_start")}
    assert starts == {0, 1, 2}
    assert len(read_events(logs, "job_stopped_no_restart")) == 2


@pytest.mark.slow
def test_running_out_of_restarts_stays_exit_1(launcher, tmp_path):
    first, second, _ = two_agents(launcher, tmp_path, "2", ["--fail-rank", 1, "--fail-at-step", 3],
                                  extra=["--max-restarts", 1, "--ft-max-no-progress-cycles", 2])
    for rc, _, err in finish(first, second):
        assert rc == 1 and "restart budget spent (1/1" in err, err


def test_a_rank_asking_to_shut_down_stops_every_agent_with_93_and_no_restart(launcher, tmp_path):
    first, second, logs = two_agents(launcher, tmp_path, "2", ["--steps", 200, "--request", "ShutdownWorkload",
                                                               "--request-rank", 1, "--request-at", 3],
                                     extra=["--max-restarts", 3])
    results = finish(first, second)
    for rc, _, err in results:
        assert rc == 93, err
        assert "error: rank 1 on node 1 (" in last_line(err)
        assert (") sent ShutdownWorkload (test asks for ShutdownWorkload): stopping the job -> the job stops "
                "without a restart: exiting 93") in last_line(err)
    assert {e["cycle"] for e in read_events(logs, "cycle_start")} == {0}
    assert not read_events(logs, "restart")


# ---- a node leaves: ExcludeThisNode, failed health checks -----------------------------------------
@pytest.mark.slow   # a node leaving for a spare runs by default in test_store_failover
def test_exclude_this_node_hands_the_job_to_the_spare_while_the_excluded_store_host_keeps_serving(
        launcher, tmp_path):
    """--nnodes 1:2: the training node hosts the store and its rank asks to exclude the node. The
    spare takes over and finishes (exit 0); the excluded node leaves training, keeps the store up
    until the spare is done, and exits 93."""
    port = free_port()
    logs = tmp_path / "logs"
    common = ["--nnodes", "1:2", "--nproc-per-node", 1, "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", f"excl{port}", "--rdzv-conf", "join_timeout=60,last_call_timeout=20",
              "--max-restarts", 1, "--log-dir", logs, *QUIET, OPS, tmp_path / "out", "--steps", 30,
              "--request", "ExcludeThisNode", "--request-rank", 0, "--request-at", 3]
    trainer = launcher.start(common, extra_env={"GROUP_RANK": "0"})
    wait_for(lambda: listening(port) or trainer.poll() is not None, 30, "the store host to listen")
    spare = launcher.start(common, extra_env={"GROUP_RANK": "1"})
    (rc_s, _, err_s), (rc_t, _, err_t) = finish(spare, trainer)
    assert rc_s == 0, err_s
    assert "all ranks on all nodes finished: job complete" in err_s
    assert rc_t == 93, err_t
    assert "keeps serving the store until the other nodes are done" in err_t
    assert "error: this node leaves the job: rank 0 on node 0 (" in last_line(err_t)
    assert (") sent ExcludeThisNode (test asks for ExcludeThisNode): excluding its node -> exiting 93 "
            "(no restart)") in last_line(err_t)
    cycle1 = [e for e in read_events(logs, "cycle_start") if e["cycle"] == 1]
    assert len(cycle1) == 1 and cycle1[0]["detail"]["world_size"] == 1
    # the former spare's rank ran cycle 1 to the end
    assert "1 30" in (tmp_path / "out" / "steps_0").read_text()


@pytest.mark.slow
def test_exclude_this_node_without_enough_nodes_left_stops_every_agent_with_93(launcher, tmp_path):
    first, second, _ = two_agents(launcher, tmp_path, "2", ["--steps", 200, "--request", "ExcludeThisNode",
                                                            "--request-rank", 0, "--request-at", 3],
                                  extra=["--max-restarts", 3])
    for rc, _, err in finish(first, second):
        assert rc == 93, err
        assert "at most 1 of the 2 needed can remain -> the job stops without a restart" in last_line(err)


@pytest.mark.slow
def test_a_node_failing_its_disk_check_is_left_out_and_the_job_runs_on_the_others(launcher, tmp_path):
    """--nnodes 1:2: the node first in order demands an absurd amount of free disk in its checkpoint
    directory; it leaves with 93 before the rendezvous, saying why, and the other node trains alone."""
    ckpt = tmp_path / "ckpt"
    first, second, logs = two_agents(launcher, tmp_path, "1:2", ["--steps", 5],
                                     extra_second=["--ft-min-free-disk-gb", "1e9", "--ft-checkpoint-dir", ckpt])
    (rc1, _, err1), (rc2, _, err2) = finish(first, second)
    assert rc1 == 0, err1
    assert rc2 == 93, err2
    assert ("health check failed on this node: checkpoint directory " + str(ckpt)) in last_line(err2)
    assert "GB free, less than min_free_disk_gb=1e+09 -> exiting 93 (no restart)" in last_line(err2)
    starts = read_events(logs, "cycle_start")
    assert len(starts) == 1 and starts[0]["detail"]["world_size"] == 1


def test_an_unwritable_checkpoint_dir_fails_the_health_check_with_the_chosen_exit_code(launcher, tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the checkpoint directory should be")
    res = launcher.run(["--standalone", "--nproc-per-node", 1, *QUIET, "--ft-checkpoint-dir", blocker / "ckpt",
                        "--ft-no-restart-exit-code", 42, OPS, tmp_path / "out", "--steps", 3], timeout=60)
    assert res.returncode == 42, res.stderr
    assert (f"error: this node leaves the job: health check failed on this node: checkpoint directory "
            f"{blocker / 'ckpt'} is not writable (Not a directory) -> exiting 42 (no restart)") in last_line(res.stderr)
    assert not (tmp_path / "out").exists()   # no rank ran


@pytest.mark.slow   # by default test_an_unwritable_checkpoint_dir_fails_the_health_check_with_the_chosen_exit_code
def test_too_little_free_disk_fails_the_health_check(launcher, tmp_path):
    """min_free_disk_gb is the room a checkpoint directory must have; a log directory below it
    only warns (tests/agent/jobs/test_agent_environment.py: a small log disk)."""
    logs, ckpt = tmp_path / "logs", tmp_path / "ckpt"
    res = launcher.run(["--standalone", "--nproc-per-node", 1, *QUIET, "--log-dir", logs, "--ft-checkpoint-dir", ckpt,
                        "--ft-min-free-disk-gb", "1e9", OPS, tmp_path / "out", "--steps", 3], timeout=60)
    assert res.returncode == 93, res.stderr
    assert f"health check failed on this node: checkpoint directory {ckpt} has " in last_line(res.stderr)
    assert "GB free, less than min_free_disk_gb=1e+09 -> exiting 93 (no restart)" in last_line(res.stderr)
    assert f"warning: log directory {logs} has " in res.stderr   # the log dir's own check came first: a warning
    assert [e["kind"] for e in read_events(logs)][-1] == "node_left"
    off = launcher.run(["--standalone", "--nproc-per-node", 1, *QUIET, "--log-dir", logs, "--ft-health-checks",
                        "false", "--ft-min-free-disk-gb", "1e9", OPS, tmp_path / "out", "--steps", 3], timeout=60)
    assert off.returncode == 0, off.stderr   # --ft-health-checks false: no check, no skip line
    assert "health check" not in off.stderr


# ---- preemption reaches the training code ---------------------------------------------------------
def test_sigterm_to_the_launcher_reaches_preempted_and_the_callback_with_the_grace_left(launcher, tmp_path):
    out = tmp_path / "out"
    proc = launcher.start(["--standalone", "--nproc-per-node", 2, *QUIET, "--term-timeout", 20, OPS, out,
                           "--preempt", "--step-time", 0.02])
    # ready_<rank>: its preemption callback is registered (steps_<rank> is created before that)
    wait_for(lambda: all((out / f"ready_{r}").exists() for r in (0, 1)) or proc.poll() is not None, 60,
             "both ranks ready for a preemption")
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert time.monotonic() - sent < 10   # the ranks saved and left: no SIGKILL after 20 s
    for rank in (0, 1):
        seen = json.loads((out / f"preempted_{rank}").read_text())
        assert seen["signal"] == signal.SIGTERM
        assert 15 < seen["grace_left"] <= 20 and 15 < seen["callback_grace"] <= 20, seen


def test_a_restart_sigterm_is_not_a_preemption_and_ends_the_rank_at_once(launcher, tmp_path):
    """Rank 1 fails: rank 0 (which installed the preemption handler) is stopped for the restart by
    SIGTERM, ends at once as it would have without the handler, and is told nothing."""
    out, logs = tmp_path / "out", tmp_path / "logs"
    start = time.monotonic()
    res = launcher.run(["--standalone", "--nproc-per-node", 2, *QUIET, "--max-restarts", 1, "--log-dir", logs,
                        "--workers-stop-timeout", 30, OPS, out, "--preempt", "--fail-rank", 1,
                        "--fail-at-step", 3], timeout=90)
    assert res.returncode == 1, res.stderr
    assert time.monotonic() - start < 25   # no wait for the 30 s SIGKILL
    assert not list(out.glob("preempted_*"))
    assert len(read_events(logs, "cycle_start")) == 2


def test_a_sigterm_not_from_the_launcher_is_a_preemption_of_unknown_grace(tmp_path):
    code = ("import os, signal, ft_launcher as ft\n"
            "seen = []\n"
            "ft.on_preemption(seen.append)\n"
            "assert ft.preempted() is None\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "p = ft.preempted()\n"
            "print(p.signal, p.grace_left, seen[0] is p)\n")
    res = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [str(int(signal.SIGTERM)), "None", "True"]
