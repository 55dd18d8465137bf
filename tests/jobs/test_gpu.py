"""GPUs and NCCL (issue 13): the example's CUDA path, and what the launcher does for GPU ranks.

The GPU paths skip on a machine without a usable CUDA GPU, with a one-line reason; everything
here that a CPU machine can check runs everywhere."""
import os
import subprocess
import sys
import time

import pytest
import torch

from ft_launcher.agent.ranks import gpu_memory
from ft_launcher.agent.recovery.health_checks import HealthChecks
from conftest import EXAMPLE, ROOT, SCRIPTS, read_events
from harness import read_json
from ft_launcher.rank_monitor.config import FaultToleranceConfig

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False here)")


@needs_cuda
def test_example_trains_on_nccl_under_nproc_gpu_and_resumes_exactly(launcher, tmp_path):
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    job = [EXAMPLE, "--device", "cuda", "--steps", "40", "--ckpt-every", "10"]
    ok = launcher.run(["--standalone", "--nproc-per-node", "gpu"] + job + ["--ckpt-dir", clean], timeout=300)
    assert ok.returncode == 0, ok.stderr
    res = launcher.run(["--standalone", "--nproc-per-node", "gpu", "--max-restarts", "1"] + job
                       + ["--ckpt-dir", faulty, "--fail-at-step", "25"], timeout=300)
    assert res.returncode == 0, res.stderr
    assert "resumed from step 20 (cycle 1)" in res.stdout
    final, reference = read_json(faulty / "final.json"), read_json(clean / "final.json")
    assert final["world_size"] == torch.cuda.device_count()
    assert final["checksum"] == reference["checksum"]


@needs_cuda
def test_a_rank_stuck_in_a_cuda_kernel_is_detected_dumped_and_recovers(launcher, tmp_path):
    logs = tmp_path / "logs"
    victim = min(1, torch.cuda.device_count() - 1)
    res = launcher.run(["--standalone", "--nproc-per-node", "gpu", "--max-restarts", "1", "--log-dir", logs,
                        "--ft-rank-section-timeouts", "setup:180,step:2,checkpointing:120", EXAMPLE,
                        "--device", "cuda", "--steps", "30", "--ckpt-every", "5", "--cuda-hang-in", "step",
                        "--hold-step", "12", "--fail-rank", str(victim), "--ckpt-dir", tmp_path / "ckpt"],
                       timeout=400)
    assert res.returncode == 0, res.stderr
    assert "stuck in a CUDA kernel in step" in res.stdout
    assert any(e["rank"] == victim and e["detail"]["section"] == "step" for e in read_events(logs, "hang"))
    fr = read_events(logs, "flight_recorder")
    assert len(fr) == 1, fr   # every rank either dumped or was skipped with its reason
    d = fr[0]["detail"]
    assert {str(r) for r in d["dumped"]} | set(d["skipped"]) == {str(r) for r in range(torch.cuda.device_count())}


@pytest.mark.skipif(HAS_CUDA, reason="checks the example's error where no CUDA GPU is usable")
def test_example_device_cuda_without_a_gpu_is_a_one_line_error(launcher, tmp_path):
    res = launcher.run(["--standalone", "--nproc-per-node", "1", EXAMPLE, "--device", "cuda",
                        "--ckpt-dir", tmp_path / "ckpt"], timeout=120)
    assert res.returncode != 0
    assert ("ddp_train.py: error: --device cuda: no CUDA GPU is usable here "
            "(torch.cuda.is_available() is False)") in res.stderr
    assert "Traceback" not in res.stderr


ENV_DUMP = os.path.join(SCRIPTS, "env_dump.py")


def rank_envs(launcher, tmp_path, flags, extra_env=None, nproc=2):
    res = launcher.run(["--standalone", "--nproc-per-node", str(nproc)] + flags + [ENV_DUMP, tmp_path],
                       timeout=120, extra_env=extra_env)
    assert res.returncode == 0, res.stderr
    return res, [read_json(tmp_path / f"rank_{r}.json") for r in range(nproc)]


