"""Computed timeouts: the rule (evidence, floor, merge, pins) and ft_state.json (atomic, lenient,
corrupt files set aside). Each rule test fails if its rule is broken."""
import json
import multiprocessing
import os

import pytest

from conftest import EXAMPLE, SCRIPTS, read_events
from ft_launcher.rank_monitor import ft_state_file
from ft_launcher.rank_monitor.config import FaultToleranceConfig
from ft_launcher.rank_monitor.timeout_calc import Observation, apply, combine_all, compute


def cfg(**kw):
    base = dict(calc_min_observations=10, calc_timeout_floor=1.0, safety_factor=5.0)
    base.update(kw)
    return FaultToleranceConfig(**base)


def test_candidate_is_max_times_factor_once_evidence_suffices():
    obs = {"section:step": Observation(10, 2.48, 0)}
    result, changes = compute(obs, {"section:step": 180.0}, {}, cfg())
    assert result["section:step"] == 12.4
    assert changes[0].describe(5.0, ranks=4) == (
        "step timeout 180.0 s -> 12.4 s (max 2.48 s over 4 ranks, 10 observations, factor 5)")


def test_too_little_evidence_changes_nothing():
    result, changes = compute({"section:step": Observation(9, 2.0, 0)}, {"section:step": 180.0}, {}, cfg())
    assert result["section:step"] == 180.0 and not changes


def test_floor_stops_degenerate_samples():
    # a 4 ms time to first heartbeat must not become a 20 ms timeout
    result, _ = compute({"heartbeat:initial": Observation(50, 0.004, 0)}, {}, {}, cfg(calc_timeout_floor=5.0))
    assert result["heartbeat:initial"] == 5.0


def test_merge_grows_at_once_and_shrinks_halfway():
    grow, _ = compute({"section:step": Observation(20, 4.0, 0)}, {}, {"section:step": 10.0}, cfg())
    assert grow["section:step"] == 20.0
    shrink, _ = compute({"section:step": Observation(20, 1.0, 0)}, {}, {"section:step": 25.0}, cfg())
    assert shrink["section:step"] == 15.0  # (25 + 5) / 2


def test_pinned_and_explicit_null_are_never_replaced():
    c = FaultToleranceConfig.from_sources(
        ("f.yaml", {"rank_section_timeouts": {"step": 180, "checkpointing": None}, "pinned_timeouts": ["setup"]}),
        ("command line", {"ft-rank-section-timeouts": "setup:600,eval:300"}))
    c.calc_min_observations, c.calc_timeout_floor = 1, 0.1
    obs = {f"section:{k}": Observation(100, 1.0, 0) for k in ("setup", "step", "checkpointing", "eval")}
    result, _ = compute(obs, c.timeout_keys(), {}, c)
    assert result["section:setup"] == 600.0          # pinned
    assert result["section:checkpointing"] is None   # explicit null
    assert result["section:step"] == 5.0             # computed
    assert result["section:eval"] == 5.0             # a command-line value is a starting point, not a pin
    assert apply(c, result).rank_section_timeouts == {"setup": 600.0, "step": 5.0, "checkpointing": None,
                                                      "eval": 5.0}


def test_job_wide_view_sums_counts_and_takes_maxima():
    total = combine_all([{"section:step": Observation(5, 1.0, 1)}, {"section:step": Observation(7, 3.0, 2)}])
    assert total["section:step"] == Observation(12, 3.0, 2)


