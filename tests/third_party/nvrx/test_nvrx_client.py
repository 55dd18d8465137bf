"""Megatron, NeMo and NVRx scripts run unchanged under ft_launcher: NVRx's own RankMonitorClient
(nvidia-resiliency-ext 0.4.1, imported as those frameworks import it) talks to our rank monitors
over NVRx's socket protocol. Real agents, real monitors, real ranks through real hangs and kills:

- NVRx 0.4.1's own examples (tests/third_party/nvrx_examples, copied unchanged) with NVRx's YAML:
  a simulated rank_hung and rank_killed are caught and recovered, the computed timeouts land in
  the example's ft_state.json, and NVRx's client loads them back into our monitor on the next run;
- Megatron-Bridge's call sequence with NVRx's client (tests/scripts/nvrx_bridge_sequence.py)
  through a hang and a kill, and its ExcludeThisNode request handing the job to a spare node;
- Megatron's exit codes through that sequence (`--rerun-exit`): a 16 re-runs every rank on another
  device with no loop, a 17 hands the node to a spare or stops the job with one line.
"""
import json
import os
import re
import signal

import pytest

from conftest import ROOT, SCRIPTS, free_port, read_events, wait_for
from harness import listening

pytest.importorskip("nvidia_resiliency_ext.fault_tolerance", reason="pip install -e '.[test]' installs it")

EXAMPLES = os.path.join(ROOT, "tests", "third_party", "nvrx_examples")
BRIDGE = os.path.join(SCRIPTS, "nvrx_bridge_sequence.py")


def set_timeouts_lines(stderr):
    """The monitors' lines (DEBUG) for the timeouts an NVRx client sent, in order:
    [(local_rank, {key: seconds})]."""
    out = []
    for m in re.finditer(r"local_rank=(\d+): NVRx client set timeouts: (.*)", stderr):
        values = {}
        for part in m.group(2).split(", "):
            key, value = part.rsplit(" ", 2)[0], part.rsplit(" ", 2)[1]
            values[key] = None if value == "none" else float(value)
        out.append((int(m.group(1)), values))
    return out


def calculated(state):
    """{key: seconds} of what an NVRx state_dict() marks calculated (keys as the monitor says them)."""
    section = state["current_timeouts"].get("section") or {}
    out = {name: section["section"][name] for name in section.get("calculated_sections", [])}
    if section.get("is_out_of_section_calculated"):
        out["out_of_section"] = section["out_of_section"]
    hb = state["current_timeouts"].get("heartbeat") or {}
    if hb.get("were_calculated"):
        out.update(initial=hb["initial"], subsequent=hb["subsequent"])
    return out


def close(a, b):
    return float(f"{a:g}") == pytest.approx(b, rel=1e-5)


# ---- NVRx 0.4.1's own examples ------------------------------------------------------------------
# How the examples simulate a fault (_setup_simulated_fault): at the end of an epoch (the sections
# example's first; the heartbeats example's first once its heartbeat timeouts are computed, at
# epoch 1's second step) the example arms a thread that sleeps `delay + 4 * random()` seconds
# (unseeded) and then sends SIGSTOP (rank_hung) or SIGKILL (rank_killed) to a random rank; when
# training ends first, the fault is cancelled and the job simply completes. The restarted run arms
# again after its first epoch. So, with `--epochs` one more than the arming epoch:
# - the epoch after the arming one must outlast FAULT_DELAY + 4 s on any machine that runs this:
#   the train sets make each epoch about 10 s on this project's 2 cores (2.3 times the longest delay;
#   a single run, unloaded: 3.1 ms a heartbeats step, 3.8 ms a sections step, 4 samples a rank);
# - the restarted run has that one epoch left, arms after it and cancels at once: FAULT_DELAY > 0
#   keeps its thread asleep until then.
EXAMPLE_ARGS = ["--device", "cpu", "--hidden", "32", "--batch", "4", "--val_dataset_size", "16",
                "--logging_interval", "100000", "--log_all_ranks"]   # all ranks: the armed rank says so
FAULT_DELAY = 0.25
SECTIONS_TRAIN_SET, HEARTBEATS_TRAIN_SET = 21000, 26000   # samples: 2 ranks x 4 a step


