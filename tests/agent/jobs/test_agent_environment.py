"""Faults of the agent's own environment, made real (we run as root on Linux):

- the log directory's disk fails: a tiny tmpfs, full from the start (writes fail with ENOSPC);
  mid-run, a read-only tmpfs mounted over the log dir (new files fail with EROFS), or the log
  dir removed.
  The job goes on through a restart and completes (exit 0) with one warning line; the agent
  used to deadlock on its own event lock when events.jsonl could not be written. (Health checks
  are off there; with them on, a full log disk warns and the node trains on: logs are not the job.)
- a rank SIGKILL cannot end: frozen in a cgroup-v1 freezer cgroup it sits in uninterruptible
  sleep (state D, like a wedged driver call) and a pending SIGKILL waits until it is thawed.
  The agent used to wait for it forever; now it says so in one line and leaves the job (93).
"""
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from conftest import SCRIPTS, free_port, read_events, wait_for
from harness import listening

FREEZER = "/sys/fs/cgroup/freezer"


def _ranks(agent_pid):
    """The agent's rank processes (cycle_sleeper.py / sleeper.py), by pid."""
    found = []
    for child in psutil.Process(agent_pid).children(recursive=True):
        try:
            if any(a.endswith(("cycle_sleeper.py", "sleeper.py")) for a in child.cmdline()[:4]):
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def _finish(proc, timeout, stuck):
    """`proc`'s stderr once it has ended; the test fails (saying `stuck`) after `timeout` s."""
    try:
        return proc.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"{stuck}:\n{proc.communicate()[1][-3000:]}")


@contextlib.contextmanager
def _tmpfs(path, options):
    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(path):
    """Write into `path` until its filesystem is full (ENOSPC)."""
    with open(os.path.join(path, "filler"), "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"x" * 4096)
        except OSError:
            pass


def _can_mount(tmp_path):
    probe = tmp_path / "probe"
    probe.mkdir()
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)],
                        capture_output=True).returncode == 0
    if ok:
        subprocess.run(["umount", str(probe)], check=False)
    probe.rmdir()
    return ok


@pytest.mark.parametrize("fault", ["full", pytest.param("read-only", marks=pytest.mark.slow),   # the same warning path
                                   pytest.param("removed", marks=pytest.mark.slow)])
def test_a_failing_log_disk_costs_one_warning_line_not_the_job(launcher, tmp_path, fault):
    if fault != "removed" and not _can_mount(tmp_path):
        pytest.skip("mounting a tmpfs needs root")
    logs, out = tmp_path / "logs", tmp_path / "ranks"
    with contextlib.ExitStack() as stack:
        if fault == "full":   # full from the start: every write to events.jsonl fails
            stack.enter_context(_tmpfs(logs, "size=256k"))
            _fill(logs)
        proc = launcher.start(["--standalone", "--nproc-per-node", 2, "--max-restarts", 1, "--redirects", 3,
                               "--ft-health-checks", "false",
                               "--log-dir", logs, os.path.join(SCRIPTS, "cycle_sleeper.py"), out, 600])
        wait_for(lambda: len(_ranks(proc.pid)) == 2 and all((out / f"rank_{r}.txt").exists() for r in (0, 1)),
                 60, "both ranks to run")
        if fault == "read-only":
            stack.enter_context(_tmpfs(logs, "ro,size=64k"))   # over the log dir: nothing new can be made
        elif fault == "removed":
            shutil.rmtree(logs)
        _ranks(proc.pid)[0].kill()   # a failure: the restart writes events, a cycle dir, rank logs
        err = _finish(proc, 40, f"the agent did not finish with its log disk {fault}")
    assert proc.returncode == 0, err[-3000:]
    assert "job complete" in err and "Traceback" not in err, err[-3000:]
    warnings = [line for line in err.splitlines() if "warning:" in line]
    if fault == "removed":   # the agent makes the directories it needs again: nothing to warn of
        assert warnings == [], err[-3000:]
    else:
        assert len(warnings) == 1 and "the job goes on" in warnings[0], err[-3000:]


def test_a_small_log_disk_warns_and_the_job_runs_while_its_logs_fit(launcher, tmp_path):
    """An empty 100 MB tmpfs as the log dir (less than min_free_disk_gb=1): the job runs and
    completes, one warning line saying how much room is left."""
    if not _can_mount(tmp_path):
        pytest.skip("mounting a tmpfs needs root")
    logs, out = tmp_path / "logs", tmp_path / "out"
    with _tmpfs(logs, "size=100m"):
        res = launcher.run(["--standalone", "--nproc-per-node", 2, "--ft-warm-reserves", 0, "--log-dir", logs,
                            os.path.join(SCRIPTS, "cycle_sleeper.py"), out, 0.2], timeout=60)
        kinds = [e["kind"] for e in read_events(logs)]
    assert res.returncode == 0, res.stderr[-3000:]
    warnings = [line for line in res.stderr.splitlines() if "warning: log directory" in line]
    assert len(warnings) == 1, res.stderr[-3000:]
    assert (f"log directory {logs} has 10" in warnings[0]
            and " MB free, less than min_free_disk_gb=1: the job goes on" in warnings[0]), warnings
    assert kinds[-1] == "job_complete" and (out / "rank_1.txt").exists()


