"""Computed timeouts: the rule (evidence, floor, merge, pins) and ft_state.json (atomic, lenient,
corrupt files set aside). Each rule test fails if its rule is broken."""
import json
import multiprocessing
import os

from rank_monitor import ft_state_file
from rank_monitor.config import FaultToleranceConfig
from rank_monitor.timeout_calc import Observation, apply, combine_all, compute


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
        ("f.yaml", {"rank_section_timeouts": {"step": 180, "checkpointing": None}}),
        ("command line", {"ft-rank-section-timeouts": "setup:600"}))
    c.calc_min_observations, c.calc_timeout_floor = 1, 0.1
    obs = {k: Observation(100, 1.0, 0) for k in ("section:setup", "section:step", "section:checkpointing")}
    result, _ = compute(obs, c.timeout_keys(), {}, c)
    assert result["section:setup"] == 600.0          # pinned on the command line
    assert result["section:checkpointing"] is None   # explicit null
    assert result["section:step"] == 5.0             # computed
    assert apply(c, result).rank_section_timeouts == {"setup": 600.0, "step": 5.0, "checkpointing": None}


def test_job_wide_view_sums_counts_and_takes_maxima():
    total = combine_all([{"section:step": Observation(5, 1.0, 1)}, {"section:step": Observation(7, 3.0, 2)}])
    assert total["section:step"] == Observation(12, 3.0, 2)


def test_state_round_trips_and_megatron_shape_loads(tmp_path):
    path = str(tmp_path / "ft_state.json")
    state = ft_state_file.FtState({"section:step": 12.4, "out_of_section": 30.0, "heartbeat:initial": 60.0},
                                  {"section:step": Observation(800, 2.48, 1.0)}, {"safety_factor": 5.0}, 1.0)
    ft_state_file.save(path, state)
    assert ft_state_file.load(path, warn=print) == state
    # what NVRx's RankMonitorClient.state_dict() gives Megatron to write
    with open(path, "w") as fh:
        json.dump({"current_timeouts": {
            "section": {"section": {"setup": 600.0, "step": 9.5}, "out_of_section": 120.0,
                        "calculated_sections": ["step"], "is_out_of_section_calculated": True},
            "heartbeat": {"initial": 300.0, "subsequent": 45.0, "were_calculated": True}}}, fh)
    loaded = ft_state_file.load(path, warn=print)
    assert loaded.timeouts == {"section:setup": 600.0, "section:step": 9.5, "out_of_section": 120.0,
                               "heartbeat:initial": 300.0, "heartbeat:subsequent": 45.0}


def test_corrupt_file_is_set_aside_with_one_warning(tmp_path):
    path = tmp_path / "ft_state.json"
    for text in ('{"current_timeouts": {"section": {"step": 12', '{"format_version": 99, "current_timeouts": {}}',
                 '{"current_timeouts": {"section": {"step": -1}}}'):
        path.write_text(text)
        warnings = []
        assert ft_state_file.load(str(path), warn=warnings.append) is None
        assert len(warnings) == 1 and "kept aside" in warnings[0]
        assert not path.exists()
    kept = [p for p in os.listdir(tmp_path) if ".corrupt-" in p]
    assert len(kept) == 3  # nothing silently lost


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