def run_example(launcher, tmp_path, script, yaml, fault, epochs, dataset, out, name, extra=()):
    logs = tmp_path / f"logs_{name}"
    simulated = ["--simulated_fault", f"{fault},{FAULT_DELAY}"] if fault else []
    res = launcher.run(["--standalone", "--nproc-per-node", 2, "--max-restarts", 3, "--log-dir", logs,
                        "--ft-cfg-path", os.path.join(EXAMPLES, yaml), "--ft-calc-timeout-floor", 2,
                        os.path.join(EXAMPLES, script), *EXAMPLE_ARGS, "--epochs", epochs,
                        "--train_dataset_size", dataset, "--output_dir", out, *simulated, *extra], timeout=200)
    assert res.returncode == 0, res.stderr[-4000:]
    return res, logs


def armed_faults(stderr):
    """[(fault, target rank, delay s)] as the examples' rank that is to fail logs them."""
    return [(m.group(1), int(m.group(2)), float(m.group(3)))
            for m in re.finditer(r"Selected fault=(\w+); target rank=(\d+); delay=([0-9.]+)", stderr)]


def assert_caught_and_recovered(res, logs, fault):
    """The fault armed in cycle 0 fired in training, our monitors caught it through NVRx's
    client, and the restarted job completed; returns the hang or failure event."""
    said = res.stderr[-3000:]
    armed = armed_faults(res.stderr)
    assert armed and armed[0][0] == fault, said
    _, target, delay = armed[0]
    starts = read_events(logs, "cycle_start")
    assert len(starts) != 1, (f"the example's {fault} (rank {target}, {delay:.2f} s after it was armed) was "
                              f"cancelled: training ended first; its epochs are too short on this machine\n{said}")
    assert len(starts) == 2 and read_events(logs)[-1]["kind"] == "job_complete", said
    if fault == "rank_hung":
        hangs = read_events(logs, "hang")
        assert hangs and {h["cycle"] for h in hangs} == {0}, (hangs, said)
        return hangs[0]
    failure = read_events(logs, "failure")[0]
    assert failure["cycle"] == 0 and failure["detail"]["exitcode"] == -signal.SIGKILL, (failure, said)
    assert failure["rank"] == target, (failure, armed, said)   # the rank the example killed
    assert not read_events(logs, "hang"), said
    return failure


@pytest.mark.slow   # long (10-40 s); the default suite keeps a shorter test of the same path
def test_nvrx_sections_example_through_a_hang_with_its_timeouts_kept(launcher, tmp_path):
    out = tmp_path / "out"
    res, logs = run_example(launcher, tmp_path, "train_ddp_sections_api.py", "fault_tol_cfg_sections.yaml",
                            "rank_hung", 2, SECTIONS_TRAIN_SET, out, "hung")
    hang = assert_caught_and_recovered(res, logs, "rank_hung")
    # caught by a timeout NVRx's client computed in cycle 0 and sent to our monitor (the YAML's
    # 'step' is 10 s, 'checkpoint' 30 s, out of section 30 s), enforced no lower than the floor (2 s)
    assert hang["detail"]["reason"] == "section" and hang["detail"]["section"] in ("step", "checkpoint"), hang
    assert 2.0 <= hang["detail"]["timeout"] < 10, hang
    state = json.loads((out / "ft_state.json").read_text())   # written by the example's rank 0
    sections = state["current_timeouts"]["section"]
    assert {"step", "checkpoint", "init"} <= set(sections["calculated_sections"])   # init: after a resume
    assert sections["is_out_of_section_calculated"]   # the run ended normally
    # the restarted ranks loaded the file written in cycle 0 into our monitor
    sent = set_timeouts_lines(res.stderr)
    assert {rank for rank, _ in sent} == {0, 1}

    # the next run (a fresh checkpoint, the same ft_state.json; no fault, so short epochs do):
    # NVRx's client loads the timeouts back, and the first thing each rank sends our monitor is
    # exactly what the file holds
    res, logs = run_example(launcher, tmp_path, "train_ddp_sections_api.py", "fault_tol_cfg_sections.yaml",
                            None, 2, 800, out, "next", extra=["--checkpoint_fname", "second.pt"])
    assert len(read_events(logs, "cycle_start")) == 1 and read_events(logs)[-1]["kind"] == "job_complete"
    first = {rank: values for rank, values in reversed(set_timeouts_lines(res.stderr))}
    expected = calculated(state)
    for rank in (0, 1):
        assert set(first[rank]) == set(expected)
        assert all(close(expected[k], first[rank][k]) for k in expected), (first[rank], expected)


