"""Fault-tolerance configuration through the real command line: precedence (CLI > file >
defaults, per section), NVRx's spellings, YAML nested anywhere, and a one-line error (exit 2,
no traceback) for every kind of bad input."""
import pytest

from conftest import SCRIPTS
from harness import write
from ft_launcher.cli import launch_config

SCRIPT = f"{SCRIPTS}/env_dump.py"


def ft_of(*argv):
    return launch_config([*map(str, argv), SCRIPT]).ft


def test_defaults_without_any_configuration():
    ft = ft_of("--standalone")
    assert ft.rank_section_timeouts == {} and ft.rank_out_of_section_timeout is None
    assert ft.rank_termination_signal == 9 and ft.safety_factor == 5.0


def test_cli_overrides_file_per_section_and_file_overrides_defaults(tmp_path):
    cfg = write(tmp_path, """
model:
  trainer:
    fault_tolerance:            # nested, as Megatron and NeMo configs do
      rank_section_timeouts: {setup: 600, step: 180, checkpointing: null}
      rank_out_of_section_timeout: 300
      rank_termination_signal: SIGTERM
      safety_factor: 3
""")
    ft = ft_of("--ft-cfg-path", cfg, "--ft-rank-section-timeouts", "step:20", "--ft-safety-factor", "7")
    assert ft.rank_section_timeouts == {"setup": 600.0, "step": 20.0, "checkpointing": None}
    assert ft.rank_out_of_section_timeout == 300.0      # file over default
    assert ft.rank_termination_signal == 15 and ft.safety_factor == 7.0
    assert ft.pinned_timeouts == ["section:checkpointing"]   # an explicit null is pinned


def test_pins_by_name_from_the_command_line():
    ft = ft_of("--standalone", "--ft-pinned-timeouts", "step,out_of_section,heartbeat")
    assert ft.pinned_timeouts == ["heartbeat:initial", "heartbeat:subsequent", "out_of_section", "section:step"]


@pytest.mark.parametrize("flag", ["--ft-rank-section-timeouts", "--ft-rank_section_timeouts",
                                  "--ft-param-rank_section_timeouts", "--ft-param-rank-section-timeouts"])
def test_nvrx_spellings_of_a_flag(flag):
    assert ft_of("--standalone", flag, "setup:600,step:180").rank_section_timeouts == {"setup": 600.0, "step": 180.0}


def test_signal_by_number_and_null_timeouts_from_the_command_line():
    ft = ft_of("--standalone", "--ft-rank-termination-signal", "15", "--ft-rank-heartbeat-timeout", "null")
    assert ft.rank_termination_signal == 15 and ft.rank_heartbeat_timeout is None


OPTIONAL_PATHS = ("checkpoint_dir", "ft_state_path", "cycle_info_dir", "checkpoint_iteration_file",
                  "storage_healthcheck_path", "link_state_path_template", "pci_topo_file", "link_down_path_template")


@pytest.mark.parametrize("word", ["none", "null", "None", ""])
def test_every_optional_path_reads_none_and_null_as_no_path(word):
    """`--ft-checkpoint-dir none` is no directory, as `cycle_info_dir: none` always was (it was the
    string 'none' there, so the health check tested ./none)."""
    from ft_launcher.rank_monitor.config import FaultToleranceConfig

    for key in OPTIONAL_PATHS:
        flag = "--" + key.replace("_", "-") if key.startswith("ft_") else "--ft-" + key.replace("_", "-")
        assert getattr(ft_of("--standalone", flag, word), key) is None, key
        assert getattr(FaultToleranceConfig.from_kwargs(**{key: word}), key) is None, key
    assert ft_of("--standalone", "--ft-checkpoint-dir", "ckpt").checkpoint_dir == "ckpt"


def test_unknown_key_in_a_file_warns_with_the_closest_key(launcher, tmp_path):
    cfg = write(tmp_path, "fault_tolerance:\n  rank_section_timout: {step: 5}\n  safety_factor: 2\n")
    res = launcher.run(["--standalone", "--ft-cfg-path", cfg, SCRIPT, tmp_path])
    assert res.returncode == 0, res.stderr
    assert ("warning: " + cfg + ": unknown fault_tolerance key 'rank_section_timout' "
            "(did you mean 'rank_section_timeouts'?); ignored") in res.stderr


BAD = [
    (["--ft-rank-section-timeouts", "step:-1"], "rank_section_timeouts.step must be a positive number"),
    (["--ft-rank-section-timeouts", "step:abc"], "rank_section_timeouts.step must be seconds or null"),
    (["--ft-rank_section_timeouts", "step"], "expected name:seconds"),
    (["--ft-rank-termination-signal", "SIGFOO"], "unknown signal 'SIGFOO'"),
    (["--ft-rank-termination-signal", "99"], "99 is not a signal number"),
    (["--ft-safety-factor", "-1"], "safety_factor must be a non-negative number"),
    (["--ft-param-initial_rank_heartbeat_timeout", "-3"], "initial_rank_heartbeat_timeout must be a positive"),
    (["--ft-rank-heartbeat-timeout", "true"], "rank_heartbeat_timeout must be seconds or null"),
    (["--ft-log-level", "LOUD"], "log_level must be DEBUG, INFO"),
    (["--ft-calc-ft-timeouts", "maybe"], "calc_ft_timeouts must be true or false"),
    (["--ft-simulated-fault-type", "rank_exploded"], "simulated_fault_type must be one of"),
    (["--ft-rank-out-of-section-timout", "5"], "did you mean --ft-rank-out-of-section-timeout?"),
    (["--ft-cfg-path", "nope.yaml"], "--ft-cfg-path: no such file: nope.yaml"),
    (["--ft-pinned-timeouts", "heartbeat:final"], "pinned_timeouts: unknown timeout 'heartbeat:final'"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_flag_values_are_one_line_errors(launcher, tmp_path, args, message):
    res = launcher.run(["--standalone", *args, SCRIPT, tmp_path], timeout=60)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ft_launcher: error:") and message in lines[0], res.stderr


BAD_FILES = [
    ("fault_tolerance:\n  rank_section_timeouts: {step: 5\n", "invalid YAML at line 3"),
    ("model:\n  x: 1\n", "no 'fault_tolerance:' section found"),
    ("fault_tolerance: [1, 2]\n", "'fault_tolerance:' must be a mapping"),
    ("fault_tolerance:\n  rank_heartbeat_timeout: -1\n", "rank_heartbeat_timeout must be a positive number"),
    ("fault_tolerance:\n  rank_section_timeouts: [1, 2]\n", "rank_section_timeouts must map section names"),
]


@pytest.mark.parametrize("text,message", BAD_FILES, ids=[m for _, m in BAD_FILES])
def test_bad_yaml_files_are_one_line_errors(launcher, tmp_path, text, message):
    cfg = write(tmp_path, text)
    res = launcher.run(["--standalone", "--ft-cfg-path", cfg, SCRIPT, tmp_path], timeout=60)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ft_launcher: error:") and message in lines[0], res.stderr
