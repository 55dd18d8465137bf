"""GPUs and NCCL (issue 13): the example's CUDA path, and what the launcher does for GPU ranks.

The GPU paths skip on a machine without a usable CUDA GPU, with a one-line reason; everything
here that a CPU machine can check runs everywhere."""
import json
import os

import pytest
import torch

from conftest import EXAMPLE, SCRIPTS

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False here)")


def read_json(path):
    with open(path) as fh:
        return json.load(fh)


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


def test_cuda_visible_devices_reach_every_rank_unchanged_in_order(launcher, tmp_path):
    # As torchrun: never set, never reordered; LOCAL_RANK n is the n-th visible device.
    _, envs = rank_envs(launcher, tmp_path, [], extra_env={"CUDA_VISIBLE_DEVICES": "3,1"})
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3,1", "3,1"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"]