@pytest.mark.slow
def test_nvrx_sections_example_through_a_kill(launcher, tmp_path):
    res, logs = run_example(launcher, tmp_path, "train_ddp_sections_api.py", "fault_tol_cfg_sections.yaml",
                            "rank_killed", 2, SECTIONS_TRAIN_SET, tmp_path / "out", "killed")
    assert_caught_and_recovered(res, logs, "rank_killed")


@pytest.mark.slow
def test_nvrx_heartbeats_example_through_a_hang_and_a_kill(launcher, tmp_path):
    out = tmp_path / "out"
    res, logs = run_example(launcher, tmp_path, "train_ddp_heartbeats_api.py", "fault_tol_cfg_heartbeats.yaml",
                            "rank_hung", 3, HEARTBEATS_TRAIN_SET, out, "hung")
    hang = assert_caught_and_recovered(res, logs, "rank_hung")
    assert hang["detail"]["reason"] == "heartbeat" and 2.0 <= hang["detail"]["timeout"] < 30, hang
    res, logs = run_example(launcher, tmp_path, "train_ddp_heartbeats_api.py", "fault_tol_cfg_heartbeats.yaml",
                            "rank_killed", 3, HEARTBEATS_TRAIN_SET, out, "killed",
                            extra=["--checkpoint_fname", "second.pt"])
    assert_caught_and_recovered(res, logs, "rank_killed")
    # the restarted ranks restored the computed heartbeat timeouts from the example's checkpoint
    restored = [values for _, values in set_timeouts_lines(res.stderr) if {"initial", "subsequent"} <= set(values)]
    assert len(restored) >= 2


# ---- Megatron-Bridge's sequence ------------------------------------------------------------------
PREVIOUS_RUN = {"current_timeouts": {"section": {
    "section": {"setup": 50.0, "step": 60.0, "checkpointing": 60.0}, "out_of_section": 60.0,
    "calculated_sections": ["setup"], "is_out_of_section_calculated": False}}}


def steps_done(out, rank):
    path = out / f"rank_{rank}.txt"
    rows = [line.split() for line in path.read_text().splitlines()] if path.exists() else []
    return [(int(c), int(s), int(p)) for c, s, p in rows]


@pytest.mark.slow
def test_megatron_bridge_sequence_with_nvrx_client_through_a_hang_and_a_kill(launcher, tmp_path):
    out, logs = tmp_path / "out", tmp_path / "logs"
    (out / "ckpt").mkdir(parents=True)
    (out / "ckpt" / "ft_state.json").write_text(json.dumps(PREVIOUS_RUN))   # an existing file
    res = launcher.run(["--standalone", "--nproc-per-node", 2, "--max-restarts", 2, "--log-dir", logs,
                        "--ft-rank-section-timeouts", "setup:60,step:60,checkpointing:60",
                        "--ft-rank-out-of-section-timeout", 60, "--ft-calc-timeout-floor", 2, "--ft-log-level", "DEBUG",
                        BRIDGE, out, "--steps", 50, "--save-interval", 10, "--hang", "1:0:25", "--kill", "1:1:35"],
                       timeout=180)
    assert res.returncode == 0, res.stderr[-4000:]
    hangs = read_events(logs, "hang")
    assert hangs and {h["cycle"] for h in hangs} == {0}
    # caught by the 'step' timeout the client computed at step 20 (not the configured 60 s); rank 0,
    # waiting for rank 1 in the step's all-reduce, may be found first
    assert all(h["detail"]["section"] == "step" and 2.0 <= h["detail"]["timeout"] < 60 for h in hangs), hangs
    failures = read_events(logs, "failure")
    assert failures[-1]["cycle"] == 1 and failures[-1]["rank"] == 1
    assert failures[-1]["detail"]["exitcode"] == -signal.SIGKILL
    assert len(read_events(logs, "cycle_start")) == 3 and read_events(logs)[-1]["kind"] == "job_complete"
    for rank in (0, 1):   # resumed from each checkpoint, every step done
        done = steps_done(out, rank)
        assert sorted({s for _, s, _ in done}) == list(range(50))
        assert [s for c, s, _ in done if c == 1][0] == 20 and [s for c, s, _ in done if c == 2][0] == 30
    for rank in (0, 1):
        first = json.loads((out / f"loaded_rank{rank}_cycle0.json").read_text())
        assert first["calculated_sections"] == ["setup"] and first["section"]["setup"] == 50.0
        last = json.loads((out / f"report_rank{rank}_cycle2.json").read_text())
        assert last["loaded"]["calculated_sections"] == ["checkpointing", "setup", "step"]
        assert last["updates"][-1] == ["setup", "step", "checkpointing", "out_of_section"]
        assert last["final"]["calculated_sections"] == ["checkpointing", "setup", "step"]
        assert last["final"]["is_out_of_section_calculated"]
    state = json.loads((out / "ckpt" / "ft_state.json").read_text())   # rank 0's state_dict()
    assert calculated(state).keys() == {"setup", "step", "checkpointing", "out_of_section"}
    assert state == json.loads((out / "report_rank0_cycle2.json").read_text())["state"]
    # every rank of every cycle sent its timeouts to our monitor (the 50 s setup included)
    sent = set_timeouts_lines(res.stderr)
    assert {rank for rank, _ in sent} == {0, 1} and any(v.get("setup") == 50.0 for _, v in sent)


