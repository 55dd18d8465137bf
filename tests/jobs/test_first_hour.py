"""A new user's first hour (issue 9): bad paths, planned faults, noise, re-runs, temp files,
exit codes, --help and --version. Real launchers, real ranks."""
import os
import time
import shutil
import subprocess
import sys

import pytest

from conftest import EXAMPLE, ROOT, SCRIPTS, read_events, wait_for

ENV_DUMP = os.path.join(SCRIPTS, "env_dump.py")


def _without_numpy(tmp_path):
    """A PYTHONPATH on which `import numpy` fails as it does where numpy is not installed."""
    fake = tmp_path / "no_numpy" / "numpy"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    return {"PYTHONPATH": f"{fake.parent}{os.pathsep}{ROOT}"}


def test_bad_input_is_one_line_even_where_numpy_is_missing(launcher, tmp_path):
    res = launcher.run(["--nproc-per-node", "gpu", ENV_DUMP], timeout=60, extra_env=_without_numpy(tmp_path))
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == ["ft_launcher: error: --nproc-per-node gpu: no GPU found on this node"]


def test_numpy_is_a_dependency_so_torch_in_the_ranks_does_not_warn():
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    requires = [line.split(">")[0].strip() for line in cfg["options"]["install_requires"].split("\n") if line.strip()]
    assert "numpy" in requires


@pytest.mark.parametrize("flag,value,message", [
    ("--log-dir", "/proc/x", "--log-dir: cannot write in /proc/x"),
    ("--log-dir", "{file}", "--log-dir: {file} exists and is not a directory"),
    ("--ft-state-path", "/proc/x/ft_state.json", "--ft-state-path: cannot write in /proc/x"),
    ("--ft-state-path", "{dir}", "--ft-state-path: {dir} is a directory, not a file"),
], ids=["log-dir-in-proc", "log-dir-is-a-file", "state-in-proc", "state-is-a-dir"])
def test_unwritable_output_path_is_one_line_before_anything_starts(launcher, tmp_path, flag, value, message):
    a_file, a_dir = tmp_path / "a_file", tmp_path / "a_dir"
    a_file.write_text("not a directory\n")
    a_dir.mkdir()
    value, message = (x.format(file=a_file, dir=a_dir) for x in (value, message))
    res = launcher.run(["--standalone", flag, value, ENV_DUMP, tmp_path], timeout=60)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ft_launcher: error: {message}"), res.stderr
    assert not list(tmp_path.glob("rank_*.json"))  # no rank ran


@pytest.mark.slow
def test_a_state_file_that_cannot_be_written_later_is_a_warning_not_a_failure(launcher, tmp_path):
    logs, state_dir = tmp_path / "logs", tmp_path / "state"
    proc = launcher.start(["--standalone", "--nproc-per-node", "2", "--log-dir", logs,
                           "--ft-calc-ft-timeouts", "true", "--ft-calc-min-observations", "1",
                           "--ft-state-path", state_dir / "ft_state.json",
                           EXAMPLE, "--steps", "40", "--step-time", "0.05", "--ckpt-dir", tmp_path / "ckpt"])
    wait_for(lambda: read_events(logs, "cycle_start"), 60, "the cycle to start")
    shutil.rmtree(state_dir)  # (it may hold the file's lock already)
    state_dir.write_text("the state directory is gone\n")  # every later write there fails
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "FINAL step=40" in out and "Traceback" not in err
    unwritable = read_events(logs, "ft_state_unwritable")
    assert unwritable and f"cannot write {state_dir / 'ft_state.json'}" in err


def _readme_command(marker, doc="docs/simulated-faults.md"):
    """The docs' `ft_launcher ...` command that contains `marker`, as argv without the program."""
    import shlex

    text = open(os.path.join(ROOT, doc)).read().replace("\\\n", " ")
    line = next(l for l in text.splitlines() if l.startswith("ft_launcher ") and marker in l)
    return shlex.split(line)[1:]


@pytest.mark.slow   # long (10-40 s); the default suite keeps a shorter test of the same path
def test_readme_rank_hung_example_fires_is_caught_and_resumes(launcher, tmp_path):
    args = _readme_command("rank_hung")
    script = args.index("examples/ddp_train.py")
    args = args[:script] + ["--log-dir", tmp_path / "logs", EXAMPLE] + args[script + 1:]
    res = launcher.run(args, timeout=180)
    assert res.returncode == 0, res.stderr
    assert "FINAL step=300" in res.stdout
    kinds = [e["kind"] for e in read_events(tmp_path / "logs")]
    assert kinds.count("fault_injected") == 1 and "hang" in kinds and "restart" in kinds
    hang, dumps = read_events(tmp_path / "logs", "hang"), read_events(tmp_path / "logs", "stack_dump")
    assert dumps and {d["cycle"] for d in dumps} == {hang[0]["cycle"]} == {0}  # filed under the hang's cycle
    assert kinds[-1] == "job_complete"


