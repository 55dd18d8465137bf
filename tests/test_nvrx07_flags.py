"""NVRx 0.7's `ft_launcher` command line and `fault_tolerance:` keys run here unchanged.

The lists below are facts read from the nvidia-resiliency-ext 0.7.0 wheel (PyPI,
nvidia_resiliency_ext-0.7.0-cp312-cp312-manylinux_2_39_x86_64.whl): every option string of
`fault_tolerance/launcher.py:get_args_parser` and the `fault_tolerance/cli_args.py` helpers it
calls, and the fields of `fault_tolerance/config.py:FaultToleranceConfig`; NVRx 0.4.1's deprecated
spellings (`fault_tolerance/launcher.py` of 0.4.1) are added. Each flag is parsed with a sample
value into a LaunchConfig (parse level: no process starts): accepted, and either it sets what it
names or one line says what this launcher does instead.
"""
import os

import tempfile

import pytest
import yaml

from ft_launcher import cli, nvrx_flags
from ft_launcher.rank_monitor.config import FIELD_NAMES, FaultToleranceConfig, parse_value

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "env_dump.py")

# (every spelling NVRx 0.7 accepts, a sample value; None for a switch)
NVRX07_FLAGS = [
    (["--standalone"], None), (["--nproc-per-node", "--nproc_per_node"], "2"),
    (["--max-restarts", "--max_restarts"], "3"), (["--term-timeout", "--term_timeout"], "20"),
    (["--workers-stop-timeout", "--workers_stop_timeout"], "10"),
    (["--monitor-interval", "--monitor_interval"], "0.3"), (["--start-method", "--start_method"], "spawn"),
    (["--role"], "trainer"), (["-m", "--module"], None), (["--no-python", "--no_python"], None),
    (["--run-path", "--run_path"], None), (["--log-dir", "--log_dir"], "LOGDIR"),
    (["-r", "--redirects"], "0"), (["-t", "--tee"], "3"),
    (["--local-ranks-filter", "--local_ranks_filter"], "0"), (["--node-rank", "--node_rank"], "0"),
    (["--master-addr", "--master_addr"], "127.0.0.1"), (["--master-port", "--master_port"], "29511"),
    (["--logs-specs", "--logs_specs"], "my_specs"), (["--ft-cfg-path", "--ft-cfg_path"], "CFG"),
    (["--ft-workload-check-interval", "--ft-workload_check_interval"], "5"),
    (["--ft-initial-rank-heartbeat-timeout", "--ft-initial_rank_heartbeat_timeout"], "60"),
    (["--ft-rank-heartbeat-timeout", "--ft-rank_heartbeat_timeout"], "30"),
    (["--ft-node-health-check-interval", "--ft-node_health_check_interval"], "5"),
    (["--ft-node-health-check-endpoint", "--ft-node_health_check_endpoint"], "/var/run/nvhcd.sock"),
    (["--ft-safety-factor", "--ft-safety_factor"], "4"),
    (["--ft-rank-termination-signal", "--ft-rank_termination_signal"], "SIGTERM"),
    (["--ft-log-level", "--ft-log_level"], "DEBUG"),
    (["--ft-rank-out-of-section-timeout", "--ft-rank_out_of_section_timeout"], "null"),
    (["--ft-rank-section-timeouts", "--ft-rank_section_timeouts"], "setup:600,step:180"),
    (["--ft-restart-check-interval", "--ft-restart_check_interval"], "60"),
    (["--ft-restart-policy", "--ft-restart_policy"], "any-failed"),
    (["--ft-enable-nic-monitor", "--ft-enable_nic_monitor"], "false"),
    (["--ft-enable-nic-healthcheck", "--ft-enable_nic_healthcheck"], "true"),
    (["--ft-pci-topo-file", "--ft-pci_topo_file"], "/etc/topo.xml"),
    (["--ft-link-down-path-template", "--ft-link_down_path_template"], "/sys/{dev_name}/down"),
    (["--ft-link-state-path-template", "--ft-link_state_path_template"], "/sys/class/infiniband/{nic}/ports/1/state"),
    (["--ft-enable-dist-storage-healthcheck", "--ft_enable_dist_storage_healthcheck"], "true"),
    (["--ft-storage-health-check-path", "--ft_storage_health_check_path"], "/tmp"),
    (["--ft-segment-health-check-dir", "--ft_segment_health_check_dir"], "/tmp/seg"),
    (["--ft-skip-section-response", "--ft-skip_section_response"], "true"),
    (["--ft-rdzv-impl", "--ft-rdzv_impl"], "barrier"),
    (["--ft-numa-bind-strict", "--ft-numa_bind_strict"], "false"),
    (["--ft-gpu-memory-reclaim-timeout", "--ft-gpu_memory_reclaim_timeout"], "30"),
    (["--ft-gpu-memory-tolerance-mb", "--ft-gpu_memory_tolerance_mb"], "256"),
    (["--ft-gpu-memory-poll-interval", "--ft-gpu_memory_poll_interval"], "1"),
    (["--ft-check-remaining-processes", "--ft-check_remaining_processes"], "true"),
    (["--ft-install-exception-hook", "--ft-install_exception_hook"], "true"),
    (["--ft-ignore-missing-cfg"], None),
    (["--ft-max-no-progress-cycles", "--ft-max_no_progress_cycles"], "2"),
    (["--ft-min-progress-iterations", "--ft-min_progress_iterations"], "10"),
    (["--ft-checkpoint-iteration-file", "--ft-checkpoint_iteration_file"], "/tmp/latest_checkpointed_iteration.txt"),
    (["--nnodes"], "1"), (["--rdzv-backend", "--rdzv_backend"], "c10d"),
    (["--rdzv-endpoint", "--rdzv_endpoint"], "127.0.0.1:29512"), (["--rdzv-id", "--rdzv_id"], "job7"),
    (["--rdzv-conf", "--rdzv_conf"], "join_timeout=60"), (["--local-addr", "--local_addr"], "127.0.0.1"),
    (["--ft-segment", "--ft_segment"], "4"),
    (["--ft-no-restart-exit-code", "--ft_no_restart_exit_code"], "94"),
    (["--ft-per-cycle-applog-prefix", "--ft_per_cycle_applog_prefix"], "/tmp/job_1.log"),
    (["--ft-nvrx-logfile", "--ft_nvrx_logfile"], "/tmp/launcher.log"),
    (["--ft-enable-log-server", "--ft_enable_log_server"], "true"),
    (["--ft-log-server-port", "--ft_log_server_port"], "50051"),
    (["--ft-log-aggregator-count", "--ft_log_aggregator_count"], "0"),
    (["--ft-log-leaf-max-queue-chunks", "--ft_log_leaf_max_queue_chunks"], "-1"),
    (["--ft-log-server-log-prefix", "--ft_log_server_log_prefix"], "/tmp/grpc"),
    (["--ft-log-server-graceful-shutdown-timeout", "--ft_log_server_graceful_shutdown_timeout"], "60"),
    (["--ft-attribution-endpoint", "--ft_attribution_endpoint"], "localhost"),
    (["--ft-attribution-startup-timeout", "--ft_attribution_startup_timeout"], "30"),
    (["--ft-attribution-llm-api-key-file", "--ft_attribution_llm_api_key_file"], "/tmp/key"),
    (["--ft-attribution-llm-base-url", "--ft_attribution_llm_base_url"], "http://llm"),
    (["--ft-attribution-llm-model", "--ft_attribution_llm_model"], "m"),
    (["--ft-attribution-analysis-backend", "--ft_attribution_analysis_backend"], "lib"),
    (["--ft-attribution-stop-action", "--ft_attribution_stop_action"], "log"),
    (["--ft-attribution-log-level", "--ft_attribution_log_level"], "INFO"),
    (["--ft-attribution-export-url", "--ft_attribution_export_url"], "http://export"),
    (["--ft-cycle-info-dir", "--ft_cycle_info_dir"], "CYCLEDIR"),
]
# NVRx 0.4.1's spellings that 0.7 dropped
NVRX041_FLAGS = [(["--fault-tol-cfg-path"], "CFG"), (["--ignore-missing-fault-tol-cfg"], None),
                 (["--restart-policy", "--restart_policy"], "min-healthy")]