def two_agents(launcher, tmp_path, nnodes, nproc, max_restarts, bridge_args, timeout=150):
    """Two agents on this machine (GROUP_RANK 0 hosts the store, then 1) running the bridge
    sequence with `bridge_args`; (first, second, first's stderr, second's, out dir, log dir), both ended."""
    port = free_port()
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    common = ["--nnodes", nnodes, "--nproc-per-node", nproc, "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", f"bridge{port}", "--rdzv-conf", "join_timeout=60,last_call_timeout=20",
              "--max-restarts", max_restarts, "--log-dir", logs,
              "--ft-rank-section-timeouts", "setup:60,step:60,checkpointing:60", BRIDGE, out, *bridge_args]
    first = launcher.start(common, extra_env={"GROUP_RANK": "0"})
    wait_for(lambda: listening(port) or first.poll() is not None, 30, "the store host to listen")
    second = launcher.start(common, extra_env={"GROUP_RANK": "1"})
    _, err1 = second.communicate(timeout=timeout)
    _, err0 = first.communicate(timeout=60)
    return first, second, err0, err1, out, logs


@pytest.mark.slow
def test_megatron_bridge_exclude_this_node_hands_the_job_to_the_spare(launcher, tmp_path):
    """--nnodes 1:2: the training node's rank asks, through NVRx's client, to exclude its node;
    the spare takes over and finishes; the excluded node exits 93."""
    trainer, spare, err_t, err_s, out, logs = two_agents(launcher, tmp_path, "1:2", 1, 1, [
        "--steps", 30, "--save-interval", 10, "--exclude", "0:0:3"])
    assert spare.returncode == 0, err_s[-3000:]
    assert trainer.returncode == 93, err_t[-3000:]
    assert ("sent ExcludeThisNode (test: this node's NIC is failing): excluding its node -> exiting 93 "
            "(no restart)") in err_t.strip().splitlines()[-1]
    cycle1 = [e for e in read_events(logs, "cycle_start") if e["cycle"] == 1]
    assert len(cycle1) == 1 and cycle1[0]["detail"]["world_size"] == 1
    assert [s for c, s, _ in steps_done(out, 0) if c == 1][-1] == 29   # the former spare's rank finished


# ---- Megatron's exit codes 16 and 17 (agent/recovery/rerun_exits.py) -----------------------------
def hardware_rows(out, rank):
    """[(cycle, LOCAL_RANK, FT_LAUNCHER_RERUN_OF, FT_LAUNCHER_RERUN_MOVED)] as the bridge script wrote them."""
    rows = [line.split() for line in (out / f"hw_rank{rank}.txt").read_text().splitlines()]
    return [(int(c), int(lr), of, moved) for c, _, lr, of, moved in rows]


