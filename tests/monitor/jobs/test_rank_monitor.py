"""Rank monitors end to end: real agents, real monitor processes, real ranks that hang, spin or
stop, timeouts of about a second. Each detection path must fire for the right rank and only
that rank, carry a stack dump, and be followed by a restart that completes the job."""
import json
import os
import signal
import sys

import psutil
import pytest

from conftest import ROOT, SCRIPTS, monitor_of, wait_for
from conftest import read_events as events

RANK = os.path.join(SCRIPTS, "monitored_rank.py")
NVRX = os.path.join(SCRIPTS, "nvrx_pattern.py")
MISUSE = os.path.join(SCRIPTS, "misuse_rank.py")
LOOSE = "setup:20,step:20,fwd:20,checkpointing:20"


def progress(out, rank):
    path = os.path.join(out, f"rank_{rank}.txt")
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [tuple(map(int, line.split())) for line in fh if line.strip()]


def run_job(launcher, tmp_path, ft_flags, fault=None, steps=40, max_restarts=1, nproc=2, extra=(), timeout=90):
    logs, out = tmp_path / "logs", tmp_path / "out"
    out.mkdir(exist_ok=True)
    args = ["--standalone", "--nproc-per-node", nproc, "--max-restarts", max_restarts, "--log-dir", logs,
            *ft_flags, RANK, out, "--steps", steps, *extra]
    if fault:
        args += ["--fault", fault]
    return launcher.run(args, timeout=timeout), logs, out


# (fault, flags, expected reason, expected section)
DETECTION_PATHS = [
    ("setup", ["--ft-rank-section-timeouts", LOOSE + ",setup:1"], "section", "setup"),
    ("step", ["--ft-rank-section-timeouts", LOOSE + ",step:1"], "section", "step"),
    ("checkpointing", ["--ft-rank-section-timeouts", LOOSE + ",checkpointing:1"], "section", "checkpointing"),
    # a nested section overruns while its parent ('step', 20 s) is within time
    ("fwd", ["--ft-rank-section-timeouts", LOOSE + ",fwd:1"], "section", "fwd"),
    ("oos", ["--ft-rank-section-timeouts", LOOSE, "--ft-rank-out-of-section-timeout", "2"], "out_of_section", None),
    ("no_heartbeat", ["--ft-initial-rank-heartbeat-timeout", "2"], "initial_heartbeat", None),
    ("heartbeat_stops", ["--ft-rank-heartbeat-timeout", "1"], "heartbeat", None),
]


# by default: a section (setup, step), out of section, a heartbeat; the others are slow
DEFAULT_PATHS = ("setup", "step", "oos", "no_heartbeat")


@pytest.mark.parametrize("fault,flags,reason,section", [
    pytest.param(*p, id=p[0], marks=() if p[0] in DEFAULT_PATHS else pytest.mark.slow) for p in DETECTION_PATHS])
def test_each_detection_path_fires_for_the_hung_rank_only(launcher, tmp_path, fault, flags, reason, section):
    steps = 100 if fault in ("no_heartbeat", "heartbeat_stops") else 40  # long enough to be caught
    res, logs, out = run_job(launcher, tmp_path, flags, fault=fault, steps=steps)
    assert res.returncode == 0, res.stderr
    hangs = events(logs, "hang")
    assert len(hangs) == 1, hangs
    hang = hangs[0]
    assert (hang["rank"], hang["cycle"]) == (1, 0)
    assert hang["detail"]["reason"] == reason and hang["detail"]["section"] == section
    timeout = hang["detail"]["timeout"]
    assert timeout <= hang["detail"]["elapsed"] < timeout + 1.0  # deadline driven, not a 5 s poll
    failure = events(logs, "failure")[0]
    assert failure["rank"] == 1 and "stopped by its monitor" in failure["detail"]["what"]
    assert failure["detail"]["exitcode"] == -signal.SIGKILL
    # the job restarted once and both ranks then finished every step
    assert len(events(logs, "cycle_start")) == 2 and events(logs)[-1]["kind"] == "job_complete"
    for rank in (0, 1):
        assert [s for c, s in progress(out, rank) if c == 1] == list(range(steps))
    # the operator's line names rank, section or reason, elapsed, timeout and action
    line = next(l for l in res.stderr.splitlines() if "hang detected" in l)
    assert "rank 1" in line and (section or reason.replace("_", " ")) in line and "timeout" in line and "stopping" in line


