"""ft_launcher.ft_config_loading: the launcher's flags and YAML into one FaultToleranceConfig
(command line > FT_SIM_FAULT_DESC > file > defaults); a bad value or file is one line."""
import pytest

from ft_launcher.flags import UsageError, build_parser
from ft_launcher.ft_config_loading import ft_config_from_args


def from_flags(*flags):
    return ft_config_from_args(build_parser().parse_args([*flags, "train.py"]))


def test_flags_beat_the_file_and_the_file_beats_the_defaults(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("FT_SIM_FAULT_DESC", raising=False)
    path = tmp_path / "ft.yaml"
    path.write_text("model:\n  fault_tolerance:\n    safety_factor: 3\n    rank_heartbeat_timeout: 7\n"
                    "    safety_facter: 2\n")
    ft, given = from_flags("--ft-cfg-path", str(path), "--ft-param-rank_heartbeat_timeout", "5", "--max-restarts", "2")
    assert (ft.safety_factor, ft.rank_heartbeat_timeout) == (3.0, 5.0)
    assert given == {"rank_heartbeat_timeout": "5"}   # only the --ft-<key> flags on the command line
    err = capsys.readouterr().err
    assert err.startswith("ft_launcher: warning: ") and "safety_facter" in err and err.count("\n") == 1
    ft, given = from_flags()
    assert given == {} and ft.safety_factor == 5.0


def test_a_bad_value_or_file_is_one_line(tmp_path):
    with pytest.raises(UsageError, match=r"^command line: rank_heartbeat_timeout must be seconds or null, got 'soon'$"):
        from_flags("--ft-rank-heartbeat-timeout", "soon")
    with pytest.raises(UsageError, match=f"^--ft-cfg-path: no such file: {tmp_path}/none.yaml$"):
        from_flags("--ft-cfg-path", str(tmp_path / "none.yaml"))
