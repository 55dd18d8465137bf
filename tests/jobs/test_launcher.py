"""The launcher end to end: real agents, a real rendezvous, real ranks, real signals."""
import os
import re
import signal
import time

import psutil
import pytest

from conftest import EXAMPLE, SCRIPTS, free_port, read_events, tagged, wait_for
from harness import read_json

ENV_DUMP = os.path.join(SCRIPTS, "env_dump.py")
FAIL_RANK = os.path.join(SCRIPTS, "fail_rank.py")
SLEEPER = os.path.join(SCRIPTS, "sleeper.py")


def wait_for_files(paths, timeout=60):
    wait_for(lambda: all(os.path.exists(p) for p in paths), timeout, f"{paths} to appear")


def test_example_ddp_job_completes_one_agent_two_ranks(launcher, tmp_path):
    ckpt = tmp_path / "ckpt"
    res = launcher.run(["--standalone", "--nproc-per-node", "2", EXAMPLE, "--steps", "60", "--ckpt-dir", ckpt])
    assert res.returncode == 0, res.stderr
    assert "FINAL step=60" in res.stdout
    final = read_json(ckpt / "final.json")
    assert final["world_size"] == 2 and final["cycle"] == 0


def test_two_agents_form_one_job_in_infrastructure_order(launcher, tmp_path):
    port = free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", "two", ENV_DUMP, tmp_path]
    # The agent started first claims GROUP_RANK 1 from its environment: order must follow it.
    first = launcher.start(common, extra_env={"GROUP_RANK": "1"})
    second = launcher.start(common, extra_env={"GROUP_RANK": "0"})
    for proc in (first, second):
        proc.communicate(timeout=90)
        assert proc.returncode == 0
    records = [read_json(tmp_path / f"rank_{r}.json") for r in range(4)]
    assert {r["WORLD_SIZE"] for r in records} == {"4"}
    assert [r["GROUP_RANK"] for r in records] == ["0", "0", "1", "1"]
    assert [r["LOCAL_RANK"] for r in records] == ["0", "1", "0", "1"]
    assert {r["GROUP_WORLD_SIZE"] for r in records} == {"2"}
    assert {r["TORCHELASTIC_RUN_ID"] for r in records} == {"two"}
    assert all(r["allreduce"] == 4.0 for r in records)
    pids = {p.pid for p in (first, second)}
    assert len(pids) == 2


@pytest.mark.slow
def test_rank_failure_restarts_and_resumes_exactly_from_checkpoint(launcher, tmp_path):
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    base = ["--standalone", "--nproc-per-node", "2", "--log-dir", tmp_path / "logs"]
    job = [EXAMPLE, "--steps", "40", "--ckpt-every", "10"]
    ok = launcher.run(["--standalone", "--nproc-per-node", "2"] + job + ["--ckpt-dir", clean])
    assert ok.returncode == 0, ok.stderr
    res = launcher.run(base + ["--max-restarts", "2"] + job + ["--ckpt-dir", faulty, "--fail-at-step", "25",
                                                                 "--fail-rank", "1"])
    assert res.returncode == 0, res.stderr
    assert "resumed from step 20 (cycle 1)" in res.stdout
    assert "rank 1 on node 0" in res.stderr and "exited with code 1" in res.stderr
    final, reference = read_json(faulty / "final.json"), read_json(clean / "final.json")
    assert final["cycle"] == 1  # TORCHELASTIC_RESTART_COUNT went 0 -> 1
    assert final["checksum"] == reference["checksum"]
    kinds = [e["kind"] for e in read_events(tmp_path / "logs")]
    assert kinds.count("cycle_start") == 2 and "failure" in kinds and "restart" in kinds
    assert kinds[-1] == "job_complete"
    # one log file per rank per cycle
    for cycle in (0, 1):
        for rank in (0, 1):
            assert (tmp_path / "logs" / f"cycle_{cycle}" / f"rank_{rank}.log").exists()
    assert "[rank 0] resumed from step 20" in res.stdout  # teed lines carry the rank


