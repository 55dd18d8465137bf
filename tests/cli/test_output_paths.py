"""ft_launcher.output_paths: the log dir and the streams its files get, and every path the
launcher will write checked before anything starts (one line naming the flag)."""
import os
import tempfile

import pytest

from ft_launcher.flags import UsageError, build_parser
from ft_launcher.output_paths import check_nvrx_log_paths, check_output_paths, resolve_logs
from ft_launcher.rank_monitor.config import FaultToleranceConfig


def args(*flags):
    return build_parser().parse_args([*flags, "train.py"])


def test_a_log_dir_gets_every_rank_and_redirects_without_one_get_a_temporary_one(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    os.mkdir(tmp_path / "tmp")
    assert resolve_logs(args(), 2) == (None, {}, {})
    assert resolve_logs(args("--log-dir", "logs"), 2) == (str(tmp_path / "logs"), {}, {0: 3, 1: 3})
    assert resolve_logs(args("--log-dir", "logs", "--tee", "1"), 2) == (str(tmp_path / "logs"), {}, {0: 1, 1: 1})
    assert resolve_logs(args("--log-dir", "logs", "--redirects", "0:2"), 2) == (str(tmp_path / "logs"), {0: 2}, {})
    assert not capsys.readouterr().err
    log_dir, capture, tee = resolve_logs(args("--redirects", "3"), 2)
    assert os.path.dirname(log_dir) == str(tmp_path / "tmp") and os.path.isdir(log_dir)
    assert (capture, tee) == ({0: 3, 1: 3}, {})
    assert capsys.readouterr().err == f"ft_launcher: --redirects without --log-dir: logs go to {log_dir}\n"
    with pytest.raises(UsageError, match=r"^--tee: expected 0-3 or local_rank:mask"):
        resolve_logs(args("--tee", "4"), 2)


def test_every_path_written_is_checked_first(tmp_path):
    (tmp_path / "a_file").write_text("")
    check_output_paths(str(tmp_path / "new_logs"), FaultToleranceConfig())
    assert os.path.isdir(tmp_path / "new_logs")   # made now
    with pytest.raises(UsageError, match=f"^--log-dir: {tmp_path}/a_file exists and is not a directory$"):
        check_output_paths(str(tmp_path / "a_file"), FaultToleranceConfig())
    with pytest.raises(UsageError, match=f"^--ft-state-path: {tmp_path} is a directory, not a file$"):
        check_output_paths(None, FaultToleranceConfig(ft_state_path=str(tmp_path)))
    check_output_paths(None, FaultToleranceConfig(ft_state_path=str(tmp_path / "state" / "ft.json")))
    assert os.path.isdir(tmp_path / "state")
    check_nvrx_log_paths(args("--ft-nvrx-logfile", str(tmp_path / "nvrx" / "launcher.log")), FaultToleranceConfig())
    assert os.path.isdir(tmp_path / "nvrx")
    with pytest.raises(UsageError, match=f"^--ft-per-cycle-applog-prefix: {tmp_path}/a_file exists and is not a "
                                         "directory$"):
        check_nvrx_log_paths(args("--ft-per-cycle-applog-prefix", str(tmp_path / "a_file" / "app")),
                             FaultToleranceConfig())
    with pytest.raises(UsageError, match=f"^--ft-cycle-info-dir: {tmp_path}/a_file exists and is not a directory$"):
        check_nvrx_log_paths(args(), FaultToleranceConfig(cycle_info_dir=str(tmp_path / "a_file")))