@pytest.mark.slow   # by default test_sigstopped_rank_is_detected_killed_and_restarted_with_its_stack checks a hung rank's stack
def test_stack_dump_of_a_hung_rank_names_where_it_hangs(launcher, tmp_path):
    res, logs, _ = run_job(launcher, tmp_path, ["--ft-rank-section-timeouts", LOOSE + ",step:1"], fault="step")
    assert res.returncode == 0, res.stderr
    dump = events(logs, "stack_dump")[0]
    assert dump["rank"] == 1
    assert "hang_forever" in dump["detail"]["stack"] and "monitored_rank.py" in dump["detail"]["stack"]
    # every rank opened a dump file in case it hung; only the one that was used is kept
    assert [p.name for p in logs.glob("stack_*")] == [os.path.basename(dump["detail"]["stack_file"])]


def test_sigstopped_rank_is_detected_killed_and_restarted_with_its_stack(launcher, tmp_path):
    """The rank_hung fault: SIGSTOP, as a real hang. The monitor must SIGCONT it to get a stack."""
    flags = ["--ft-rank-section-timeouts", LOOSE + ",step:1", "--ft-simulate-fault", "true",
             "--ft-simulated-fault-type", "rank_hung", "--ft-simulated-fault-rank", "1",
             "--ft-simulated-fault-base-delay", "0.5"]
    res, logs, out = run_job(launcher, tmp_path, flags, steps=150)
    assert res.returncode == 0, res.stderr
    injected, hang = events(logs, "fault_injected"), events(logs, "hang")
    assert len(injected) == 1 and injected[0]["detail"]["fault"] == "rank_hung" and injected[0]["rank"] == 1
    assert len(hang) == 1 and hang[0]["rank"] == 1 and hang[0]["detail"]["section"] == "step"
    assert "monitored_rank.py" in events(logs, "stack_dump")[0]["detail"]["stack"]
    assert [s for c, s in progress(out, 1) if c == 1] == list(range(150))


def test_busy_looping_rank_holding_the_gil_is_dumped_and_killed(launcher, tmp_path):
    res, logs, _ = run_job(launcher, tmp_path, ["--ft-rank-section-timeouts", LOOSE + ",step:1"], fault="busy_gil")
    assert res.returncode == 0, res.stderr
    hang = events(logs, "hang")
    assert len(hang) == 1 and hang[0]["rank"] == 1 and hang[0]["detail"]["section"] == "step"
    assert "busy_loop" in events(logs, "stack_dump")[0]["detail"]["stack"]


def test_catchable_termination_signal_then_sigkill_after_grace(launcher, tmp_path):
    flags = ["--ft-rank-section-timeouts", LOOSE + ",step:1", "--ft-rank-termination-signal", "SIGTERM",
             "--ft-param-rank_termination_grace", "0.5"]
    res, logs, out = run_job(launcher, tmp_path, flags, fault="ignore_term")
    assert res.returncode == 0, res.stderr
    assert (out / "term_1").exists()  # it saw SIGTERM first ...
    failure = events(logs, "failure")[0]
    assert failure["rank"] == 1 and failure["detail"]["exitcode"] == -signal.SIGKILL  # ... then SIGKILL


def start_and_find_monitor(launcher, logs, out, local_rank, max_restarts, section_timeouts, script_args):
    """Start a 2-rank job; once `local_rank` is stepping, return (agent process, that rank's monitor)."""
    proc = launcher.start(["--standalone", "--nproc-per-node", "2", "--max-restarts", max_restarts, "--log-dir", logs,
                           "--ft-rank-section-timeouts", section_timeouts, RANK, out, *script_args])
    wait_for(lambda: len(progress(out, local_rank)) >= 2 or proc.poll() is not None, 60, f"rank {local_rank} to step")
    monitor = monitor_of(proc.pid, local_rank)
    assert monitor is not None, f"no process named 'ft_launcher: rank_monitor local_rank={local_rank}'"
    return proc, monitor


