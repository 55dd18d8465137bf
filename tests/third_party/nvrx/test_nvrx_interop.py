"""NVRx interop, proven against the real package (nvidia-resiliency-ext 0.4.1, in the test extra):
NVRx's own client loads every ft_state.json we write, one from a real job included; we load what
NVRx's own client and server produce; a configured, not computed, value stays configured; and
scripts written against NVRx's API run under ft_launcher through a hang and a kill, carrying
their computed timeouts across restarts in their own checkpoints."""
import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import SCRIPTS, read_events, wait_for
from ft_launcher.rank_monitor import ft_state_file
from ft_launcher.rank_monitor.timeout_calc import Observation

nvrx_ft = pytest.importorskip("nvidia_resiliency_ext.fault_tolerance", reason="pip install -e '.[test]' installs it")
from nvidia_resiliency_ext.fault_tolerance.data import HeartbeatTimeouts, SectionTimeouts  # noqa: E402
from nvidia_resiliency_ext.fault_tolerance.timeouts_calc import TimeoutsCalc  # noqa: E402


def nvrx_load(state):
    """NVRx's own RankMonitorClient.load_state_dict on `state`: (section, heartbeat) it loaded."""
    client = nvrx_ft.RankMonitorClient()
    client.load_state_dict(state)
    return client.loaded_section_timeouts, client.loaded_hb_timeouts


STATES = {
    "sections": ({"section:step": 12.4, "section:fwd": 3.0}, {"section:setup": 600.0, "section:eval": None,
                                                               "out_of_section": 300.0}),
    "out_of_section": ({"out_of_section": 30.0}, {"section:step": 180.0}),
    "subsequent_heartbeat_only": ({"heartbeat:subsequent": 6.0}, {"heartbeat:initial": None}),
    "everything": ({"section:step": 12.4, "out_of_section": 30.0, "heartbeat:initial": 60.0,
                    "heartbeat:subsequent": 10.0}, {"section:setup": 600.0}),
    "nothing": ({}, {"section:step": 180.0}),
}


@pytest.mark.parametrize("name", sorted(STATES))
def test_nvrx_client_loads_every_file_we_write(tmp_path, name):
    computed, others = STATES[name]
    path = str(tmp_path / "ft_state.json")
    ft_state_file.save(path, ft_state_file.FtState(computed, {k: Observation(50, 1.0, 0) for k in computed},
                                                   {"safety_factor": 5.0}, 1.0, others=others))
    with open(path) as fh:
        sections, heartbeat = nvrx_load(json.load(fh))
    everything = {**others, **computed}
    if any(k.startswith("section:") or k == "out_of_section" for k in computed):
        assert sections.section == {k[8:]: v for k, v in everything.items() if k.startswith("section:")}
        assert sections.calculated_sections == {k[8:] for k in computed if k.startswith("section:")}
        assert sections.out_of_section == everything.get("out_of_section")
        assert sections.is_out_of_section_calculated == ("out_of_section" in computed)
    else:
        assert sections is None   # NVRx writes no 'section' when nothing in it was computed
    if any(k.startswith("heartbeat:") for k in computed):
        assert (heartbeat.initial, heartbeat.subsequent) == (everything.get("heartbeat:initial"),
                                                             everything.get("heartbeat:subsequent"))
        assert heartbeat.were_calculated == ("heartbeat:initial" in computed and "heartbeat:subsequent" in computed)
    else:
        assert heartbeat is None
    # and we read back exactly what was computed
    assert ft_state_file.load(path, warn=pytest.fail).timeouts == computed


LEARNING_YAML = """
fault_tolerance:
  rank_section_timeouts: {setup: 60, step: 60, fwd: 60, checkpointing: 60}
  rank_out_of_section_timeout: 60
  rank_heartbeat_timeout: 60
  calc_ft_timeouts: true
  safety_factor: 20
  calc_timeout_floor: 1.0
"""


