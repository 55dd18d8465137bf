"""GPUs and NCCL (issue 13): the example's CUDA path, and what the launcher does for GPU ranks.

The GPU paths skip on a machine without a usable CUDA GPU, with a one-line reason; everything
here that a CPU machine can check runs everywhere."""
import json
import os

import pytest
import torch

from conftest import EXAMPLE

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
