"""A user's own `agent` or `rank_monitor` beside the training script (RL projects have an
`agent/` package) can never stand in for ours: the launcher, its monitors, its orphan watchdog
and its warm reserves import everything as `ft_launcher.agent.*` / `ft_launcher.rank_monitor.*`
and start from a sys.path without the user's directory, and the ranks get the user's modules.

Each user module records every process that imports it (and says so if it is run as a program),
so the tests see exactly who took it: only ranks may.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, SCRIPTS, read_events, wait_for

PROBE = os.path.join(SCRIPTS, "reserve_probe.py")
READY_WITHIN = 90  # a reserve warms at low priority: slow on a loaded 2-core machine

USER_MODULE = """import os, sys
WHO = "user"
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), {log!r}), "a") as fh:
    fh.write(f"{{os.getpid()}} {{__name__}} {{sys.argv[0]}}\\n")
"""


def write_user_modules(where, layout):
    """The user's agent and rank_monitor, as modules (agent.py) or packages (agent/__init__.py)."""
    for name in ("agent", "rank_monitor"):
        path = where / f"{name}.py" if layout == "modules" else where / name / "__init__.py"
        path.parent.mkdir(exist_ok=True)
        path.write_text(USER_MODULE.format(log=os.path.join(os.pardir, "imported_by.txt") if layout == "packages"
                                           else "imported_by.txt"))


def importers(where):
    path = where / "imported_by.txt"
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def rank_pids(logs):
    return {r["pid"] for e in read_events(logs, "ranks_started") for r in e["detail"]["ranks"]}


@pytest.mark.parametrize("layout", [pytest.param("modules", marks=pytest.mark.slow), "packages"])   # packages shadow more
def test_user_agent_and_rank_monitor_beside_the_script_reach_only_the_ranks(launcher, tmp_path, layout):
    """`python -m ft_launcher` run from the directory that holds train.py, agent and rank_monitor:
    monitors, watchdog and reserves come up with our code, a restart activates warm reserves, and
    every rank (cold or warm) imports the user's modules."""
    logs, out, go = tmp_path / "logs", tmp_path / "out", tmp_path / "go"
    out.mkdir()
    shutil.copy(PROBE, tmp_path / "train.py")
    write_user_modules(tmp_path, layout)
    proc = launcher.start(["--standalone", "--nproc-per-node", 2, "--max-restarts", 1, "--log-dir", logs,
                           "train.py", out, "--user-modules", "--fail-rank", 1, "--go", go])
    for local_rank in (0, 1):
        wait_for(lambda: any(e["detail"]["local_rank"] == local_rank for e in read_events(logs, "reserve_ready"))
                 or proc.poll() is not None, READY_WITHIN, "a warm reserve")
    go.touch()
    stdout, stderr = proc.communicate(timeout=90)
    assert proc.returncode == 0, stderr
    warm = [r for e in read_events(logs, "ranks_started") if e["cycle"] == 1 for r in e["detail"]["ranks"]]
    assert len(warm) == 2 and all(r["warm"] for r in warm), warm
    for rank in (0, 1):
        for cycle in (0, 1):
            identity = json.loads((out / f"identity_{rank}_{cycle}.json").read_text())
            assert identity["user_modules"] == ["user", "user"], identity
    took = importers(tmp_path)
    assert {int(pid) for pid, _, _ in took} <= rank_pids(logs), (took, rank_pids(logs))
    assert all(name in ("agent", "rank_monitor") for _, name, _ in took), took  # imported, never run
    assert "Traceback" not in stderr and "exited during start" not in stderr


def test_the_installed_package_holds_agent_and_rank_monitor_under_its_own_name(launcher, tmp_path):
    """A real (non-editable) install: one top-level package, ft_launcher, with agent and
    rank_monitor inside it, and a job runs from it beside a user's agent.py and rank_monitor.py."""
    target, source = tmp_path / "site", tmp_path / "source"
    # from a copy without the checkout's build/ (setuptools reuses what it built there before)
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns("build", "*.egg-info", ".git", ".whl", "__pycache__",
                                                                ".pytest_cache"))
    build = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                            "--no-compile", "--target", str(target), str(source)], capture_output=True, text=True,
                           timeout=180)
    assert build.returncode == 0, build.stderr
    packages = {p.name for p in target.iterdir() if (p / "__init__.py").exists()}
    assert packages == {"ft_launcher"}, packages
    assert (target / "ft_launcher" / "agent" / "agent.py").exists()
    assert (target / "ft_launcher" / "rank_monitor" / "monitor_side" / "server.py").exists()
    # every package of the checkout is in the install (setup.cfg lists them; a missing one broke
    # the installed command while the editable install, which finds the checkout, still worked)
    for top, installed in (("ft_launcher", "ft_launcher"), ("agent", "ft_launcher/agent"),
                           ("rank_monitor", "ft_launcher/rank_monitor")):
        for init in Path(ROOT, top).rglob("__init__.py"):
            where = init.parent.relative_to(Path(ROOT, top))
            assert (target / installed / where / "__init__.py").exists(), f"{top}/{where} is not installed"
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(PROBE, tmp_path / "train.py")
    write_user_modules(tmp_path, "modules")
    res = launcher.run(["--standalone", "--nproc-per-node", 2, "train.py", out, "--user-modules"],
                       extra_env={"PYTHONPATH": str(target)}, timeout=90)
    assert res.returncode == 0, res.stderr
    for rank in (0, 1):
        identity = json.loads((out / f"identity_{rank}_0.json").read_text())
        assert identity["user_modules"] == ["user", "user"], identity
    assert len(importers(tmp_path)) == 4  # two modules in each of the two ranks, nowhere else


def test_a_source_checkout_exposes_only_agent_and_rank_monitor_under_our_name(tmp_path):
    """In a source checkout ft_launcher finds agent/ and rank_monitor/ beside it, and nothing else
    there: tests/, bench/, docs/ and examples/ are not ft_launcher.tests, ... ."""
    code = ("import importlib, ft_launcher.agent.agent, ft_launcher.rank_monitor.shm_layout\n"
            "for name in ('tests', 'bench', 'docs', 'examples', 'conftest', 'setup'):\n"
            "    try:\n"
            "        importlib.import_module('ft_launcher.' + name); print('leak', name)\n"
            "    except ImportError:\n"
            "        pass\n"
            "print(ft_launcher.agent.agent.__file__)\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "leak" not in out.stdout, out.stdout
    assert out.stdout.strip() == os.path.join(ROOT, "agent", "agent.py")