def test_nvrx_client_loads_and_goes_on_from_the_file_a_real_job_wrote(launcher, tmp_path):
    cfg, state, out = tmp_path / "ft.yaml", tmp_path / "ft_state.json", tmp_path / "out"
    cfg.write_text(LEARNING_YAML)
    out.mkdir()
    res = launcher.run(["--standalone", "--nproc-per-node", "2", "--log-dir", tmp_path / "logs", "--ft-cfg-path",
                        cfg, "--ft-state-path", state, os.path.join(SCRIPTS, "monitored_rank.py"), out,
                        "--steps", 40], timeout=90)
    assert res.returncode == 0, res.stderr
    ours = ft_state_file.load(str(state), warn=pytest.fail)
    sections, heartbeat = nvrx_load(json.loads(state.read_text()))
    computed_sections = {k[8:] for k in ours.timeouts if k.startswith("section:")}
    assert {"step", "fwd"} <= computed_sections and "setup" not in computed_sections  # 2 closes: too few
    assert sections.calculated_sections == computed_sections
    assert sections.section["setup"] == 60.0 and sections.section["step"] == ours.timeouts["section:step"] < 60
    assert heartbeat.subsequent == ours.timeouts["heartbeat:subsequent"] < 60
    assert not heartbeat.were_calculated   # the initial heartbeat timeout had 2 observations
    # NVRx's own calculator goes on from what it loaded (it merges with every section in it)
    calc = TimeoutsCalc(sections=list(sections.section), safety_factor=5.0)
    for name in sections.section:
        calc.section_to_max_time[name] = 0.5
    calc.out_of_section_max_time = 0.5
    merged = calc.get_section_timeouts(current=sections)
    assert merged.calculated_sections == set(sections.section) and merged.section["setup"] == 2.5


