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

from conftest import ROOT
from ft_launcher import cli, nvrx_flags
from ft_launcher.rank_monitor.config import FIELD_NAMES, FaultToleranceConfig, parse_value

SCRIPT = os.path.join(ROOT, "tests", "scripts", "env_dump.py")

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
    (["--ft-segment", "--ft_segment"], "1"),   # a multiple of the training nodes (1)
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
    "skip_section_response": True, "segment": 1, "numa_bind_strict": True, "gpu_memory_reclaim_timeout": 50.0,
    "gpu_memory_tolerance_mb": 512.0, "gpu_memory_poll_interval": 2.0, "check_remaining_processes": False,
    "max_no_progress_cycles": 3, "min_progress_iterations": 1, "checkpoint_iteration_file": "/tmp/it.txt",
    "install_exception_hook": True, "num_warmup_iterations": 5, "attribution_endpoint": "localhost",
    "attribution_stop_action": "log", "attribution_export_url": "http://export", "cycle_info_dir": "/tmp/nvrx",
    "segment_health_check_dir": "/tmp/seg",
}
# The keys with an effect here, and the field each flag sets (the others get one line).
BUILT = {"gpu_memory_reclaim_timeout", "gpu_memory_tolerance_mb", "gpu_memory_poll_interval",
         "install_exception_hook", "storage_healthcheck_path", "cycle_info_dir", "checkpoint_iteration_file",
         "min_progress_iterations", "segment", "enable_nic_healthcheck", "link_state_path_template",
         "enable_dist_storage_healthcheck", "check_remaining_processes", "numa_bind_strict"}


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
    assert cfg.segment == 1 and cfg.cycle_info_dir == "/tmp/nvrx" and cfg.install_exception_hook
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
    from ft_launcher.agent.recovery.health_checks import HealthChecks

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


# ---- built: --ft-cycle-info-dir, --ft-per-cycle-applog-prefix, --ft-nvrx-logfile, --ft-check-remaining-processes
import json  # noqa: E402
import socket  # noqa: E402

from ft_launcher.agent.observation import nvrx_cycle_info, nvrx_logs  # noqa: E402

CYCLE_RANK = os.path.join(SCRIPTS, "nvrx_cycle_rank.py")
# NVRx 0.7's NVRxCycleInfo fields in their order (shared_utils/proto/nvrx_interface.proto)
CYCLE_INFO_KEYS = ["job_id", "attempt_index", "cycle_number", "cycle_start_time", "cycle_end_time", "cycle_log_file",
                   "active_nodes", "standby_nodes", "generation", "active_ranks"]