@pytest.mark.slow   # the rules: tests/agent/jobs/test_rerun_exits.py (default, fast)
@pytest.mark.parametrize("fatal", [False, True])
def test_megatron_exit_16_reruns_every_rank_on_another_device_without_a_loop(launcher, tmp_path, fatal):
    """2 agents x 2 ranks, Megatron's shape through NVRx's client: rank 3's result is suspect at
    step 6, every rank saves the checkpoint and exits 16; every node rotates its ranks, so rank 3
    re-runs step 6 on another device (Megatron's own check passes) and goes on, or (fatal) every
    rank exits 17 and, with no spare, the job stops with one line: 2 cycles either way."""
    first, second, err0, err1, out, logs = two_agents(launcher, tmp_path, 2, 2, 3, [
        "--steps", 12, "--save-interval", 4, "--rerun-exit", "16:3:0:6"] + (["--rerun-fatal"] if fatal else []))
    starts = read_events(logs, "cycle_start")
    assert sorted({e["cycle"] for e in starts}) == [0, 1], err0[-3000:]   # no loop
    for rank in range(4):   # every rank re-ran on the other slot of its node, and was told so
        (c0, slot0, _, _), (c1, slot1, of, moved) = hardware_rows(out, rank)
        assert (c0, c1) == (0, 1) and slot1 == 1 - slot0 and of == "0" and moved.endswith(f":{slot0}")
    reruns = read_events(logs, "rerun")
    assert reruns[0]["cycle"] == 0 and reruns[0]["detail"]["move"]["rotate"]
    if not fatal:
        assert first.returncode == 0 and second.returncode == 0, err0[-3000:] + err1[-3000:]
        for rank in range(4):   # resumed at the checkpoint saved at step 6: step 6 re-run, every step done
            done = steps_done(out, rank)
            assert [s for c, s, _ in done if c == 1][0] == 6 and sorted({s for _, s, _ in done}) == list(range(12))
        return
    assert (first.returncode, second.returncode) == (93, 93), err0[-3000:] + err1[-3000:]
    assert reruns[-1]["cycle"] == 1 and reruns[-1]["detail"]["exitcode"] == 17
    decider = err0 if "exited 17" in err0.strip().splitlines()[-1] else err1
    last = decider.strip().splitlines()[-1]
    assert "exited 17 (failed result validation: its node is suspect): the suspect, the node of cycle 0's exit 16" in last
    assert "no hot spare can take its place; stopping the job -> the job stops without a restart: exiting 93" in last


@pytest.mark.slow   # the rules: tests/agent/jobs/test_rerun_exits.py (default, fast)
def test_megatron_exit_17_hands_the_node_to_the_spare(launcher, tmp_path):
    """--nnodes 1:2, 2 ranks: every rank exits 17 at step 5 (a failed validation, Megatron's shape
    through NVRx's client); the node leaves (93), the spare resumes from the checkpoint and finishes."""
    trainer, spare, err_t, err_s, out, logs = two_agents(launcher, tmp_path, "1:2", 2, 1, [
        "--steps", 12, "--save-interval", 4, "--rerun-exit", "17:1:0:5"])
    assert spare.returncode == 0, err_s[-3000:]
    assert trainer.returncode == 93, err_t[-3000:]
    assert "leaves the job: a hot spare takes its place" in err_t, err_t[-3000:]
    cycle1 = [e for e in read_events(logs, "cycle_start") if e["cycle"] == 1]
    assert len(cycle1) == 1 and cycle1[0]["detail"]["world_size"] == 2
    for rank in (0, 1):   # the former spare's ranks resumed at step 4's checkpoint and finished
        assert [s for c, s, _ in steps_done(out, rank) if c == 1] == list(range(4, 12))


# ---- one command, whatever the install order ----------------------------------------------------
@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    """This checkout's wheel (built from a copy: nothing is written into the checkout) and NVRx
    0.4.1's (pip download; skipped where no index answers)."""
    import shutil
    import subprocess
    import sys

    where = tmp_path_factory.mktemp("wheels")
    src = where / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("ft_launcher", "agent", "rank_monitor"):
        shutil.copytree(os.path.join(ROOT, name), src / name, ignore=ignore)
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", where, src], capture_output=True, text=True, timeout=180)
    assert built.returncode == 0, built.stderr
    got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "nvidia-resiliency-ext==0.4.1",
                          "-d", where], capture_output=True, text=True, timeout=180)
    if got.returncode != 0:
        pytest.skip(f"cannot download nvidia-resiliency-ext 0.4.1: {got.stderr.strip().splitlines()[-1:]}")
    ours = next(where.glob("ft_launcher-*.whl"))
    nvrx = next(where.glob("nvidia_resiliency_ext-0.4.1-*.whl"))
    return ours, nvrx