@pytest.mark.slow
def test_ranks_get_nccl_watchdog_defaults_that_wait_for_our_monitors(launcher, tmp_path):
    logs = tmp_path / "logs"
    _, envs = rank_envs(launcher, tmp_path, ["--log-dir", logs, "--ft-rank-section-timeouts", "setup:600,step:30"])
    for env in envs:
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"           # torchrun's
        assert env["TORCH_NCCL_ENABLE_MONITORING"] == "1"
        assert env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "660"        # largest timeout (setup 600) + 60
        assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
        assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == os.path.join(str(logs), "nccl_trace_rank_")
        assert env["TORCH_FR_BUFFER_SIZE"] == "2000"
    # Short timeouts keep torch's default heartbeat (480 s); no log dir, no dump file setting.
    _, envs = rank_envs(launcher, tmp_path, ["--ft-rank-section-timeouts", "step:30"])
    assert {e["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] for e in envs} == {"480"}
    assert not any("TORCH_NCCL_DEBUG_INFO_TEMP_FILE" in e for e in envs)


@pytest.mark.slow
def test_nccl_variables_the_user_set_pass_unchanged_and_a_short_heartbeat_warns(launcher, tmp_path):
    user = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "30",
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_NCCL_TRACE_BUFFER_SIZE": "100"}
    res, envs = rank_envs(launcher, tmp_path, ["--ft-rank-section-timeouts", "step:60"], extra_env=user)
    for env in envs:
        for key, value in user.items():
            assert env[key] == value
        assert "TORCH_FR_BUFFER_SIZE" not in env    # the user's buffer size (older name) stands
    assert ("ft_launcher: warning: TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=30 is not above the largest configured "
            "timeout (60s): torch's NCCL heartbeat monitor may end a hung rank before its monitor dumps its "
            "stack and trace (unset it for 480)") in res.stderr


@pytest.mark.slow
def test_cuda_visible_devices_reach_every_rank_unchanged_in_order(launcher, tmp_path):
    # As torchrun: never set, never reordered; LOCAL_RANK n is the n-th visible device.
    _, envs = rank_envs(launcher, tmp_path, [], extra_env={"CUDA_VISIBLE_DEVICES": "3,1"})
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3,1", "3,1"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"]


# ---- GPU memory after a kill (agent.ranks.gpu_memory): NVML is not ours, so its query is stubbed;
# the processes are real.
def test_gpu_release_wait_returns_once_the_dead_rank_process_is_gone():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    try:
        def query():   # what NVML would list: the process while it lives, and another one
            return {0: {proc.pid} if proc.poll() is None else set(), 1: {4_000_000}}
        start = time.monotonic()
        held = gpu_memory.wait_released([proc.pid], query, timeout=10)
        elapsed = time.monotonic() - start
    finally:
        proc.kill()
        proc.wait()
    assert held == {}
    assert 0.2 < elapsed < 5


def test_gpu_release_wait_is_bounded_and_names_the_gpu():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = time.monotonic()
        held = gpu_memory.wait_released([proc.pid], lambda: {0: set(), 2: {proc.pid}}, timeout=0.5)
        elapsed = time.monotonic() - start
    finally:
        proc.kill()
        proc.wait()
    assert held == {2: {proc.pid}}
    assert 0.5 <= elapsed < 2.5
    assert gpu_memory.describe(held, 0.5) == f"GPU 2 still holds the memory of dead rank process(es) {proc.pid} after 0.5s"


@pytest.mark.skipif(gpu_memory.nvml_query() is not None, reason="NVML is available here: not the no-NVML path")
def test_gpu_release_wait_without_nvml_is_a_no_op(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        checks = HealthChecks(FaultToleranceConfig(), str(tmp_path), say=lambda line: None)
        checks.dead_pids = [proc.pid]       # alive, but no NVML to list it on a GPU
        start = time.monotonic()
        assert checks.gpu_release() is None
        assert gpu_memory.wait_released([proc.pid], None, timeout=30) == {}
        assert time.monotonic() - start < 1.0
    finally:
        proc.kill()
        proc.wait()


def test_a_gpu_still_holding_a_dead_rank_fails_the_health_check_with_one_line(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    said = []
    try:
        ft = FaultToleranceConfig()
        checks = HealthChecks(ft, str(tmp_path), say=said.append)
        checks.release_wait = 0.3
        checks.nvml_query = lambda: (lambda: {0: {proc.pid}})   # NVML stubbed: GPU 0 lists the process
        checks.dead_pids = [proc.pid]
        expected = f"GPU 0 still holds the memory of dead rank process(es) {proc.pid} after 0.3s"
        assert checks.run() == expected
        ft.health_checks = False          # checks off: the same wait, a warning, and the ranks start
        checks.dead_pids = [proc.pid]
        assert checks.run() is None and said[-1] == f"warning: {expected}"
        assert checks.run() is None       # nothing to wait for once the pids were checked
    finally:
        proc.kill()
        proc.wait()


FAKE_NVML = os.path.join(ROOT, "tests", "fake_nvml")
GPU_RANK = os.path.join(SCRIPTS, "gpu_rank.py")


def fake_nvml_env(tmp_path, mode):
    (tmp_path / "gpu").mkdir()
    root = ROOT
    return {"PYTHONPATH": os.pathsep.join([FAKE_NVML, root, os.environ.get("PYTHONPATH", "")]),
            "FAKE_NVML_DIR": str(tmp_path / "gpu"), "FAKE_NVML_MODE": mode}


def test_restart_waits_for_the_gpu_to_release_the_dead_ranks_then_goes_on(launcher, tmp_path):
    res = launcher.run(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", GPU_RANK],
                       timeout=120, extra_env=fake_nvml_env(tmp_path, "release"))
    assert res.returncode == 0, res.stderr
    assert "rank 1 done in cycle 1" in res.stdout
    assert "still holds" not in res.stderr


@pytest.mark.slow   # the wait itself runs by default (test_restart_waits_for_the_gpu_to_release...)
def test_a_gpu_that_keeps_a_dead_ranks_memory_fails_the_nodes_health_check(launcher, tmp_path):
    res = launcher.run(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", GPU_RANK],
                       timeout=120, extra_env=fake_nvml_env(tmp_path, "stuck"))
    assert res.returncode == 93, res.stderr
    cycle0 = sorted(int(p) for p in os.listdir(tmp_path / "gpu"))
    assert len(cycle0) == 2   # no rank of cycle 1 was started
    assert (f"error: this node leaves the job: health check failed on this node: GPU 0 still holds the "
            f"memory of dead rank process(es) {cycle0[0]}, {cycle0[1]} after 10s") in res.stderr


@pytest.mark.slow
def test_gpu_memory_reclaim_timeout_and_tolerance_are_configurable(launcher, tmp_path):
    """NVRx 0.7's --ft-gpu-memory-reclaim-timeout bounds the wait; with --ft-gpu-memory-tolerance-mb
    above what a dead rank's process still holds (the stand-in lists 1024 MB), it counts as gone."""
    start = time.monotonic()
    res = launcher.run(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                        "--ft-gpu-memory-reclaim-timeout", "1", "--ft-gpu-memory-poll-interval", "0.2", GPU_RANK],
                       timeout=120, extra_env=fake_nvml_env(tmp_path / "a", "stuck") if (tmp_path / "a").mkdir() is None else None)
    assert res.returncode == 93, res.stderr
    assert "still holds the memory of dead rank process(es)" in res.stderr and "after 1s" in res.stderr
    assert time.monotonic() - start < 60
    res = launcher.run(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                        "--ft-gpu-memory-tolerance-mb", "2048", GPU_RANK],
                       timeout=120, extra_env=fake_nvml_env(tmp_path / "b", "stuck") if (tmp_path / "b").mkdir() is None else None)
    assert res.returncode == 0, res.stderr
    assert "rank 1 done in cycle 1" in res.stdout and "still holds" not in res.stderr