def test_a_full_log_disk_warns_and_the_node_trains_on(launcher, tmp_path):
    """A log dir full from the start, health checks on (the default), through a restart (the
    check runs before each rendezvous) and with --ft-min-free-disk-gb 0: logs are not the job. The
    job completes (exit 0); the check says once that the disk is full and what that costs, and
    never that the node leaves."""
    if not _can_mount(tmp_path):
        pytest.skip("mounting a tmpfs needs root")
    logs, out = tmp_path / "logs", tmp_path / "out"
    script = tmp_path / "fails_once.py"   # cycle_sleeper's record, and rank 1 fails in cycle 0
    script.write_text(f"import os, runpy, sys\nrunpy.run_path({os.path.join(SCRIPTS, 'cycle_sleeper.py')!r}, "
                      "run_name='__main__')\nif os.environ['RANK'] == '1' and os.environ['TORCHELASTIC_RESTART_COUNT'] "
                      "== '0':\n    sys.exit(1)\n")
    with _tmpfs(logs, "size=256k"):
        _fill(logs)
        res = launcher.run(["--standalone", "--nproc-per-node", 2, "--ft-warm-reserves", 0, "--max-restarts", 1,
                            "--ft-min-free-disk-gb", 0, "--log-dir", logs, script, out, 0.2], timeout=60)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stderr.splitlines()
    full = [line for line in lines if "warning: log directory" in line]
    assert full == [line for line in lines if f"log directory {logs} has 0.0 MB free, too little for the job's logs "
                    "(they need 8 MB): output and events that cannot be written there are lost; this node trains on"
                    in line], res.stderr[-3000:]
    assert len(full) == 1, res.stderr[-3000:]
    assert "leaves the job" not in res.stderr and "job complete" in res.stderr, res.stderr[-3000:]
    assert sorted(int(line.split()[0]) for line in (out / "rank_1.txt").read_text().splitlines()) == [0, 1]


@contextlib.contextmanager
def _frozen(pid):
    """`pid` frozen in a cgroup-v1 freezer cgroup (state D) until the block ends; then thawed."""
    group = os.path.join(FREEZER, f"ft_test_{uuid.uuid4().hex[:8]}")
    os.mkdir(group)
    try:
        with open(os.path.join(group, "cgroup.procs"), "w") as fh:
            fh.write(str(pid))
        with open(os.path.join(group, "freezer.state"), "w") as fh:
            fh.write("FROZEN")
        wait_for(lambda: open(os.path.join(group, "freezer.state")).read().strip() == "FROZEN", 10,
                 "the freezer cgroup to freeze")
        yield
    finally:
        with open(os.path.join(group, "freezer.state"), "w") as fh:
            fh.write("THAWED")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with open(os.path.join(group, "cgroup.procs")) as fh:
                left = fh.read().split()
            if not left:
                break
            for task in left:   # still alive (not killed): back to the root cgroup
                with contextlib.suppress(OSError), open(os.path.join(FREEZER, "cgroup.procs"), "w") as fh:
                    fh.write(task)
            time.sleep(0.05)
        os.rmdir(group)


@pytest.mark.slow   # long (10-40 s); the default suite keeps a shorter test of the same path
def test_a_rank_sigkill_cannot_end_makes_its_node_leave_in_one_line(launcher, tmp_path):
    if not os.access(os.path.join(FREEZER, "cgroup.procs"), os.W_OK):
        pytest.skip("needs a writable cgroup-v1 freezer hierarchy (root)")
    logs = tmp_path / "logs"
    proc = launcher.start(["--standalone", "--nproc-per-node", 2, "--max-restarts", 1, "--workers-stop-timeout", 1,
                           "--log-dir", logs, os.path.join(SCRIPTS, "sleeper.py"), tmp_path])
    wait_for(lambda: all((tmp_path / f"pids_{r}").exists() for r in (0, 1)), 60, "both ranks to start")
    stuck, other = (int((tmp_path / f"pids_{r}").read_text().split()[0]) for r in (0, 1))
    with _frozen(stuck):
        assert psutil.Process(stuck).status() == psutil.STATUS_DISK_SLEEP
        os.kill(other, signal.SIGKILL)   # a failure: the agent stops rank 0 to restart
        err = _finish(proc, 40, "the agent is stuck waiting for a rank in state D")
    code = 93
    assert proc.returncode == code, err[-3000:]
    lines = [line for line in err.splitlines() if "after SIGKILL" in line]
    assert len(lines) == 1, err[-3000:]
    assert f"rank 0 (pid {stuck}, state D) still alive" in lines[0] and f"exiting {code}" in lines[0], lines
    assert "Traceback" not in err, err[-3000:]
    assert read_events(logs, "rank_unkillable")[0]["detail"]["ranks"] == [[0, stuck]]
    assert read_events(logs, "node_left")


