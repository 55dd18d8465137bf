"""A new user's first hour (issue 9): bad paths, planned faults, noise, re-runs, temp files,
exit codes, --help and --version. Real launchers, real ranks."""
import os
import subprocess
import sys

import pytest

from conftest import EXAMPLE, ROOT, SCRIPTS, read_events

ENV_DUMP = os.path.join(SCRIPTS, "env_dump.py")


def _without_numpy(tmp_path):
    """A PYTHONPATH on which `import numpy` fails as it does where numpy is not installed."""
    fake = tmp_path / "no_numpy" / "numpy"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    return {"PYTHONPATH": f"{fake.parent}{os.pathsep}{ROOT}"}


def test_bad_input_is_one_line_even_where_numpy_is_missing(launcher, tmp_path):
    res = launcher.run(["--nproc-per-node", "gpu", ENV_DUMP], timeout=60, extra_env=_without_numpy(tmp_path))
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == ["ft_launcher: error: --nproc-per-node gpu: no GPU found on this node"]


def test_numpy_is_a_dependency_so_torch_in_the_ranks_does_not_warn():
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    requires = [line.split(">")[0].strip() for line in cfg["options"]["install_requires"].split("\n") if line.strip()]
    assert "numpy" in requires