def test_killed_monitor_is_noticed_replaced_and_protects_the_rank_again(launcher, tmp_path):
    logs, out = tmp_path / "logs", tmp_path / "out"
    out.mkdir()
    # Cycle 0 runs long; we kill local rank 1's monitor in it. Cycle 1: rank 1 hangs in 'step'
    # and the *new* monitor must catch it. Cycle 2 completes.
    proc, monitor = start_and_find_monitor(launcher, logs, out, 1, 2, LOOSE + ",step:1",
                                           ["--steps", "400", "--fault", "step", "--cycle", "1"])
    monitor.kill()
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err
    died = events(logs, "monitor_died")
    assert len(died) == 1 and died[0]["detail"]["local_rank"] == 1 and died[0]["cycle"] == 0
    assert "rank monitor for local rank 1" in err and "died" in err
    hang = events(logs, "hang")
    assert [(h["rank"], h["cycle"], h["detail"]["section"]) for h in hang] == [(1, 1, "step")]
    assert len(events(logs, "cycle_start")) == 3 and events(logs)[-1]["kind"] == "job_complete"


def test_nvrx_sections_pattern_runs_and_computed_timeouts_are_enforced(launcher, tmp_path):
    """NVRx's pattern: init, load_state_dict, sections, calculate, state_dict. The second run
    loads the computed (tight) step timeout and a rank that now overruns 'step' is caught, though
    the configured timeout is 30 s."""
    logs, state = tmp_path / "logs", tmp_path / "client_state.json"
    flags = ["--standalone", "--nproc-per-node", "2", "--ft-rank-section-timeouts",
             "setup:30,step:30,checkpointing:30", "--ft-safety-factor", "20", "--ft-calc-timeout-floor", "2"]
    res = launcher.run(flags + ["--log-dir", logs / "first", NVRX, state])
    assert res.returncode == 0, res.stderr
    saved = json.loads(state.read_text())["current_timeouts"]   # NVRx's state_dict() shape
    assert saved["section"]["calculated_sections"] == ["checkpointing", "setup", "step"]
    assert saved["section"]["is_out_of_section_calculated"] and saved["heartbeat"]["were_calculated"]
    assert 2 <= saved["section"]["section"]["step"] < 10 and 2 <= saved["heartbeat"]["subsequent"] < 10  # floor 2
    res = launcher.run(flags + ["--max-restarts", "1", "--log-dir", logs / "second", NVRX, state,
                                "--slow-rank", "1", "--slow-step", "6"])
    assert res.returncode == 0, res.stderr
    assert "loaded step timeout" in res.stdout
    hang = events(logs / "second", "hang")
    assert len(hang) == 1 and hang[0]["rank"] == 1 and hang[0]["detail"]["section"] == "step"
    assert hang[0]["detail"]["timeout"] == pytest.approx(saved["section"]["section"]["step"])


def test_misuse_warns_and_never_breaks_the_rank_or_the_monitor(launcher, tmp_path):
    logs = tmp_path / "logs"
    res = launcher.run(["--standalone", "--nproc-per-node", "1", "--log-dir", logs,
                        "--ft-rank-section-timeouts", "step:5", MISUSE])
    assert res.returncode == 0, res.stderr
    assert "MISUSE OK" in res.stdout
    for text in ("'never' ended but it is not open", "'step' started while already open",
                 "'unknown' has no configured timeout"):
        assert text in res.stdout + res.stderr
    assert not events(logs, "monitor_died") and not events(logs, "hang")