# FaultToleranceConfig's fields in NVRx 0.7 (fault_tolerance/config.py), each with a sample value
NVRX07_KEYS = {
    "workload_check_interval": 5.0, "initial_rank_heartbeat_timeout": 60, "rank_heartbeat_timeout": 30,
    "rank_section_timeouts": {"setup": 600, "step": 180}, "rank_out_of_section_timeout": None,
    "node_health_check_interval": 5.0, "safety_factor": 5.0, "rank_termination_signal": "SIGTERM",
    "log_level": "INFO", "restart_check_interval": 60.0, "enable_nic_monitor": False,
    "enable_nic_healthcheck": True, "enable_dist_storage_healthcheck": False, "storage_healthcheck_path": "/tmp",
    "pci_topo_file": None, "link_down_path_template": None, "link_state_path_template": None,
    "skip_section_response": True, "segment": 4, "numa_bind_strict": True, "gpu_memory_reclaim_timeout": 50.0,
    "gpu_memory_tolerance_mb": 512.0, "gpu_memory_poll_interval": 2.0, "check_remaining_processes": False,
    "max_no_progress_cycles": 3, "min_progress_iterations": 1, "checkpoint_iteration_file": "/tmp/it.txt",
    "install_exception_hook": True, "num_warmup_iterations": 5, "attribution_endpoint": "localhost",
    "attribution_stop_action": "log", "attribution_export_url": "http://export", "cycle_info_dir": "/tmp/nvrx",
    "segment_health_check_dir": "/tmp/seg",
}
# The keys with an effect here, and the field each flag sets (the others get one line).
BUILT = {"gpu_memory_reclaim_timeout", "gpu_memory_tolerance_mb", "gpu_memory_poll_interval",
         "install_exception_hook", "storage_healthcheck_path"}