def test_we_load_what_nvrx_client_state_dict_writes_and_configured_values_stay_configured(launcher, tmp_path):
    """NVRx's client and server, alone, compute 'setup', 'step', out-of-section and heartbeat
    timeouts and keep 'checkpointing' at its configured 420 s. Loaded here, by the agent (as
    ft_state.json) and by our client (as a state dict), only the computed ones are applied."""
    produced = tmp_path / "nvrx_state.json"
    res = subprocess.run([sys.executable, os.path.join(SCRIPTS, "nvrx_real_client.py"), tmp_path, produced],
                         env=launcher.env(), cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    nvrx_state = json.loads(produced.read_text())
    section = nvrx_state["current_timeouts"]["section"]
    assert section["section"]["checkpointing"] == 420.0 and section["calculated_sections"] == ["setup", "step"]
    parsed = ft_state_file.parse(nvrx_state)
    assert set(parsed.timeouts) == {"section:setup", "section:step", "out_of_section", "heartbeat:initial",
                                    "heartbeat:subsequent"}
    assert parsed.others == {"section:checkpointing": 420.0}
    # the agent, reading it as ft_state.json, applies the computed values only
    out = tmp_path / "out"
    out.mkdir()
    res = launcher.run(["--standalone", "--nproc-per-node", "1", "--log-dir", tmp_path / "logs",
                        "--ft-state-path", produced, "--ft-rank-section-timeouts", "checkpointing:30",
                        os.path.join(SCRIPTS, "monitored_rank.py"), out, "--steps", 6, "--fault", "oos",
                        "--rank", 0], timeout=90)
    # the rank waits between two sections after step 3: NVRx's computed out-of-section timeout (a few ms)
    # stops it, where the configured default would let it wait for minutes ...
    assert res.returncode != 0 and "hung in out of section" in res.stderr, res.stderr
    loaded = read_events(tmp_path / "logs", "timeouts_loaded")[0]["detail"]["timeouts"]
    assert set(loaded) == set(parsed.timeouts)   # ... and 'checkpointing' 420 s was not loaded
    # our client, given it as a state dict (no monitor: the views still show what was loaded)
    probe = ("import json, sys, ft_launcher as ft\n"
             "c = ft.RankMonitorClient()\n"
             "c.load_state_dict(json.load(open(sys.argv[1])))\n"
             "c.init_workload_monitoring()\n"
             "s, h = c.section_timeouts, c.hb_timeouts\n"
             "print(json.dumps({'section': s.section, 'calc': sorted(s.calculated_sections),\n"
             "                  'oos': s.is_out_of_section_calculated, 'hb': h.were_calculated,\n"
             "                  'loaded': c.loaded_section_timeouts.section, 'state': c.state_dict(),\n"
             "                  'noop': [c.is_initialized, c.calculate_and_set_section_timeouts(),\n"
             "                           c.calculate_and_set_hb_timeouts()]}))\n")
    res = subprocess.run([sys.executable, "-c", probe, produced], env=launcher.env(), capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    shown = json.loads(res.stdout)
    assert shown["noop"] == [False, False, False]   # no ft_launcher: no-ops, not NVRx's errors
    assert shown["calc"] == ["setup", "step"] and shown["oos"] and shown["hb"]
    assert "checkpointing" not in shown["section"] and shown["loaded"]["checkpointing"] == 420.0
    # round trip: our state_dict() is NVRx's shape, and NVRx's client loads it back
    sections, heartbeat = nvrx_load(shown["state"])
    assert sections.section == {k: section["section"][k] for k in ("setup", "step")}
    assert sections.calculated_sections == {"setup", "step"} and heartbeat.were_calculated


# ---- configuration: NVRx's FaultToleranceConfig and YAML, Megatron-Bridge's names ------------------

def test_fault_tolerance_config_reads_and_writes_what_nvrx_does(tmp_path):
    import argparse
    import logging

    from ft_launcher import FaultToleranceConfig

    theirs = nvrx_ft.FaultToleranceConfig(rank_section_timeouts={"setup": 600.0, "step": None},
                                          rank_out_of_section_timeout=300.0, rank_termination_signal="SIGTERM",
                                          log_level="DEBUG", safety_factor=3.0, enable_nic_monitor=False)
    theirs.to_yaml_file(str(tmp_path / "nvrx.yaml"))
    ours = FaultToleranceConfig.from_yaml_file(str(tmp_path / "nvrx.yaml"))
    shared = [f for f in vars(theirs)]
    assert {f: getattr(ours, f) for f in shared} == vars(theirs)      # every NVRx field, same values and types
    assert type(ours.rank_termination_signal) is type(theirs.rank_termination_signal)
    ours.to_yaml_file(str(tmp_path / "ours.yaml"))
    assert nvrx_ft.FaultToleranceConfig.from_yaml_file(str(tmp_path / "ours.yaml")) == theirs
    args = argparse.Namespace(ft_cfg_path=str(tmp_path / "nvrx.yaml"), ft_safety_factor=9.0, ft_log_level=None)
    from_args = FaultToleranceConfig.from_args(args)
    assert from_args.safety_factor == 9.0 and from_args.rank_section_timeouts == theirs.rank_section_timeouts
    assert FaultToleranceConfig.from_kwargs(log_level=logging.WARNING, bogus=1).log_level == logging.WARNING
    with pytest.raises(ValueError, match="bogus"):
        FaultToleranceConfig.from_kwargs(ignore_not_recognized=False, bogus=1)
    with pytest.raises(ValueError, match="No fault tolerance configuration"):
        FaultToleranceConfig.from_args(argparse.Namespace(ft_cfg_path=None))


def test_megatron_bridge_and_nvrx_keys_in_the_yaml_map_onto_ours(tmp_path, capsys):
    from ft_launcher.cli import launch_config

    cfg = tmp_path / "megatron.yaml"
    cfg.write_text("""
ft_config_holder:
  fault_tolerance:
    enable_ft_package: true             # Megatron-Bridge: accepted, always on here
    calc_ft_timeouts: true
    simulate_fault: true
    simulated_fault_type: rank_killed
    simulated_fault_rank: 1
    simulated_fault_base_delay: 15
    ft_state_path: /shared/ckpt/ft_state.json
    node_health_check_interval: 5.0     # NVRx keys with no meaning here: accepted
    restart_check_interval: 60.0
    enable_nic_monitor: false
    pci_topo_file: null
    link_down_path_template: null
""")
    ft = launch_config(["--standalone", "--ft-cfg-path", str(cfg), os.path.join(SCRIPTS, "env_dump.py")]).ft
    assert "unknown" not in capsys.readouterr().err
    assert (ft.calc_ft_timeouts, ft.simulate_fault, ft.simulated_fault_type, ft.simulated_fault_rank,
            ft.simulated_fault_base_delay, ft.ft_state_path) == (True, True, "rank_killed", 1, 15.0,
                                                                 "/shared/ckpt/ft_state.json")


# ---- scripts written against NVRx's API, under ft_launcher, through a hang and a kill -------------

SECTIONS_YAML = """
fault_tolerance:
  rank_section_timeouts: {setup: 60, step: 30, checkpointing: 30}
  rank_out_of_section_timeout: 60
  safety_factor: 5
  calc_timeout_floor: 1
  workload_check_interval: 1      # NVRx's keys: accepted
  enable_nic_monitor: false
"""
HEARTBEAT_YAML = """
fault_tolerance:
  initial_rank_heartbeat_timeout: 60
  rank_heartbeat_timeout: 30
  safety_factor: 5
  calc_timeout_floor: 1
"""
EPOCHS, HANG_EPOCH = 10, 3


def epochs_done(out, rank):
    path = out / f"rank_{rank}.txt"
    rows = [line.split() for line in path.read_text().splitlines()] if path.exists() else []
    return [(int(c), int(e), int(p)) for c, e, p in rows]


def run_through_hang_and_kill(launcher, tmp_path, script, yaml_text):
    """Cycle 0: rank 1 hangs (SIGSTOP) at epoch HANG_EPOCH and its monitor must catch it with a
    computed timeout. Cycle 1: once rank 1 has restored and trained an epoch, we SIGKILL it.
    Cycle 2 finishes. Returns (logs, out, the first hang event, the launcher's stderr)."""
    cfg, out, logs = tmp_path / "ft.yaml", tmp_path / "out", tmp_path / "logs"
    cfg.write_text(yaml_text)
    out.mkdir()
    proc = launcher.start(["--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "--log-dir", logs,
                           "--ft-cfg-path", cfg, os.path.join(SCRIPTS, script), out, "--epochs", EPOCHS,
                           "--hang-epoch", HANG_EPOCH, "--ft-cfg", cfg])
    victim = wait_for(lambda: next((p for c, e, p in epochs_done(out, 1) if c == 1), None) or proc.poll() is not None,
                      120, "rank 1 to finish an epoch in cycle 1")
    assert proc.poll() is None, proc.communicate()[1]
    os.kill(victim, signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    # Rank 1 stopped; rank 0 then waits for it in a collective and is as hung: whichever monitor
    # fires first, the job restarts (a second report may come in before the stop).
    hang = read_events(logs, "hang")
    assert hang and {h["cycle"] for h in hang} == {0}, hang
    failures = read_events(logs, "failure")
    assert failures[-1]["cycle"] == 1 and failures[-1]["rank"] == 1
    assert failures[-1]["detail"]["exitcode"] == -signal.SIGKILL
    assert len(read_events(logs, "cycle_start")) == 3 and read_events(logs)[-1]["kind"] == "job_complete"
    for rank in (0, 1):   # every epoch done, resumed from the checkpoint, not from scratch
        done = epochs_done(out, rank)
        assert sorted({e for c, e, _ in done}) == list(range(EPOCHS))
        assert [e for c, e, _ in done if c == 2][-1] == EPOCHS - 1 and [e for c, e, _ in done if c == 2][0] > 0
    return logs, out, hang[0], err


def report(out, name, rank, cycle):
    return json.loads((out / f"{name}_rank{rank}_cycle{cycle}.json").read_text())


@pytest.mark.slow
def test_nvrx_sections_script_keeps_its_computed_timeouts_through_a_hang_and_a_kill(launcher, tmp_path):
    logs, out, hang, err = run_through_hang_and_kill(launcher, tmp_path, "nvrx_sections_train.py", SECTIONS_YAML)
    # the hang was caught by a timeout computed in cycle 0, not the configured 30 s
    assert hang["detail"]["reason"] in ("section", "out_of_section") and hang["detail"]["timeout"] < 30
    first = report(out, "loaded", 0, 0)
    assert first["restored_from"] is None and first["section"] == {"setup": 60, "step": 30, "checkpointing": 30}
    assert not first["calculated_sections"] and not first["were_calculated"] and first["are_valid"]
    for cycle in (1, 2):
        for rank in (0, 1):
            loaded = report(out, "loaded", rank, cycle)
            saved = loaded["restored_from"]["current_timeouts"]["section"]   # NVRx's state_dict() shape
            assert loaded["calculated_sections"] == saved["calculated_sections"] == ["checkpointing", "setup", "step"]
            assert loaded["is_out_of_section_calculated"] and loaded["were_calculated"]
            assert loaded["section"] == saved["section"] and loaded["out_of_section"] == saved["out_of_section"]
            assert 1 <= loaded["section"]["step"] < 30 and 1 <= loaded["section"]["checkpointing"] < 30
            assert loaded["loaded_section_timeouts"] == dict(saved, calculated_sections=saved["calculated_sections"])
    final = report(out, "final", 0, 2)
    assert final["section_timeouts"]["calculated_sections"] == ["checkpointing", "setup", "step"]
    # the calculation is collective, as NVRx's: both ranks computed from the job-wide maxima
    # (their own 'setup' and out-of-section times differ by milliseconds at least)
    assert report(out, "final", 1, 2) == final
    # NVRx's own client loads the state the script saved in its checkpoint
    sections, _ = nvrx_load(final["state"])
    assert sections.section == final["section_timeouts"]["section"] and sections.were_calculated
    # a WorkloadControlRequest reaches the agent: Continue is logged, once per rank, and changes nothing
    assert err.count(") sent Continue (done): nothing to do") == 2


@pytest.mark.slow   # long (10-40 s); the default suite keeps a shorter test of the same path
def test_nvrx_heartbeat_script_keeps_its_computed_timeouts_through_a_hang_and_a_kill(launcher, tmp_path):
    logs, out, hang, err = run_through_hang_and_kill(launcher, tmp_path, "nvrx_heartbeat_train.py", HEARTBEAT_YAML)
    assert hang["detail"]["reason"] == "heartbeat" and hang["detail"]["timeout"] < 30
    first = report(out, "loaded", 1, 0)
    assert (first["initial"], first["subsequent"], first["were_calculated"]) == (60, 30, False)
    for cycle in (1, 2):
        for rank in (0, 1):
            loaded = report(out, "loaded", rank, cycle)
            saved = loaded["restored_from"]["current_timeouts"]["heartbeat"]
            assert saved["were_calculated"] and loaded["were_calculated"] and loaded["are_valid"]
            assert (loaded["initial"], loaded["subsequent"]) == (saved["initial"], saved["subsequent"])
            assert 1 <= loaded["subsequent"] < 30 and loaded["loaded_hb_timeouts"] == saved
    final = report(out, "final", 0, 2)
    _, heartbeat = nvrx_load(final["state"])
    assert heartbeat.were_calculated and heartbeat.subsequent == final["hb_timeouts"]["subsequent"]