def test_without_the_launcher_every_call_is_a_no_op_after_one_warning(tmp_path):
    import subprocess

    env = dict(os.environ, RANK="0", TORCHELASTIC_RESTART_COUNT="0",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("FT_RANK_MONITOR_SHM", None)
    res = subprocess.run([sys.executable, RANK, tmp_path, "--steps", "20"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("not running under ft_launcher") == 1
    assert len(progress(tmp_path, 0)) == 20


@pytest.mark.slow   # a killed monitor's replacement runs by default
def test_a_stalled_monitor_is_replaced_and_its_rank_restarted(launcher, tmp_path):
    """A SIGSTOPped monitor is alive but protects nothing: the agent must notice it stopped
    ticking, replace it and restart the rank it was guarding."""
    logs, out = tmp_path / "logs", tmp_path / "out"
    out.mkdir()
    proc, monitor = start_and_find_monitor(launcher, logs, out, 0, 1, LOOSE, ["--steps", "350"])
    monitor.suspend()
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err
    stalled = events(logs, "monitor_stalled")
    assert len(stalled) == 1 and stalled[0]["detail"]["local_rank"] == 0 and stalled[0]["detail"]["pid"] == monitor.pid
    assert events(logs, "monitor_died")[0]["detail"]["local_rank"] == 0
    assert len(events(logs, "cycle_start")) == 2 and events(logs)[-1]["kind"] == "job_complete"
    assert not psutil.pid_exists(monitor.pid) or monitor.status() == psutil.STATUS_ZOMBIE


def test_a_hang_in_a_rank_without_the_client_says_there_is_no_stack_dump(launcher, tmp_path):
    """A script that never uses ft_launcher's API has no dump handler: the hang line says so,
    instead of 'stack dump: None'."""
    res = launcher.run(["--standalone", "--nproc-per-node", "1", "--max-restarts", "0", "--log-dir", tmp_path / "logs",
                        "--ft-rank-out-of-section-timeout", "1", os.path.join(SCRIPTS, "plain_hang.py"), "30"],
                       timeout=60)
    line = next(l for l in res.stderr.splitlines() if "hang detected" in l)
    assert "out of section" in line and "None" not in line and "no stack dump" in line, line
    assert events(tmp_path / "logs", "hang")[0]["detail"]["stack_file"] is None


@pytest.mark.slow
def test_a_rank_warning_is_said_once_per_agent_not_per_cycle(launcher, tmp_path):
    """'setup' and 'checkpointing' have no timeout here: each is said once, though rank 0 runs
    them again in the cycle after the failure (a new process)."""
    res = launcher.run(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                        "--ft-rank-section-timeouts", "step:30", os.path.join(ROOT, "examples", "ddp_train.py"),
                        "--steps", "30", "--ckpt-every", "10", "--fail-at-step", "25", "--fail-rank", "1",
                        "--ckpt-dir", tmp_path / "ckpt"], timeout=90)
    assert res.returncode == 0 and "resumed from step 20 (cycle 1)" in res.stdout, res.stderr
    said = [l for l in res.stderr.splitlines() if "FtSectionWarning" in l]
    assert len([l for l in said if "'setup'" in l]) == 1, said
    assert len([l for l in said if "'checkpointing'" in l]) == 1, said


@pytest.mark.slow   # long (10-40 s); the default suite keeps a shorter test of the same path
def test_section_timeouts_for_a_script_without_sections_are_said_to_protect_nothing(launcher, tmp_path):
    """A script that never enters a section, under --ft-rank-section-timeouts step:2: one line
    (per agent, not per rank) says that the section timeouts do nothing for it."""
    res = launcher.run(["--standalone", "--nproc-per-node", "2", "--log-dir", tmp_path / "logs",
                        "--ft-rank-section-timeouts", "step:2", os.path.join(SCRIPTS, "plain_hang.py"), "12"],
                       timeout=60)
    assert res.returncode == 0, res.stderr
    said = [l for l in res.stderr.splitlines() if "no rank on this node has entered a section" in l]
    assert len(said) == 1 and "step 2 s" in said[0] and "nothing finds a hang outside them" in said[0], res.stderr
    assert len(events(tmp_path / "logs", "no_section_entered")) == 1