def _argv(spelling, value, tmp_path):
    if value is None:
        return [spelling]
    value = {"LOGDIR": str(tmp_path / "logs"), "CFG": str(tmp_path / "ft.yaml"),
             "CYCLEDIR": str(tmp_path / "nvrx")}.get(value, value)
    return [spelling, value]


@pytest.fixture
def cfg_file(tmp_path):
    (tmp_path / "ft.yaml").write_text("fault_tolerance:\n  rank_heartbeat_timeout: 30\n")


def _conflicts(spelling):   # flags that need another to make sense, or exclude one
    return {"--no-python": [], "--no_python": []}.get(spelling)


@pytest.mark.parametrize("spellings,value", NVRX07_FLAGS + NVRX041_FLAGS, ids=lambda x: x[0] if isinstance(x, list) else "")
def test_every_nvrx_flag_is_accepted_in_each_spelling(spellings, value, tmp_path, cfg_file, capsys):
    for spelling in spellings:
        argv = _argv(spelling, value, tmp_path)
        script = [SCRIPT] if spelling not in ("-m", "--module") else ["json.tool"]
        if spelling in ("--no-python", "--no_python"):
            script = ["/bin/true"]
        cfg = cli.launch_config(argv + script)   # a UsageError would fail the test
        err = capsys.readouterr().err
        assert "Traceback" not in err and "unrecognized" not in err
        dest = spelling.lstrip("-").replace("_", "-")
        note = nvrx_flags.FLAGS.get(dest, (None, None))[1]
        if note:
            assert f"--{dest}: accepted for NVRx;" in err, err
        key = dest[3:].replace("-", "_") if dest.startswith("ft-") else None
        key = {"storage_health_check_path": "storage_healthcheck_path"}.get(key, key)
        if key in FIELD_NAMES:
            assert getattr(cfg.ft, key) == parse_value(key, argv[1], "sample"), key   # the flag sets its key
            if nvrx_flags.KEY_NOTES.get(key):
                assert f"{key}: accepted for NVRx, no effect here;" in err, err


def test_every_nvrx07_key_is_known_and_loads_from_yaml(tmp_path, capsys):
    assert set(NVRX07_KEYS) <= set(FIELD_NAMES)
    path = tmp_path / "ft.yaml"
    path.write_text(yaml.safe_dump({"model": {"fault_tolerance": NVRX07_KEYS}}))
    cfg = FaultToleranceConfig.from_yaml_file(str(path), ignore_not_recognized=False)
    assert cfg.segment == 4 and cfg.cycle_info_dir == "/tmp/nvrx" and cfg.install_exception_hook
    cfg = cli.launch_config(["--ft-cfg-path", str(path), SCRIPT]).ft
    err = capsys.readouterr().err
    assert "unknown fault_tolerance key" not in err
    assert cfg.gpu_memory_reclaim_timeout == 50.0 and cfg.min_progress_iterations == 1
    for key in NVRX07_KEYS:   # a key without an effect here says so in one line (when set away from default)
        if nvrx_flags.KEY_NOTES.get(key) and NVRX07_KEYS[key] != getattr(FaultToleranceConfig(), key):
            assert f"{key}: accepted for NVRx, no effect here;" in err, key