@pytest.mark.slow   # a whole job to its end for one line
def test_a_fault_planned_after_the_end_of_the_job_says_so(launcher, tmp_path):
    res = launcher.run(["--standalone", "--log-dir", tmp_path / "logs", "--ft-simulate-fault", "true",
                        "--ft-simulated-fault-type", "rank_killed", "--ft-simulated-fault-base-delay", "60",
                        ENV_DUMP, tmp_path], timeout=60)
    assert res.returncode == 0, res.stderr
    assert "simulated fault not injected: rank_killed in rank 0 was planned" in res.stderr
    assert "ended first" in res.stderr
    assert [e["kind"] for e in read_events(tmp_path / "logs")][-1] == "fault_not_injected"


@pytest.mark.slow   # CI's first command runs the README's job
def test_readme_first_command_is_quiet_and_a_rerun_says_the_run_is_finished(launcher, tmp_path):
    """The README's first command shows the point: rank 1 hangs in a step, its monitor finds it,
    dumps its stack, and the job resumes from its checkpoint and finishes, in well under a minute."""
    import shlex

    first = open(os.path.join(ROOT, "README.md")).read().split("```bash\n", 1)[1].splitlines()[0]
    args = shlex.split(first.rsplit("&& ", 1)[1])[1:]  # the ft_launcher command, without the program
    args[args.index("examples/ddp_train.py")] = EXAMPLE
    scratch = tmp_path / "tmpdir"   # the stack dump's run dir (no --log-dir) lands here, not in /tmp
    scratch.mkdir()
    start = time.monotonic()
    res = launcher.run(args, timeout=180, extra_env={"TMPDIR": str(scratch)})  # the example's ./ckpt: tmp_path
    took = time.monotonic() - start
    assert res.returncode == 0, res.stderr
    # The launcher's lines and the script's output, nothing else: no warnings, no source lines; rank
    # 0's error when its collective peer is stopped is one line after the one naming rank 1, no traceback.
    lines = res.stderr.splitlines()
    assert all(line.startswith(("[ft_launcher ", "[rank 0] ")) for line in lines), res.stderr
    assert "Traceback" not in res.stderr
    victim = [i for i, l in enumerate(lines) if l.startswith("[rank 0] ")]
    culprit = next(i for i, l in enumerate(lines) if "rank 1 on node 0 (127.0.0.1) hung in section 'step'" in l)
    assert all(i > culprit and "(it was waiting on rank 1, the failure above" in lines[i] for i in victim), res.stderr
    assert [l.split()[0] for l in res.stdout.splitlines()] == ["step", "rank", "resumed", "step", "step", "FINAL"], res.stdout
    assert "rank 1 hangs in step at step 150 (simulated)" in res.stdout
    assert "rank 1 hang detected: section 'step' elapsed" in res.stderr and "stack dump: " in res.stderr
    assert "restarting all ranks: cycle 1" in res.stderr and "job complete" in res.stderr
    assert "hang detection is off" not in res.stderr
    dump = res.stderr.split("stack dump: ", 1)[1].split()[0]
    assert dump.startswith(str(scratch)) and os.path.getsize(dump) > 0   # kept for the operator: the line names it
    assert took < 60, took
    final = res.stdout.splitlines()[-1]
    again = launcher.run(args, timeout=180, extra_env={"TMPDIR": str(scratch)})
    assert again.returncode == 0, again.stderr
    assert "holds a finished run (step 300 of 300): nothing left to train" in again.stdout
    assert again.stdout.splitlines()[-1] == final  # the finished run's loss, not 0.000000


def test_a_run_without_log_dir_leaves_no_temporary_directory(launcher, tmp_path):
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    proc = launcher.start(["--standalone", "--nproc-per-node", "2", ENV_DUMP, tmp_path], extra_env={"TMPDIR": str(tmp)})
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert not os.path.exists(f"/tmp/ft_launcher-{proc.pid}")
    assert not list(tmp.glob("ft_launcher-*"))


