"""What the agent, a rank monitor and a rank import of ours at start: a launch pays for every
module on the way to the ranks' first step (the agent imports ours before torch, and torch before
it starts a rank), so what a plain job never uses is imported where it is used, not at start.
Each test reads one real process's module set (`-X importtime`, or sys.modules) and names the
modules that must not be in it; `python -X importtime -m ft_launcher ...` finds a new cost.
"""
import os
import subprocess
import sys

from conftest import ROOT

# Never imported by an agent whose job uses none of them: computed timeouts (ft_state.json and its
# file lock), straggler statistics, live state and the in-process restart (the ranks' parts), buddy
# copies, NVRx's socket peers (the monitor's), the report, `status`, Prometheus.
AGENT_NEVER = ("filelock", "statistics", "ft_launcher.rank_monitor.ft_state_file",
               "ft_launcher.rank_monitor.rank_side.live", "ft_launcher.rank_monitor.rank_side.restart_watcher",
               "ft_launcher.rank_monitor.rank_side.exit_settle", "ft_launcher.rank_monitor.rank_side.nvrx_api",
               "ft_launcher.rank_monitor.monitor_side", "ft_launcher.report", "ft_launcher.status",
               "prometheus_client")
MONITOR_NEVER = ("torch", "filelock", "statistics", "ft_launcher.agent", "ft_launcher.rank_monitor.rank_side.live",
                 "ft_launcher.rank_monitor.rank_side.inprocess")
RANK_NEVER = ("filelock", "statistics", "ft_launcher.agent", "ft_launcher.rank_monitor.monitor_side",
              "ft_launcher.rank_monitor.rank_side.live", "ft_launcher.rank_monitor.rank_side.inprocess")


def _imported(stderr: str) -> set:
    """The modules an `-X importtime` run's stderr says it imported."""
    return {line.split("|")[2].strip() for line in stderr.splitlines()
            if line.startswith("import time:") and "self [us]" not in line}


def _offending(modules: set, never) -> list:
    return sorted(m for m in modules if any(m == n or m.startswith(n + ".") for n in never))


def test_a_plain_job_leaves_unused_parts_unimported(launcher, tmp_path):
    """A one-rank job with a log directory (its status file, events) that exits 0: the agent's
    whole life imports none of AGENT_NEVER. (~4 s: the agent imports torch to host the store.)"""
    (tmp_path / "train.py").write_text("print('trained')\n")
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "ft_launcher", "--standalone",
                             "--nproc-per-node", "1", "--log-dir", "logs", "train.py"],
                            env=launcher.env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    launcher.procs.append(proc)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    assert "trained" in out + err
    modules = _imported(err)
    assert "ft_launcher.agent.agent" in modules and "torch" in modules, sorted(modules)[:20]
    assert _offending(modules, AGENT_NEVER) == []


def test_a_monitor_and_a_rank_import_only_their_own_parts(tmp_path):
    """The rank monitor's module (what its process imports before it serves), and a rank's
    `import ft_launcher` with its first section and heartbeat."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    show = "\nimport sys\nprint(' '.join(sys.modules))"
    for code, never, sure in (("import ft_launcher.rank_monitor.monitor_side.server", MONITOR_NEVER,
                               "ft_launcher.rank_monitor.monitor_side.nvrx_peers"),
                              ("import ft_launcher as ft\nwith ft.section('setup'): ft.heartbeat()", RANK_NEVER,
                               "ft_launcher.rank_monitor.rank_side.sections")):
        res = subprocess.run([sys.executable, "-W", "ignore", "-c", code + show], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr[-2000:]
        modules = set(res.stdout.split())
        assert sure in modules, code
        assert _offending(modules, never) == [], code