def test_state_round_trips_and_megatron_shape_loads_only_what_was_computed(tmp_path):
    path = str(tmp_path / "ft_state.json")
    state = ft_state_file.FtState({"section:step": 12.4, "out_of_section": 30.0, "heartbeat:subsequent": 6.0},
                                  {"section:step": Observation(800, 2.48, 1.0)}, {"safety_factor": 5.0}, 1.0,
                                  others={"section:setup": 600.0, "heartbeat:initial": None})
    ft_state_file.save(path, state)
    assert ft_state_file.load(path, warn=print) == state
    with open(path) as fh:
        written = json.load(fh)
    # NVRx's SectionTimeouts / HeartbeatTimeouts, field for field
    assert written["current_timeouts"] == {
        "section": {"section": {"setup": 600.0, "step": 12.4}, "out_of_section": 30.0,
                    "calculated_sections": ["step"], "is_out_of_section_calculated": True},
        "heartbeat": {"initial": None, "subsequent": 6.0, "were_calculated": False}}
    assert written["computed"] == ["heartbeat:subsequent", "out_of_section", "section:step"]
    # What NVRx's RankMonitorClient.state_dict() gives Megatron to write: only the calculated
    # values are taken as computed; 'setup' was configured in that job and stays out.
    with open(path, "w") as fh:
        json.dump({"current_timeouts": {
            "section": {"section": {"setup": 600.0, "step": 9.5}, "out_of_section": 120.0,
                        "calculated_sections": ["step"], "is_out_of_section_calculated": True},
            "heartbeat": {"initial": 300.0, "subsequent": 45.0, "were_calculated": False}}}, fh)
    loaded = ft_state_file.load(path, warn=print)
    assert loaded.timeouts == {"section:step": 9.5, "out_of_section": 120.0}
    assert loaded.others == {"section:setup": 600.0, "heartbeat:initial": 300.0, "heartbeat:subsequent": 45.0}
    # ft_launcher 0.1's flat format: every value in it was computed
    with open(path, "w") as fh:
        json.dump({"format_version": 1, "current_timeouts": {"section": {"step": 7.0}, "out_of_section": 20.0}}, fh)
    assert ft_state_file.load(path, warn=print).timeouts == {"section:step": 7.0, "out_of_section": 20.0}


CORRUPT_FORMS = [
    b'{"current_timeouts": {"section": {"step": 12',                       # truncated JSON
    b'{"format_version": 99, "current_timeouts": {}}',                      # unknown version
    b'{"current_timeouts": {"section": {"step": -1}}}',                     # negative seconds
    bytes(range(256))[::-1] * 2,                                            # random bytes, not UTF-8
    b'\xff\xfe{"current_timeouts": {}}',                                    # a UTF-16 BOM
    b"[" * 100_000,                                                         # deeper than the parser goes
    b'{"current_timeouts": {"section": {"section": {"step": NaN}}}}',       # not a number of seconds
    b'{"current_timeouts": {"section": {"section": {"step": 1e400}}}}',     # infinite
    b'{"current_timeouts": {}, "observations": [1, 2]}',                   # wrong types inside
    b'{"current_timeouts": {}, "observations": {"section:step": {"count": 1e400, "max": 1}}}',
    b'{"current_timeouts": {}, "observations": {"section:step": {"count": 3, "max": "slow"}}}',
    b'{"current_timeouts": {}, "config": 5}',
    b'{"current_timeouts": {}, "updated": [1]}',
]


def test_corrupt_file_is_set_aside_with_one_warning(tmp_path):
    path = tmp_path / "ft_state.json"
    for data in CORRUPT_FORMS:
        path.write_bytes(data)
        warnings = []
        assert ft_state_file.load(str(path), warn=warnings.append) is None, data[:60]
        assert len(warnings) == 1 and "kept aside" in warnings[0] and "\n" not in warnings[0], data[:60]
        assert not path.exists()
    kept = [p for p in os.listdir(tmp_path) if ".corrupt-" in p]
    assert len(kept) == len(CORRUPT_FORMS)  # nothing silently lost


def _writer(path, tag, count):
    for i in range(count):
        ft_state_file.save(path, ft_state_file.FtState({"section:step": float(i + 1)},
                                                       {"section:step": Observation(i, 1.0, 0)}, {"w": tag}, i))


def test_concurrent_writers_never_leave_a_torn_file(tmp_path):
    path = str(tmp_path / "ft_state.json")
    ctx = multiprocessing.get_context("spawn")
    writers = [ctx.Process(target=_writer, args=(path, tag, 150)) for tag in ("a", "b")]
    for w in writers:
        w.start()
    reads = 0
    while any(w.is_alive() for w in writers):
        if os.path.exists(path):
            with open(path) as fh:
                ft_state_file.parse(json.load(fh))  # raises on a torn file
            reads += 1
    for w in writers:
        w.join(timeout=60)
        assert w.exitcode == 0
    assert ft_state_file.load(path, warn=lambda m: (_ for _ in ()).throw(AssertionError(m))) is not None
    assert reads > 0


