"""ft_launcher.flag_notes: one line for each flag or key the launcher takes but handles its own way
(torchrun's, NVRx's, the NIC check and NUMA binding on this node), and the job unchanged."""
import pytest

from ft_launcher.flag_notes import ft_notes, torchrun_notes
from ft_launcher.flags import UsageError, build_parser
from ft_launcher.ft_config_loading import ft_config_from_args


def notes(capsys, *flags, nproc=1):
    args = build_parser().parse_args([*flags, "train.py"])
    torchrun_notes(args)
    ft, ft_cli = ft_config_from_args(args)
    ft_notes(args, ft, ft_cli, nproc)
    return capsys.readouterr().err.splitlines()


def test_no_flags_no_lines(capsys, monkeypatch):
    monkeypatch.delenv("NVRX_GPUS_PER_NUMA", raising=False)
    assert notes(capsys) == []


def test_one_line_per_flag_handled_differently(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("NVRX_GPUS_PER_NUMA", raising=False)
    lines = notes(capsys, "--logs-specs", "mine", "--ft-restart-policy", "min-healthy", "--ft-enable-log-server", "1",
                  "--ft-num-warmup-iterations", "3", "--ft-numa-bind-strict", "true",
                  "--ft-link-state-path-template", f"{tmp_path}/none/{{nic}}/state")
    assert [line.split(":")[1].strip() for line in lines] == [
        "note", "--ft-restart-policy", "--ft-enable-log-server", "num_warmup_iterations", "enable_nic_healthcheck",
        "numa_bind_strict"], lines
    assert lines[0] == ("ft_launcher: note: --logs-specs: no LogsSpecs plugin is loaded; ft_launcher lays out rank "
                        "logs itself (--log-dir, --redirects, --tee)")
    assert lines[2].startswith("ft_launcher: --ft-enable-log-server: accepted for NVRx; no gRPC log server here")
    assert lines[4] == (f"ft_launcher: enable_nic_healthcheck: skipped on this node: {tmp_path}/none does not exist "
                        "(no RDMA NIC to check)")
    assert lines[5] == ("ft_launcher: numa_bind_strict: NVRX_GPUS_PER_NUMA is not set, so ranks are not bound to "
                        "NUMA nodes (as in NVRx)")


def test_what_cannot_be_done_is_one_line_error(capsys):
    with pytest.raises(UsageError, match=r"^--virtual-local-rank is not supported: every rank sees every GPU"):
        notes(capsys, "--virtual-local-rank")
    with pytest.raises(UsageError, match=r"^link_state_path_template: '/sys/x/state' must contain \{nic\}"):
        notes(capsys, "--ft-link-state-path-template", "/sys/x/state")
    with pytest.raises(UsageError, match=r"^command line: rank_section_timeouts: expected name:seconds"):
        notes(capsys, "--ft-rank-section-timeouts", "bogus")