def test_cycle_info_files_the_applog_and_the_launcher_log_follow_each_cycle(launcher, tmp_path):
    """Rank 1 fails in cycle 0, the job restarts once: NVRx's files for both cycles, beside ours."""
    logs, info, applog, nvrxlog = tmp_path / "logs", tmp_path / "nvrx", tmp_path / "app" / "job.log", tmp_path / "l.log"
    res = launcher.run(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", logs,
                        "--ft-cycle-info-dir", info, "--ft-per-cycle-applog-prefix", applog, "--ft-nvrx-logfile",
                        nvrxlog, "--ft-check-remaining-processes", "true", "--ft-warm-reserves", "0",
                        CYCLE_RANK, "1", "1"], extra_env={"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "2"})
    assert res.returncode == 0, res.stderr
    assert sorted(os.listdir(info)) == ["cycle_info.4242.2.0", "cycle_info.4242.2.1", "cycle_info.4242.current"]
    assert os.readlink(info / "cycle_info.4242.current") == "cycle_info.4242.2.1"
    host = nvrx_cycle_info.node_list([socket.gethostname()])
    for cycle in (0, 1):
        record = json.loads((info / f"cycle_info.4242.2.{cycle}").read_text())
        assert list(record) == CYCLE_INFO_KEYS
        assert record["job_id"] == "4242" and record["attempt_index"] == 2 and record["cycle_number"] == cycle
        assert record["cycle_start_time"].endswith("Z") and record["cycle_start_time"] < record["cycle_end_time"]
        assert record["generation"] == "1"   # written at the start, rewritten once with the end
        assert record["cycle_log_file"] == str(tmp_path / "app" / f"job_cycle{cycle}.log")
        assert (record["active_nodes"], record["standby_nodes"], record["active_ranks"]) == (host, "", "0")
        for rank in (0, 1):   # NVRX_CURRENT_CYCLE_INFO, read by the rank when it starts, is that cycle's
            assert (f"rank {rank} cycle {cycle} info cycle={cycle} ranks=0 "
                    f"link={info}/cycle_info.4242.current") in res.stdout
    cycle0 = (tmp_path / "app" / "job_cycle0.log").read_text().splitlines()
    cycle1 = (tmp_path / "app" / "job_cycle1.log").read_text().splitlines()
    for rank in (0, 1):   # both streams, NVRx's rank prefix, each cycle in its own file
        assert f"{rank}: rank {rank} cycle 0 to stdout" in cycle0 and f"{rank}: rank {rank} cycle 0 to stderr" in cycle0
        assert f"{rank}: rank {rank} done in cycle 1" in cycle1
    assert "1: rank 1 failing in cycle 0" in cycle0 and not any("cycle 1" in line for line in cycle0)
    ours = (logs / "cycle_0" / "rank_1.log").read_text()   # ours as they were
    assert "rank 1 failing in cycle 0\n" in ours and "1: rank" not in ours
    assert "[rank 1] rank 1 failing in cycle 0" in res.stdout
    launcher_lines = nvrxlog.read_text()
    assert "restarting all ranks: cycle 1 (restart 1/1)" in launcher_lines and "job complete" in launcher_lines
    remaining = read_events(logs, "remaining_processes")
    assert [(e["cycle"], e["detail"]["count"]) for e in remaining] == [(0, 0), (1, 0)]


def test_nvrx_names_and_forms():
    assert nvrx_cycle_info.node_list(["node003.cluster", "node001", "node002", "node010", "gpu7"]) == \
        "gpu[7],node[001-003,010]"
    assert nvrx_cycle_info.node_list(["login", "node1"]) == "login,node1"
    assert nvrx_cycle_info.rank_ranges([0, 1, 2, 5, 6, 9]) == "0-2,5-6,9"
    assert nvrx_logs.cycle_log_file("/l/job.txt", 3) == "/l/job_cycle3.txt"
    assert nvrx_logs.cycle_log_file("/l/job", 0) == "/l/job_cycle0.log"
    assert [nvrx_logs.rank_prefix(r, 16) for r in (3, 12)] == [" 3: ", "12: "]
    assert nvrx_logs.rank_prefix(0, 1) == "0: "
    assert nvrx_cycle_info.current_link("/x/nvrx/", {}) == "/x/nvrx/cycle_info..current"   # NVRx outside SLURM
    assert nvrx_cycle_info.current_link("/x", {"SLURM_ARRAY_JOB_ID": "7", "SLURM_JOB_ID": "8"}) == "/x/cycle_info.7.current"


def test_the_cycle_info_writer_says_once_when_it_cannot_write(tmp_path):
    (tmp_path / "file").write_text("")
    said = []
    writer = nvrx_cycle_info.CycleInfoWriter(str(tmp_path / "file" / "nvrx"), lambda what, exc: said.append(what))
    node = type("N", (), {"node_id": "node7-123-abcdef"})()
    writer.start(0, [node], [])
    writer.end()
    assert len(said) == 1 and "cannot write the cycle info file" in said[0]


# ---- built: --ft-checkpoint-iteration-file, --ft-min-progress-iterations -------------------------
@pytest.mark.parametrize("advance,minimum,code", [pytest.param(0, 1, 93, marks=pytest.mark.slow),
                                                   pytest.param(5, 10, 93, marks=pytest.mark.slow), (20, 10, 1),
                                                   pytest.param(None, 1, 1, marks=pytest.mark.slow)],
                         ids=["stuck", "too_little", "progress", "no_file"])
def test_progress_is_the_checkpoint_iteration_and_feeds_the_no_progress_stop(launcher, tmp_path, advance, minimum, code):
    """The only rank fails in every cycle after adding `advance` to the checkpoint iteration (100 at
    first): a rise below min_progress_iterations twice in a row stops the job with 93; enough of a
    rise goes on until the restart budget is spent (1); no file (never written) is never judged."""
    ckpt = tmp_path / "latest_checkpointed_iteration.txt"
    if advance is not None:
        ckpt.write_text("100\n")
    logs = tmp_path / "logs"
    res = launcher.run(["--standalone", "--nproc-per-node", "1", "--max-restarts", "3", "--log-dir", logs,
                        "--ft-checkpoint-iteration-file", ckpt, "--ft-min-progress-iterations", minimum,
                        "--ft-max-no-progress-cycles", "2", "--ft-warm-reserves", "0", CYCLE_RANK, "0", "-1"]
                       + ([ckpt, advance] if advance is not None else []), timeout=120)
    assert res.returncode == code, res.stderr
    cycles = len(read_events(logs, "cycle_start"))
    if code == 93:
        assert cycles == 2
        assert (f"no progress: 2 cycles in a row ended without the checkpoint iteration in {ckpt} rising by "
                f"min_progress_iterations={minimum} (it reads {100 + 2 * advance}; max_no_progress_cycles=2)") in res.stderr
    else:
        assert cycles == 4 and "no progress" not in res.stderr   # every restart used
        if advance:
            assert ckpt.read_text() == str(100 + 4 * advance)


def test_min_progress_iterations_counts_completed_steps_without_the_file():
    from ft_launcher.agent.recovery.progress import ProgressTracker

    class Monitor:
        def __init__(self, steps):
            self.steps = steps

        def section_stats(self):
            return {"sections": {"step": {"count": self.steps}}}

    class Proto(dict):
        def put(self, key, value):
            self[key] = value

        def exists(self, key):
            return key in self

    proto, tracker = Proto(), ProgressTracker(2, min_iterations=5)
    tracker.poll(proto, 0, [Monitor(4), Monitor(3)])   # no rank has 5 steps in cycle 0
    assert "r0/progress" not in proto
    tracker.poll(proto, 0, [Monitor(5), Monitor(1)])
    assert proto["r0/progress"] == "1"
    from ft_launcher.agent.recovery.restart_policy import PolicyInputs, RestartPolicy

    policy = RestartPolicy(5, no_progress_limit=2, min_progress_iterations=5)
    assert policy.no_progress(PolicyInputs(progress=tracker.history(proto, 2))) == (
        "no progress: 2 cycles in a row ended without 5 completed 'step' sections on any rank "
        "(max_no_progress_cycles=2); restarting is pointless")


# ---- built: --ft-segment N (NVLink-domain segments; NVML's cluster UUID from tests/fake_nvml) ------
from ft_launcher.agent.rounds import segments  # noqa: E402
from ft_launcher.agent.rounds.round_types import NodeInfo  # noqa: E402
from conftest import free_port, wait_for as _wait_for  # noqa: E402

FAKE_NVML = os.path.join(ROOT, "tests", "fake_nvml")
DOMAIN_A, DOMAIN_B = "aaaaaaaa-0000-4000-8000-000000000001", "bbbbbbbb-0000-4000-8000-000000000002"


def _nodes(*domains):
    return [NodeInfo(node_id=f"n{i}-1-abc", host="h", order_key=i, nproc=1, domain=d) for i, d in enumerate(domains)]


def test_segments_take_whole_segments_domain_by_domain():
    nodes = _nodes("A", "B", "B", "A", "C", "B")
    active, spares = segments.split(nodes, 4, 2)   # A gives 2 (nodes 0, 3), B gives 2 (nodes 1, 2)
    assert [n.order_key for n in active] == [0, 3, 1, 2] and [n.order_key for n in spares] == [4, 5]
    assert segments.split(_nodes("A", "B", "C", "A"), 4, 2) is None   # only one whole segment
    active, spares = segments.split(_nodes("A", "B", "B"), 2, 2)   # A's lone node waits
    assert [n.order_key for n in active] == [1, 2] and [n.order_key for n in spares] == [0]
    assert "hold 1 whole segment(s) of 2; 2 are needed for 4 training nodes" in segments.shortfall(
        _nodes("A", "B", "C", "A"), 4, 2)


def test_segment_must_divide_the_training_nodes(capsys):
    with pytest.raises(cli.UsageError, match=r"--ft-segment 2: the 3 training node\(s\) \(MIN of --nnodes\) must "
                                             r"be a multiple of it"):
        cli.launch_config(["--nnodes", "3:4", "--rdzv-endpoint", "127.0.0.1:1", "--ft-segment", "2", SCRIPT])


def test_segments_put_a_whole_domain_to_work_and_the_odd_node_on_standby(launcher, tmp_path):
    """--nnodes 2:3 --ft-segment 2; node order 0 is alone in NVLink domain A, order 1 and 2 share B.
    Without segments orders 0 and 1 would train; with them B's two nodes train, ranks 0 and 1, and
    A's node waits as a hot spare (the round closes only once B's second node is there)."""
    port = free_port()
    common = ["--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
              f"seg{port}", "--rdzv-conf", "join_timeout=60,last_call_timeout=1", "--ft-segment", "2",
              "--ft-warm-reserves", "0", CYCLE_RANK, "0", "0"]
    env = {"PYTHONPATH": os.pathsep.join([FAKE_NVML, ROOT])}
    procs = {}
    for order, domain in ((1, DOMAIN_B), (0, DOMAIN_A), (2, DOMAIN_B)):
        procs[order] = launcher.start(common, extra_env=dict(env, GROUP_RANK=str(order), FAKE_NVML_CLUSTER_UUID=domain))
        if order == 1:   # the store host first
            _wait_for(lambda: _port_open(port) or procs[1].poll() is not None, 30, "the store host to listen")
    out = {order: proc.communicate(timeout=90) for order, proc in procs.items()}
    for order, proc in procs.items():
        assert proc.returncode == 0, out[order][1]
    assert "hot spare: " in out[0][1] and "rank 0 cycle 0" not in out[0][0] and "rank 1 cycle 0" not in out[0][0]
    assert "rank 0 cycle 0 to stdout" in out[1][0] and "rank 1 cycle 0 to stdout" in out[2][0]


def _port_open(port):
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_segment_on_a_node_without_an_nvlink_domain_is_one_line(launcher, tmp_path):
    res = launcher.run(["--standalone", "--nproc-per-node", "1", "--ft-segment", "1", CYCLE_RANK, "0", "0"],
                       timeout=60, extra_env={"PYTHONPATH": os.pathsep.join(
                           [FAKE_NVML, ROOT])})
    assert res.returncode == 1
    assert ("segment 1: this node's NVLink domain is unknown (GPU 0 reports no NVLink fabric cluster UUID)"
            in res.stderr) and "Traceback" not in res.stderr


# ---- built: NIC link state, distributed storage ----------------------------------------------------
from ft_launcher.agent.recovery import health_checks  # noqa: E402


def test_a_nic_port_that_went_down_makes_the_node_leave_at_the_restart(launcher, tmp_path):
    """The rank writes DOWN into mlx5_0's state file and fails; the check before the next rendezvous
    finds the port ACTIVE at the agent's start and DOWN now: the node leaves (93)."""
    state = tmp_path / "ib" / "mlx5_0" / "ports" / "1" / "state"
    state.parent.mkdir(parents=True)
    state.write_text("4: ACTIVE\n")
    (tmp_path / "ib" / "mlx5_1").mkdir()   # a NIC without that file: not checked
    res = launcher.run(["--standalone", "--nproc-per-node", "1", "--max-restarts", "2", "--ft-enable-nic-healthcheck",
                        "true", "--ft-link-state-path-template", f"{tmp_path}/ib/{{nic}}/ports/1/state",
                        os.path.join(SCRIPTS, "write_then_fail.py"), state, "1: DOWN"], timeout=60)
    assert res.returncode == 93, res.stderr
    assert "health check failed on this node: NIC mlx5_0: port state went from ACTIVE to DOWN" in res.stderr
    assert "ran again" not in res.stdout


def test_nic_states_and_the_skip_line(tmp_path, capsys):
    (tmp_path / "a" / "ports" / "1").mkdir(parents=True)
    (tmp_path / "a" / "ports" / "1" / "state").write_text("ACTIVE")
    (tmp_path / "b" / "ports" / "1").mkdir(parents=True)
    (tmp_path / "b" / "ports" / "1" / "state").write_text("1: DOWN")
    template = f"{tmp_path}/{{nic}}/ports/1/state"
    baseline = health_checks.nic_states(template)
    assert baseline == {"a": "ACTIVE", "b": "DOWN"}
    (tmp_path / "b" / "ports" / "1" / "state").write_text("4: ACTIVE")   # coming up is no failure
    assert health_checks.check_nic_states(baseline, template) is None
    assert health_checks.nic_folder(None) == "/sys/class/infiniband"
    cli.launch_config(["--ft-link-state-path-template", f"{tmp_path}/none/{{nic}}/state", SCRIPT])
    assert f"enable_nic_healthcheck: skipped on this node: {tmp_path}/none does not exist" in capsys.readouterr().err
    with pytest.raises(cli.UsageError, match="must contain {nic}"):
        cli.launch_config(["--ft-link-state-path-template", "/sys/x/state", SCRIPT])


def test_dist_storage_check_reads_lustre_health_and_lists_each_network_mount(tmp_path):
    lustre, mounts = tmp_path / "health_check", tmp_path / "mounts"
    share = tmp_path / "share"
    share.mkdir()
    mounts.write_text(f"proc /proc proc rw 0 0\nsrv:/x {share} nfs4 rw 0 0\n")
    assert health_checks.check_dist_storage(str(lustre), str(mounts)) is None   # no Lustre file: not checked
    lustre.write_text("NOT HEALTHY\n")
    assert health_checks.check_dist_storage(str(lustre), str(mounts)) == (
        f"enable_dist_storage_healthcheck: Lustre reports 'NOT HEALTHY' in {lustre}")
    lustre.write_text("healthy\n")
    mounts.write_text(f"srv:/x {tmp_path / 'gone'} nfs rw 0 0\n")
    assert health_checks.check_dist_storage(str(lustre), str(mounts)).startswith(
        f"enable_dist_storage_healthcheck: mount {tmp_path / 'gone'} cannot be listed (")
    assert health_checks.check_dist_storage() is None or "enable_dist_storage_healthcheck" in health_checks.check_dist_storage()


# ---- the client: NVRx 0.7's RankMonitorClient (fault_tolerance/rank_monitor_client.py) ------------
import inspect  # noqa: E402

# every public method of NVRx 0.7's RankMonitorClient and its parameters (read from the wheel)
NVRX07_CLIENT = {
    "__init__": [], "calculate_and_set_hb_timeouts": ["skip_if_not_ready"],
    "calculate_and_set_section_timeouts": ["selected_sections", "calc_out_of_section", "skip_if_not_ready"],
    "init_workload_monitoring": ["num_warmup_iters"], "shutdown_workload_monitoring": [], "send_heartbeat": [],
    "start_section": ["section"], "end_section": ["section"], "end_all_sections": [], "state_dict": [],
    "load_state_dict": ["state"], "send_workload_control_request": ["req"],
}
NVRX07_CLIENT_ATTRIBUTES = ["is_initialized", "cfg", "hb_timeouts", "section_timeouts", "rank_info",
                            "loaded_hb_timeouts", "loaded_section_timeouts", "logger", "CURRENT_TIMEOUTS_STATE_KEY"]


@pytest.mark.parametrize("method", sorted(NVRX07_CLIENT))
def test_the_client_takes_every_nvrx07_method_and_keyword(method):
    from ft_launcher import RankMonitorClient

    params = inspect.signature(getattr(RankMonitorClient, method)).parameters
    assert all(name in params for name in NVRX07_CLIENT[method]), (method, list(params))


def test_the_client_runs_nvrx07_keyword_calls_outside_the_launcher(monkeypatch):
    """Outside ft_launcher every call is a no-op: the keywords NVRx's users write are taken."""
    for name in list(os.environ):
        if name.startswith("FT_LAUNCHER"):
            monkeypatch.delenv(name)
    from ft_launcher import RankMonitorClient

    client = RankMonitorClient()
    client.init_workload_monitoring(num_warmup_iters=3)
    client.start_section(section="step")
    client.end_section(section="step")
    client.end_all_sections()
    client.send_heartbeat()
    assert client.calculate_and_set_section_timeouts(selected_sections=["step"], calc_out_of_section=False,
                                                     skip_if_not_ready=True) is False
    assert client.calculate_and_set_hb_timeouts(skip_if_not_ready=True) is False
    for attribute in NVRX07_CLIENT_ATTRIBUTES:
        getattr(client, attribute)
    client.load_state_dict(state=client.state_dict())
    client.shutdown_workload_monitoring()


@pytest.mark.slow
def test_a_rank_restarted_in_place_goes_on_in_the_next_cycles_applog(launcher, tmp_path):
    """ft.restartable, rank 1 raises in step: both ranks restart in their own processes, and what
    they print from then on goes to job_cycle1.log (agent.ranks.rank_output's redirect)."""
    from harness import run_faulty, started

    applog = tmp_path / "app" / "job.log"
    job = run_faulty(launcher, tmp_path, "1x2", "raise", "step", 1,
                     ft_args=["--ft-per-cycle-applog-prefix", applog, "--ft-warm-reserves", "0"])
    results, _ = job.wait()
    assert all(code == 0 for code, _, _ in results), results[0][2][-3000:]
    after = started(job.events(), 1)
    assert after[0][1] and after[1][1], after   # both in place
    cycle0 = (tmp_path / "app" / "job_cycle0.log").read_text()
    cycle1 = (tmp_path / "app" / "job_cycle1.log").read_text()
    assert "0: FINAL step=" in cycle1 and "FINAL" not in cycle0, (cycle0[-2000:], cycle1)
    # (whether rank 0 also prints "resumed from step 3" in cycle 1 is a race of the test's own: it
    # saves step 3's checkpoint while rank 1 raises; what it prints goes to cycle 1's log either way)
    assert "1: RuntimeError: simulated exception in step" in cycle0


# ---- built: NVRX_GPUS_PER_NUMA with --ft-numa-bind-strict ------------------------------------------
from ft_launcher.agent.ranks import numa_bind  # noqa: E402


def test_nvrx_gpus_per_numa_binds_each_rank_to_its_nodes_cpus(launcher, tmp_path):
    """The launcher runs on CPU 0 only; NVRX_GPUS_PER_NUMA=1: local rank 0 is put on node 0's CPUs,
    local rank 1's node 1 does not exist here, so it keeps the launcher's CPU and one line says so."""
    node0 = ",".join(map(str, sorted(numa_bind.node_cpus(0))))
    proc = launcher.start(["--standalone", "--nproc-per-node", "2", "--ft-numa-bind-strict", "false",
                           os.path.join(SCRIPTS, "affinity_rank.py")], extra_env={"NVRX_GPUS_PER_NUMA": "1"},
                          preexec_fn=lambda: os.sched_setaffinity(0, {0}))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert f"local rank 0 cpus {node0}" in out and "local rank 1 cpus 0\n" in out
    assert "NVRX_GPUS_PER_NUMA=1: NUMA node 1 does not exist on this machine: its local ranks are not bound" in err
    assert "memory is not bound" not in err


def test_numa_lines(tmp_path):
    (tmp_path / "node0").mkdir()
    (tmp_path / "node0" / "cpulist").write_text("0-3,8,10-11\n")
    assert numa_bind.node_cpus(0, str(tmp_path)) == {0, 1, 2, 3, 8, 10, 11}
    env = {"NVRX_GPUS_PER_NUMA": "4"}
    assert numa_bind.problems(4, False, env, str(tmp_path)) == []
    assert numa_bind.problems(4, True, env, str(tmp_path)) == [
        "numa_bind_strict: memory is not bound to the rank's NUMA node here (its CPUs are); it is allocated where "
        "it is first touched, as with --ft-numa-bind-strict false"]
    assert "NUMA node 1 does not exist" in numa_bind.problems(8, False, env, str(tmp_path))[0]
    assert numa_bind.problems(8, False, {}, str(tmp_path)) == []


# ---- every NVRx 0.7 --ft-* flag: its one line, or the test of its job ------------------------------
JOB_TESTS = {   # flag -> the test (in this file) that shows it doing its job
    "ft-cycle-info-dir": "test_cycle_info_files_the_applog_and_the_launcher_log_follow_each_cycle",
    "ft-per-cycle-applog-prefix": "test_a_rank_restarted_in_place_goes_on_in_the_next_cycles_applog",
    "ft-nvrx-logfile": "test_cycle_info_files_the_applog_and_the_launcher_log_follow_each_cycle",
    "ft-check-remaining-processes": "test_cycle_info_files_the_applog_and_the_launcher_log_follow_each_cycle",
    "ft-checkpoint-iteration-file": "test_progress_is_the_checkpoint_iteration_and_feeds_the_no_progress_stop",
    "ft-min-progress-iterations": "test_progress_is_the_checkpoint_iteration_and_feeds_the_no_progress_stop",
    "ft-max-no-progress-cycles": "test_progress_is_the_checkpoint_iteration_and_feeds_the_no_progress_stop",
    "ft-segment": "test_segments_put_a_whole_domain_to_work_and_the_odd_node_on_standby",
    "ft-enable-nic-healthcheck": "test_a_nic_port_that_went_down_makes_the_node_leave_at_the_restart",
    "ft-link-state-path-template": "test_a_nic_port_that_went_down_makes_the_node_leave_at_the_restart",
    "ft-enable-dist-storage-healthcheck": "test_dist_storage_check_reads_lustre_health_and_lists_each_network_mount",
    "ft-storage-health-check-path": "test_storage_healthcheck_path_is_checked_before_each_rendezvous",
    "ft-numa-bind-strict": "test_nvrx_gpus_per_numa_binds_each_rank_to_its_nodes_cpus",
    "ft-install-exception-hook": "test_exception_hook_reports_a_plain_scripts_uncaught_exception_at_raise_time",
    "ft-gpu-memory-reclaim-timeout": "test_nvrx07_client_calls_work_and_the_hook_follows_the_jobs_config",
}
# ours before 0.7, each tested where its feature is (test_rank_monitor, test_computed_timeouts, test_gpu, ...)
OURS = {"ft-cfg-path", "ft-workload-check-interval", "ft-initial-rank-heartbeat-timeout", "ft-rank-heartbeat-timeout",
        "ft-safety-factor", "ft-rank-termination-signal", "ft-log-level", "ft-rank-out-of-section-timeout",
        "ft-rank-section-timeouts", "ft-no-restart-exit-code", "ft-gpu-memory-tolerance-mb",
        "ft-gpu-memory-poll-interval", "ft-restart-policy", "ft-ignore-missing-cfg", "ft-rdzv-impl"}
# what NVRx asks for is what happens here anyway (the parse test shows them accepted)
SAME = {"ft-node-health-check-interval", "ft-restart-check-interval", "ft-enable-nic-monitor",
        "ft-skip-section-response"}


def test_every_nvrx07_ft_flag_has_its_line_or_a_test_of_its_job():
    for spellings, _ in NVRX07_FLAGS:
        flag = spellings[0].lstrip("-")
        if not flag.startswith("ft-"):
            continue
        key = flag[3:].replace("-", "_")
        line = nvrx_flags.FLAGS.get(flag, (None, None))[1] or nvrx_flags.KEY_NOTES.get(key)
        if flag in JOB_TESTS:
            assert not line, flag
            assert callable(globals().get(JOB_TESTS[flag])), JOB_TESTS[flag]
        else:
            assert line or flag in OURS or flag in SAME, flag