@pytest.mark.slow   # 9 s of waiting on purpose
def test_a_verdict_that_never_comes_ends_the_wait_after_close_timeout(launcher, tmp_path):
    """The deciding node won the round's interrupt and died before writing the verdict (here:
    the test writes the interrupt of a node that does not exist). Each agent waits close_timeout,
    not a hard-coded 60 s, and exits 1 with one line naming the node. The other node hears of the
    interrupt 1.5 s later than the store host (it is paused meanwhile): the store host, whose wait
    ends first, keeps the store up until the other has ended its own, so that one says the same
    line instead of losing the store."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    port = free_port()
    logs, out = tmp_path / "logs", tmp_path / "ranks"
    args = ["--nnodes", 2, "--nproc-per-node", 1, "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "vd",
            "--rdzv-conf", "join_timeout=30,last_call_timeout=1,close_timeout=2", "--ft-warm-reserves", 0,
            "--log-dir", logs, os.path.join(SCRIPTS, "cycle_sleeper.py"), out, 600]
    agents = [launcher.start(args, extra_env={"GROUP_RANK": "0"})]
    wait_for(lambda: read_events(logs, "cycle_start") or agents[0].poll() is not None or listening(port), 30,
             "the store host to listen")
    agents.append(launcher.start(args, extra_env={"GROUP_RANK": "1"}))
    wait_for(lambda: all((out / f"rank_{r}.txt").exists() for r in (0, 1)), 60, "both nodes to run their ranks")
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    os.kill(agents[1].pid, signal.SIGSTOP)
    try:
        store.compare_set("ft/vd/r0/interrupt", "",
                          json.dumps({"kind": "failure", "what": "a fault", "node_id": "gone-node", "reporter": "x"}))
        started = time.monotonic()
        time.sleep(1.5)   # the fault: the other node is paused this long
    finally:
        os.kill(agents[1].pid, signal.SIGCONT)
    errs = [_finish(agent, 20, "an agent still waits for the verdict") for agent in agents]
    del store
    assert time.monotonic() - started < 15
    for agent, err in zip(agents, errs):
        assert agent.returncode == 1, err[-3000:]
        lines = [line for line in err.splitlines() if "close_timeout=2s" in line]
        assert len(lines) == 1 and "interrupted by gone-node" in lines[0] and "exiting 1" in lines[0], err[-3000:]
        assert "Traceback" not in err, err[-3000:]




def test_a_store_lost_during_the_liveness_check_is_a_store_loss_not_a_traceback():
    """The restart round's liveness check (who of the previous round still ticks) reads the
    store through the protocol's one client: a lost store there is StoreLost, which fails over
    (it was torch's DistNetworkError, a traceback). In-process, a real store that goes away."""
    from ft_launcher.agent.rounds.job_store import JobStore
    from ft_launcher.agent.rounds.rendezvous import RoundProtocol
    from ft_launcher.agent.rounds.round_types import NodeInfo, StoreLost
    from ft_launcher.cli import launch_config

    base = ["--nnodes", 2, "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "lv"]
    script = os.path.join(SCRIPTS, "sleeper.py")
    host = JobStore(launch_config([str(a) for a in base] + [script]), lambda line: None)
    cfg = launch_config([str(a) for a in base] + ["--rdzv-conf", "is_host=false", script])
    proto = RoundProtocol(JobStore(cfg, lambda line: None), cfg,
                          NodeInfo(node_id="me", host="127.0.0.1", order_key=None, nproc=1))
    assert host.is_host and not proto.store.is_host
    del host   # the store host is gone
    with pytest.raises(StoreLost, match="lost the rendezvous store at 127.0.0.1"):
        proto._alive(0, [NodeInfo(node_id="peer", host="127.0.0.1", order_key=None, nproc=1)])


@pytest.mark.slow
def test_a_thread_stuck_in_a_store_call_does_not_abort_the_exit(launcher):
    """torch aborts a process whose daemon thread comes back from a store call during interpreter
    exit (SIGABRT: 134, where the agent meant 0, 1 or 93). The agent's exit goes past such a
    thread (agent.rounds.store_threads); the plain exit is checked to abort, so the fault is real."""
    script = os.path.join(SCRIPTS, "stuck_store_exit.py")
    env = launcher.env({"TORCH_CPP_LOG_LEVEL": "ERROR"})
    plain = subprocess.run([sys.executable, script, "plain"], env=env, capture_output=True, text=True, timeout=60)
    assert plain.returncode == -signal.SIGABRT, plain.stderr[-3000:]
    assert "terminate called without an active exception" in plain.stderr
    safe = subprocess.run([sys.executable, script, "safe"], env=env, capture_output=True, text=True, timeout=60)
    assert safe.returncode == 7, safe.stderr[-3000:]