# ---- end to end: real jobs learn, persist and enforce -------------------------------------------

RANK = os.path.join(SCRIPTS, "monitored_rank.py")
LOOSE_YAML = """
fault_tolerance:
  rank_section_timeouts: {setup: 60, step: 60, fwd: 60, checkpointing: 60}
  pinned_timeouts: [heartbeat]     # heartbeats are not learned here: a hang must show as 'step'
  calc_ft_timeouts: true
  safety_factor: 20
  calc_timeout_floor: 1.0
"""


def _job(launcher, tmp_path, name, state, *extra, steps=40, restarts=0):
    cfg = tmp_path / "ft.yaml"
    cfg.write_text(LOOSE_YAML)
    out = tmp_path / f"out_{name}"
    out.mkdir()
    return launcher.start(["--standalone", "--nproc-per-node", "2", "--max-restarts", restarts,
                           "--log-dir", tmp_path / name, "--ft-cfg-path", cfg, "--ft-state-path", state,
                           RANK, out, "--steps", steps, *extra])


def _finish(proc, timeout=90):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return out, err


def test_a_job_learns_timeouts_and_the_next_run_catches_a_hang_with_them(launcher, tmp_path):
    state = tmp_path / "ft_state.json"
    _, err = _finish(_job(launcher, tmp_path, "first", state))
    saved = json.loads(state.read_text())
    sections = saved["current_timeouts"]["section"]
    step = sections["section"]["step"]
    assert 1.0 <= step < 10 and saved["observations"]["section:step"]["count"] >= 80  # 2 ranks x 40 steps
    # 'setup' closed twice (2 ranks): too little evidence, so it is there as configured, not computed
    assert sections["section"]["setup"] == 60.0 and "setup" not in sections["calculated_sections"]
    assert "step" in sections["calculated_sections"] and "section:setup" not in saved["computed"]
    assert "heartbeat" not in saved["current_timeouts"]          # pinned
    assert saved["format_version"] == 2 and saved["config"]["safety_factor"] == 20
    assert any(line.endswith("factor 20)") and "step timeout 60.0 s -> " in line for line in err.splitlines())
    # The second run starts with the learned 'step' timeout: a rank stuck in 'step' is caught
    # after about `step` seconds, not the configured 60.
    _, err = _finish(_job(launcher, tmp_path, "second", state, "--fault", "step", restarts=1))
    assert read_events(tmp_path / "second", "timeouts_loaded")
    hang = read_events(tmp_path / "second", "hang")
    assert len(hang) == 1 and hang[0]["rank"] == 1 and hang[0]["detail"]["section"] == "step"
    assert hang[0]["detail"]["timeout"] == pytest.approx(step) and hang[0]["detail"]["elapsed"] < 10


@pytest.mark.slow
def test_two_jobs_computing_into_one_file_leave_one_valid_file(launcher, tmp_path):
    state = tmp_path / "shared" / "ft_state.json"
    jobs = [_job(launcher, tmp_path, name, state, steps=60) for name in ("a", "b")]
    for proc in jobs:
        _finish(proc)
    loaded = ft_state_file.load(str(state), warn=lambda m: pytest.fail(m))
    assert loaded is not None and loaded.timeouts["section:step"] < 60
    assert not [p for p in os.listdir(state.parent) if p.startswith(".ft_state.")]  # no temp file left


def test_a_corrupt_state_file_is_set_aside_and_the_job_runs_on_configured_timeouts(launcher, tmp_path):
    state = tmp_path / "ft_state.json"
    garbage = bytes(range(256))[::-1] * 2   # random bytes: not even UTF-8
    state.write_bytes(garbage)
    _, err = _finish(_job(launcher, tmp_path, "run", state))
    assert "Traceback" not in err
    warnings = [l for l in err.splitlines() if "unreadable" in l]
    assert len(warnings) == 1 and "kept aside as" in warnings[0] and "configured timeouts" in warnings[0]
    aside = [p for p in os.listdir(tmp_path) if p.startswith("ft_state.json.corrupt-")]
    assert len(aside) == 1 and (tmp_path / aside[0]).read_bytes() == garbage
    assert ft_state_file.load(str(state), warn=lambda m: pytest.fail(m)) is not None  # a fresh, valid file