@pytest.mark.slow
@pytest.mark.parametrize("last", ["ours", "nvrx"])
def test_with_both_packages_installed_in_either_order_the_command_says_which_runs(tmp_path, wheels, last):
    """docs/migrating-from-nvrx.md, as pip does it: both wheels carry a console script named
    `ft_launcher`; pip writes the later one over the earlier one without a warning, so the package
    installed last owns the name. `ftrun` and `python -m ft_launcher` are ours in either order;
    ours says, in `--version`, when `ft_launcher` on PATH is NVRx's (whose launcher has no
    `--version`); `pip install --force-reinstall --no-deps ft_launcher` takes the name back."""
    import subprocess
    import sys

    from ft_launcher import __version__
    from ft_launcher.flags import command_owner

    ours, nvrx = wheels
    venv = tmp_path / "venv"
    # the venv sees this machine's site-packages (torch and the rest, for `--version`)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv], check=True,
                   timeout=120)
    py, bin_dir = venv / "bin" / "python", venv / "bin"

    def install(wheel, *how):
        res = subprocess.run([sys.executable, "-m", "pip", "--python", py, "--disable-pip-version-check", "install",
                              "-q", "--no-deps", "--no-index", *how, wheel], capture_output=True, text=True,
                             timeout=180)
        assert res.returncode == 0 and "warn" not in res.stderr.lower(), res.stderr
        assert (venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
                / wheel.name.split("-")[0]).is_dir(), f"{wheel.name} was not installed into the venv"

    # --ignore-installed: installs each wheel into the venv as into a clean environment. Without
    # it pip skips a wheel whose version the outer site-packages already holds ("already installed
    # with the same version"), writing no script; NVRx 0.4.1 is installed on the machines that run
    # this suite, so NVRx's `ft_launcher` would never reach the venv (ours would, as an editable
    # install always gets reinstalled).
    for wheel in ((nvrx, ours) if last == "ours" else (ours, nvrx)):
        install(wheel, "--ignore-installed")
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    env.pop("PYTHONPATH", None)

    def run(*cmd):
        return subprocess.run(list(cmd) + ["--version"], env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=120)

    def ours_says(*cmd, note):
        res = run(*cmd)
        assert res.returncode == 0, res.stderr
        lines = res.stdout.strip().splitlines()
        assert lines[0] == f"ft_launcher {__version__}", (cmd, lines)
        if note:   # says which one `ft_launcher` runs, and how to get ours
            assert len(lines) == 2 and lines[1].startswith(
                f"note: the `ft_launcher` command on PATH ({bin_dir / 'ft_launcher'}) is nvidia-resiliency-ext's "
                "launcher"), lines
        else:
            assert len(lines) == 1, lines

    script = bin_dir / "ft_launcher"
    assert command_owner(str(script)) == ("ft_launcher" if last == "ours" else "nvidia-resiliency-ext")
    for cmd in (["ftrun"], [str(py), "-m", "ft_launcher"]):
        ours_says(*cmd, note=last == "nvrx")
    if last == "ours":
        ours_says("ft_launcher", note=False)
        return
    # NVRx's launcher runs: it has no --version, and answers with its usage (exit 2)
    res = run("ft_launcher")
    assert res.returncode == 2 and f"ft_launcher {__version__}" not in res.stdout, (res.stdout, res.stderr)
    assert res.stderr.strip().splitlines()[-1] == (
        "ft_launcher: error: the following arguments are required: training_script, training_script_args"), res.stderr
    # the migration page's way to take the name back
    install(ours, "--force-reinstall")
    assert command_owner(str(script)) == "ft_launcher"
    ours_says("ft_launcher", note=False)


def test_version_says_when_ft_launcher_on_path_is_nvrx(tmp_path):
    """The same note without installing anything: a script shaped as pip writes NVRx's."""
    import subprocess
    import sys

    fake = tmp_path / "bin"
    fake.mkdir()
    script = fake / "ft_launcher"
    script.write_text("#!/bin/sh\n# from nvidia_resiliency_ext.fault_tolerance.launcher import main\nexit 2\n")
    script.chmod(0o755)
    env = dict(os.environ, PATH=f"{fake}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-m", "ft_launcher", "--version"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0
    assert res.stdout.splitlines()[1] == (
        f"note: the `ft_launcher` command on PATH ({script}) is nvidia-resiliency-ext's launcher, installed after "
        "this package: run `ftrun` or `python -m ft_launcher`, or reinstall ft_launcher to take the name back "
        "(docs/migrating-from-nvrx.md)")