def test_every_key_is_either_built_or_has_its_line():
    known_before = {"workload_check_interval", "initial_rank_heartbeat_timeout", "rank_heartbeat_timeout",
                    "rank_section_timeouts", "rank_out_of_section_timeout", "safety_factor", "rank_termination_signal",
                    "log_level", "max_no_progress_cycles"}   # ours, with their meaning
    silent = {"node_health_check_interval", "restart_check_interval", "enable_nic_monitor", "enable_nic_healthcheck",
              "skip_section_response", "check_remaining_processes"}   # what they ask for is what happens here
    for key in NVRX07_KEYS:
        if key in BUILT or key in known_before:
            assert not nvrx_flags.KEY_NOTES.get(key), key
        elif key not in silent:
            assert nvrx_flags.KEY_NOTES.get(key), key


def test_storage_healthcheck_path_is_checked_before_each_rendezvous(tmp_path):
    from ft_launcher.agent.health_checks import HealthChecks

    said = []
    ft = FaultToleranceConfig(storage_healthcheck_path=f"{tmp_path}, {tmp_path / 'missing'}")
    assert HealthChecks(ft, None, said.append).run() == f"storage_healthcheck_path: {tmp_path / 'missing'} does not exist"
    ft.storage_healthcheck_path = str(tmp_path)
    assert HealthChecks(ft, None, said.append).run() is None


# ---- built: --ft-install-exception-hook -------------------------------------------------------
from conftest import SCRIPTS, read_events  # noqa: E402


@pytest.fixture(autouse=True)
def _temp_dir_of_the_test(tmp_path, monkeypatch):
    """--redirects without --log-dir makes its log dir in the temp dir as the config is built: here, the test's."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

RAISE_RANK = os.path.join(SCRIPTS, "raise_rank.py")


def test_exception_hook_reports_a_plain_scripts_uncaught_exception_at_raise_time(launcher, tmp_path):
    logs = tmp_path / "logs"
    res = launcher.run(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", logs,
                        "--ft-install-exception-hook", "true", "--ft-warm-reserves", "0", RAISE_RANK, "1"],
                       timeout=120)
    assert res.returncode == 0, res.stderr
    failures = read_events(logs, "failure")
    assert len(failures) == 1, failures
    detail = failures[0]["detail"]
    assert failures[0]["rank"] == 1 and detail["exception"].startswith("ValueError: boom in rank 1 at step 5 at raise_rank.py:")
    assert "rank 1 on node 0" in res.stdout + res.stderr and "raised ValueError: boom in rank 1" in res.stdout + res.stderr
    assert "Traceback" in res.stderr and 'raise_rank.py", line' in res.stderr   # Python's traceback, from the script's frame
    assert "runpy" not in res.stderr
    for rank in (0, 1):   # the script ran as `python raise_rank.py` would run it
        assert f"rank {rank} path0={SCRIPTS} name=__main__" in res.stdout
        assert f"rank {rank} done in cycle 1" in res.stdout


def test_nvrx07_client_calls_work_and_the_hook_follows_the_jobs_config(launcher, tmp_path):
    logs = tmp_path / "logs"
    res = launcher.run(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", logs,
                        "--ft-install-exception-hook", "true", "--ft-gpu-memory-reclaim-timeout", "7",
                        "--ft-rank-section-timeouts", "step:60", os.path.join(SCRIPTS, "nvrx07_client.py")],
                       timeout=120)
    assert res.returncode == 0, res.stderr
    assert "Traceback" in res.stdout + res.stderr
    for rank in (0, 1):
        assert f"rank {rank} initialized=True warmup=3 hook=True reclaim=7.0" in res.stdout
    failure, = read_events(logs, "failure")
    assert failure["rank"] == 1 and failure["detail"]["exception"].startswith("RuntimeError: client rank fails")