def test_a_megatron_state_file_is_loaded_and_enforced(launcher, tmp_path):
    """Only what the file marks calculated is applied: its configured 1 ms timeouts for 'setup',
    'fwd' and out-of-section would stop every rank at once if they were taken as computed."""
    state = tmp_path / "megatron_ft_state.json"
    state.write_text(json.dumps({"current_timeouts": {
        "section": {"section": {"setup": 0.001, "step": 1.5, "fwd": 0.001, "checkpointing": 60.0},
                    "out_of_section": 0.001, "calculated_sections": ["step"], "is_out_of_section_calculated": False},
        "heartbeat": {"initial": None, "subsequent": None, "were_calculated": False}}}))
    out = tmp_path / "out"
    out.mkdir()
    res = launcher.run(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", tmp_path / "logs",
                        "--ft-state-path", state, RANK, out, "--fault", "step"])
    assert res.returncode == 0, res.stderr
    hang = read_events(tmp_path / "logs", "hang")
    assert len(hang) == 1 and hang[0]["detail"]["section"] == "step" and hang[0]["detail"]["timeout"] == 1.5


def _example(launcher, tmp_path, name, *fault):
    """The example job (examples/ddp_train.py), learning with a 6 s floor, its step timeout 8 s at the
    start; `fault`: the example's own arguments for it."""
    state = tmp_path / f"{name}.json"
    res = launcher.run(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", tmp_path / name,
                        "--ft-calc-ft-timeouts", "true", "--ft-calc-timeout-floor", "6",
                        "--ft-rank-section-timeouts", "setup:30,step:8,checkpointing:10", "--ft-state-path", state,
                        EXAMPLE, "--steps", "150", "--step-time", "0.02", "--ckpt-dir", tmp_path / f"ckpt_{name}",
                        *fault], timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(state.read_text()), res.stderr


@pytest.mark.slow   # long (10-40 s); the default suite keeps a shorter test of the same path
def test_a_caught_hang_teaches_the_timeouts_nothing(launcher, tmp_path):
    """The hung occurrence (here a rank that SIGSTOPs itself inside step 60, as a simulated rank_hung
    does, resumed by its monitor for the stack dump, so that it does close the section), and what
    its peer finished only once it was resumed, must not loosen the next run's detection: the job
    with the hang persists what the job without it does. (A simulated fault by time landed in
    `setup` on a busy machine: the hang is placed by step instead.)"""
    plain, _ = _example(launcher, tmp_path, "plain")
    hung, err = _example(launcher, tmp_path, "hung", "--hang-in", "step", "--hang-by", "sigstop", "--fail-rank", "1",
                         "--hold-step", "60")
    hang = read_events(tmp_path / "hung", "hang")
    assert hang and hang[0]["detail"]["section"] == "step", err   # its peer, waiting in 'step' too, may follow
    elapsed = hang[0]["detail"]["elapsed"]   # >= 6 s: the step timeout, learned or configured
    assert hung["observations"]["section:step"]["max"] < elapsed / 2
    # the interval across the hang is no heartbeat observation: the longest real one spans setup and
    # the first step (a heartbeat before setup, the next after the step), 1-3 s as this machine is loaded
    ranks = [r["sections"] for e in read_events(tmp_path / "hung", "cycle_summary") for r in e["detail"]["ranks"].values()]
    longest_real = max(r["setup"]["max"] for r in ranks) + max(r["step"]["max"] for r in ranks) + 0.5
    assert hung["observations"]["heartbeat:subsequent"]["max"] <= longest_real
    step = lambda state: state["current_timeouts"]["section"]["section"]["step"]  # noqa: E731
    assert "section:step" in hung["computed"] and step(hung) == step(plain) == 6.0