def test_version_and_a_grouped_help_with_one_spelling_a_default_and_a_line_per_flag():
    import re

    sys.path.insert(0, ROOT)
    from ft_launcher import __version__
    from ft_launcher.rank_monitor.config import FIELD_NAMES

    env = dict(os.environ, PYTHONPATH=ROOT)
    version = subprocess.run([sys.executable, "-m", "ft_launcher", "--version"], env=env, capture_output=True,
                             text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.strip() == f"ft_launcher {__version__}"
    res = subprocess.run([sys.executable, "-m", "ft_launcher", "--help"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0
    text = res.stdout
    for group in ("nodes and rendezvous:", "restarts and stopping:", "logs and console:", "fault tolerance:"):
        assert f"\n{group}\n" in text
    assert not re.search(r"--[a-z-]*_", text), "an underscore twin is shown"
    assert "--ft-param-rank" not in text and "--ft-ft-state-path" not in text
    entries = {}  # flag -> its entry (the flag's line and the lines its help wraps onto)
    for line in text.splitlines():
        if line.startswith("  -"):
            flag = line.split()[0]
            entries[flag] = line
        elif line.startswith("   ") and entries:
            entries[flag] += " " + line.strip()
    flag_lines = {k: v for k, v in entries.items() if k.startswith("--ft-")}
    from ft_launcher.rank_monitor.config import help_of

    for key in FIELD_NAMES:
        shown = "--" + key.replace("_", "-") if key.startswith("ft_") else "--ft-" + key.replace("_", "-")
        if help_of(key) is None:  # NVRx's keys that mean nothing here: accepted, not shown
            assert shown not in flag_lines, shown
            continue
        assert shown in flag_lines, shown
        assert "default" in flag_lines[shown], flag_lines[shown]  # its line carries its default
    for hidden in (["--nproc_per_node", "2"], ["--ft-param-rank_heartbeat_timeout", "3"],
                   ["--ft_state_path", "s.json"]):
        assert subprocess.run([sys.executable, "-m", "ft_launcher", *hidden, "--version"], env=env,
                              capture_output=True, timeout=60).returncode == 0  # still accepted


SMALL_BAD_INPUTS = [
    (["--term-timeout", "-5", ENV_DUMP], "--term-timeout must not be negative, got -5"),
    (["--workers-stop-timeout", "-1", ENV_DUMP], "--workers-stop-timeout must not be negative, got -1"),
    (["--monitor-interval", "0", ENV_DUMP], "--monitor-interval must be positive, got 0"),
    (["--standalone", "--nnodes", "2", ENV_DUMP], "--standalone is one node: it cannot be combined with --nnodes 2"),
    (["--standalone", SCRIPTS], f"training script {SCRIPTS} is a directory, not a file"),
]


@pytest.mark.parametrize("args,message", SMALL_BAD_INPUTS, ids=[" ".join(a[:2]) for a, _ in SMALL_BAD_INPUTS])
def test_inconsistent_flags_are_one_line_errors(launcher, args, message):
    res = launcher.run(args, timeout=60)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [f"ft_launcher: error: {message}"]


def test_spent_budget_counts_at_most_the_budget_and_errors_share_one_prefix(launcher, tmp_path):
    logs = tmp_path / "logs"
    res = launcher.run(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", logs,
                        os.path.join(SCRIPTS, "fail_rank.py"), "1", "-1"])
    assert res.returncode == 1
    failed = read_events(logs, "job_failed")
    assert len(failed) == 1 and failed[0]["detail"]["restarts_used"] == 1
    errors = [l for l in res.stderr.splitlines() if "error:" in l]
    assert errors and all(l.startswith("ft_launcher: error: ") for l in errors), res.stderr
    assert errors[-1].endswith("[node=0 cycle=1]")


def test_sigterm_during_training_ends_with_a_job_stopped_event(launcher, tmp_path):
    logs = tmp_path / "logs"
    proc = launcher.start(["--standalone", "--log-dir", logs, os.path.join(SCRIPTS, "sleeper.py"), tmp_path])
    wait_for(lambda: (tmp_path / "pids_0").exists(), 60, "the rank to start")
    proc.send_signal(15)
    proc.communicate(timeout=30)
    assert proc.returncode == 143
    kinds = [e["kind"] for e in read_events(logs)]
    assert kinds[-2:] == ["signal", "job_stopped"]
    assert read_events(logs, "job_stopped")[0]["detail"] == {"signal": 15, "exitcode": 143}


def test_a_busy_rendezvous_endpoint_is_reported_within_seconds(launcher, tmp_path):
    import socket
    import time

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        start = time.monotonic()
        res = launcher.run(["--rdzv-endpoint", f"127.0.0.1:{port}", ENV_DUMP, tmp_path], timeout=60)
        elapsed = time.monotonic() - start
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert f"port {port} on 127.0.0.1 is in use by another program" in res.stderr
    assert elapsed < 14  # torch's import plus a 4 s handshake; it was 15 s of handshake alone