@pytest.mark.slow
def test_spent_budget_exits_1_naming_rank_code_and_cycle(launcher, tmp_path):
    res = launcher.run(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", FAIL_RANK, "1", "-1"])
    assert res.returncode == 1
    last = res.stderr.strip().splitlines()[-1]
    assert "rank 1" in last and "exited with code 1" in last and "cycle 1" in last
    assert "restart budget spent (1/1" in last


@pytest.mark.slow
def test_failure_on_agent_b_restarts_ranks_on_agent_a(launcher, tmp_path):
    port = free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", "ab", "--max-restarts", "1", FAIL_RANK, "3", "1"]
    a = launcher.start(common, extra_env={"GROUP_RANK": "0"})
    b = launcher.start(common, extra_env={"GROUP_RANK": "1"})
    out_a, err_a = a.communicate(timeout=90)
    out_b, err_b = b.communicate(timeout=90)
    assert a.returncode == 0 and b.returncode == 0, err_a + err_b
    assert "on another node" in err_a and "cycle 1: node 0 of 2" in err_a
    assert "rank 0 done in cycle 1" in out_a and "rank 1 done in cycle 1" in out_a
    assert "rank 3 failing in cycle 0" in out_b


def _start_sleepers(launcher, tmp_path, extra=()):
    proc = launcher.start(["--standalone", "--nproc-per-node", "2", *extra, SLEEPER, tmp_path])
    wait_for_files([tmp_path / "pids_0", tmp_path / "pids_1"])
    pids = []
    for rank in (0, 1):
        pids += [int(x) for x in (tmp_path / f"pids_{rank}").read_text().split()]
    return proc, pids


def test_sigterm_is_forwarded_to_ranks(launcher, tmp_path):
    proc, pids = _start_sleepers(launcher, tmp_path, ["--term-timeout", "10"])
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "rank 0 got SIGTERM" in out and "rank 1 got SIGTERM" in out
    assert time.monotonic() - start < 10
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_rank_ignoring_sigterm_is_killed_after_term_timeout(launcher, tmp_path):
    proc = launcher.start(["--standalone", "--nproc-per-node", "1", "--term-timeout", "1", SLEEPER, tmp_path,
                           "--ignore-term"])
    wait_for_files([tmp_path / "pids_0"])
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    elapsed = time.monotonic() - start
    assert "rank 0 got SIGTERM" in out
    assert proc.returncode == 143 and 1.0 <= elapsed < 8


def test_sigkilled_agent_leaves_no_rank_or_grandchild(launcher, tmp_path):
    proc, pids = _start_sleepers(launcher, tmp_path)
    proc.kill()
    proc.communicate(timeout=10)
    gone, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=2)
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left after the agent was SIGKILLed: {alive}"
    assert not tagged(launcher.token) or all(
        p.status() == psutil.STATUS_ZOMBIE for p in tagged(launcher.token))


BAD_INPUTS = [
    (["--bogus-flag", "x.py"], "unrecognized arguments: --bogus-flag"),
    (["--nnode", "2", "x.py"], "did you mean --nnodes?"),
    (["--nnodes", "2:x", "x.py"], "--nnodes: expected N or MIN:MAX"),
    (["--nnodes", "3:1", "x.py"], "--nnodes: need 1 <= MIN <= MAX"),
    (["--rdzv-conf", "join_timeout", "x.py"], "--rdzv-conf: expected key=value"),
    (["--rdzv_conf", "join_timeout=soon", "x.py"], "--rdzv-conf: join_timeout must be a number"),
    (["--standalone", "missing_script.py"], "training script not found: missing_script.py"),
    (["--nproc-per-node", "gpu", ENV_DUMP], "no GPU found"),
    (["--nproc_per_node", "two", ENV_DUMP], "--nproc-per-node: expected a positive int"),
    (["-m", "no_such_module_xyz"], "module not found: no_such_module_xyz"),
    ([], "no training script given"),
]


@pytest.mark.parametrize("args,message", BAD_INPUTS, ids=[" ".join(a) or "empty" for a, _ in BAD_INPUTS])
def test_bad_input_gives_one_line_error(launcher, args, message):
    res = launcher.run(args, timeout=60)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ft_launcher: error:"), res.stderr
    assert message in lines[0]


def test_busy_port_and_rendezvous_timeout_are_one_line_errors(launcher, tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = launcher.run(["--master-port", port, ENV_DUMP, tmp_path], timeout=60)
        assert res.returncode == 1
        assert f"port {port} is already in use" in res.stderr and "--master-port" in res.stderr
        assert "Traceback" not in res.stderr
    res = launcher.run(["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                        "--rdzv-conf", "join_timeout=1", ENV_DUMP, tmp_path], timeout=60)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "timed out after 1s: 1 of 2 needed nodes joined" in res.stderr and "1 missing" in res.stderr


@pytest.mark.parametrize("flags,origin", [
    (["--rdzv-endpoint", "nosuchhost.invalid:29400"], "from --rdzv-endpoint"),
    pytest.param(["--rdzv-backend", "static", "--node-rank", "1", "--master-addr", "nosuchhost.invalid"],
                 "from --master-addr", marks=pytest.mark.slow),   # the same lookup as --rdzv-endpoint's
], ids=["rdzv-endpoint", "master-addr"])
def test_a_rendezvous_host_name_that_does_not_resolve_is_said_at_once_and_while_waiting(launcher, flags, origin):
    """A mistyped endpoint host: the agent says the name does not resolve as soon as it looks for the
    store (not 'waiting for the host to start', and not only when join_timeout runs out), says it
    again while it keeps looking the name up (it may appear late), and its last line says it too."""
    proc = launcher.start(["--nnodes", "2", *flags, "--rdzv-conf", "join_timeout=7", SLEEPER])
    lines = []   # (seconds since the agent's first line, line)
    first = None
    for line in proc.stderr:
        first = first or time.monotonic()
        lines.append((time.monotonic() - first, line.rstrip("\n")))
    proc.wait(timeout=30)
    assert proc.returncode == 1, lines
    said = [(t, l) for t, l in lines if "does not resolve" in l and l.startswith("[ft_launcher")]
    assert len(said) >= 2, lines
    assert said[0][0] < 4.0, lines   # within a few seconds of the start, not at join_timeout's end
    assert all(f"the rendezvous host name 'nosuchhost.invalid' ({origin}) does not resolve" in l for _, l in said)
    assert said[1][0] - said[0][0] >= 4.0   # again while waiting, not a burst
    assert not any("waiting for the rendezvous host" in l for _, l in lines), lines
    last = lines[-1][1]
    assert last.startswith("ft_launcher: error: no rendezvous store answered") and "does not resolve" in last, lines
    assert not any("Traceback" in l for _, l in lines)


@pytest.mark.slow
def test_redirects_keep_console_clean_and_filter_selects_ranks(launcher, tmp_path):
    logs = tmp_path / "logs"
    res = launcher.run(["--standalone", "--nproc-per-node", "2", "--log-dir", logs, "--redirects", "3",
                        ENV_DUMP, tmp_path])
    assert res.returncode == 0
    assert "hello from rank" not in res.stdout
    assert "hello from rank 1" in (logs / "cycle_0" / "rank_1.log").read_text()
    res = launcher.run(["--standalone", "--nproc-per-node", "2", "--tee", "3", "--local-ranks-filter", "1",
                        ENV_DUMP, tmp_path])
    assert res.returncode == 0
    assert "[rank 1] hello from rank 1" in res.stdout and "hello from rank 0" not in res.stdout


@pytest.mark.slow
def test_the_culprit_is_named_first_and_a_victims_collective_error_is_one_line(launcher, tmp_path):
    """The operator reads who failed before its consequences: rank 1 crashes in 'step' (exit 1 at
    once), rank 0 then fails in its collective (gloo: connection closed by peer). The launcher's line
    naming rank 1 comes first; rank 0's 12-line traceback becomes one line that points at rank 1 (the
    whole traceback stays in its log file when there is one), and all of it is out before
    'restarting all ranks: cycle 1'."""
    # --max-restarts 2: torch 2.13 sometimes aborts a 2-rank DDP gloo process at its exit ('terminate
    # called without an active exception', seen once here in cycle 1, also without any launcher), which
    # is not what this test is about
    for name, extra in (("teed", ["--log-dir", tmp_path / "logs"]), ("direct", [])):
        res = launcher.run(["--standalone", "--nproc-per-node", "2", "--max-restarts", "2", *extra, EXAMPLE,
                            "--steps", "20", "--fail-at-step", "10", "--fail-rank", "1",
                            "--ckpt-dir", tmp_path / f"ckpt_{name}"], timeout=90)
        assert res.returncode == 0, res.stderr
        lines = res.stderr.splitlines()
        culprit = next(i for i, l in enumerate(lines) if "rank 1 on node 0 (127.0.0.1) exited with code 1" in l)
        restart = next(i for i, l in enumerate(lines) if "restarting all ranks: cycle 1" in l)
        victim = [i for i, l in enumerate(lines) if l.startswith("[rank 0] ")]
        assert "Traceback" not in res.stderr, (name, res.stderr[-4000:])
        # the victim's one line comes when its collective fails before the agent's stop reaches it
        # (usually; on a busy machine the stop can come first, and then there is no victim line)
        assert len(victim) <= 1 and all(culprit < v < restart for v in victim), (name, res.stderr[-4000:])
        if not victim:
            continue
        line = lines[victim[0]]
        assert re.search(r"Connection (closed|reset) by peer", line), line
        assert "(it was waiting on rank 1, the failure above: its " in line
        assert "GLHF" not in line   # torch's advice cut off: one line
        if name == "teed":
            log = tmp_path / "logs" / "cycle_0" / "rank_0.log"
            assert f"-line traceback folded; whole in {log})" in line
            assert "Traceback (most recent call last)" in log.read_text()
        else:
            assert "traceback folded; --log-dir keeps every rank's output)" in line


@pytest.mark.slow
def test_a_real_error_prints_its_whole_traceback_at_once(launcher, tmp_path):
    """Only a victim's collective error is held back and folded: rank 1's own exception (raised in
    its step) reaches the console whole, before the launcher's line about it."""
    res = launcher.run(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", EXAMPLE, "--steps", "20",
                        "--raise-in", "step", "--fail-rank", "1", "--hold-step", "5", "--ckpt-dir", tmp_path / "ckpt"],
                       timeout=90)
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    raised = next(i for i, l in enumerate(lines) if "RuntimeError: simulated exception in step" in l)
    culprit = next(i for i, l in enumerate(lines) if "rank 1 on node 0 (127.0.0.1) exited with code 1" in l)
    assert raised < culprit and "Traceback (most recent call last)" in "\n".join(lines[:raised]), res.stderr[-4000:]
    assert "in train" in "\n".join(lines[:raised]) and "hooks.at" in "\n".join(lines[:raised])   # its frames, all of them


@pytest.mark.slow
def test_the_same_error_again_before_any_progress_stops_the_job_with_its_traceback_printed_once(launcher, tmp_path):
    """A script that cannot import a module fails the same way in every rank and cycle: its
    traceback is printed once, every later one is a line naming where it was first; the second
    cycle failing the same way, before any step, stops the job (93) in one line instead of
    spending the budget. max_identical_failures 0 turns that off."""
    script = os.path.join(SCRIPTS, "import_error.py")
    logs = tmp_path / "logs"
    res = launcher.run(["--standalone", "--nproc-per-node", "2", "--max-restarts", "3", "--log-dir", logs, script],
                       timeout=120)
    assert res.returncode == 93, res.stderr
    assert res.stderr.count("Traceback (most recent call last)") == 1, res.stderr
    error = "ModuleNotFoundError: No module named 'ft_launcher_tests_no_such_module'"
    same = [l for l in res.stderr.splitlines() if error in l and "(the same error as rank " in l]
    # the other rank of cycle 0 and both of cycle 1, each that failed before the first one's failure
    # stopped it (a rank stopped while still starting prints nothing)
    assert 1 <= len(same) <= 3, res.stderr
    assert all("traceback not repeated; whole in " in l for l in same), same
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("ft_launcher: error: rank ") and "exited with code 1: the same error as in cycle 0, " \
        "2 failures in a row before any progress (max_identical_failures=2); restarting cannot help -> the job " \
        "stops without a restart: exiting 93" in last, last
    assert sorted({e["cycle"] for e in read_events(logs, "cycle_start")}) == [0, 1]
    for cycle in (0, 1):   # the log file of each rank that failed has it whole
        assert any(error in (logs / f"cycle_{cycle}" / f"rank_{r}.log").read_text() for r in (0, 1))
    res = launcher.run(["--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "--ft-max-identical-failures",
                        "0", script], timeout=120)
    assert res.returncode == 1 and "restart budget spent (2/2" in res.stderr.strip().splitlines()[-1], res.stderr
    assert res.stderr.count("Traceback (most recent call last)") == 1, res.stderr


def test_a_shell_script_passed_as_the_script_is_one_line_that_suggests_no_python(launcher, tmp_path):
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/bash\nset -e\nif [ -n \"$RANK\" ]; then echo rank $RANK; fi\n")
    res = launcher.run(["--standalone", "--nproc-per-node", "2", script], timeout=60)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"ft_launcher: error: training script {script} is not a Python script (it starts with '#!/bin/bash'; python "
        f"cannot parse it: SyntaxError at line 3): to run it as a program, add --no-python"]
    script.chmod(0o755)
    res = launcher.run(["--standalone", "--nproc-per-node", "2", "--no-python", script], timeout=60)
    assert res.returncode == 0 and "rank 1" in res.stdout, res.stderr
