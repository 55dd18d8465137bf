"""The node's rank monitors as a part (agent/ranks/monitor_set.py), with real monitor processes:
they start, a monitor that dies is replaced and its rank killed (never left unprotected), one that
stops ticking is killed so that the death path replaces it, and stopping ends every monitor."""
import os
import selectors
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import psutil
import pytest

from conftest import read_events, wait_for
from ft_launcher.agent.observation.events import EventLog
from ft_launcher.agent.ranks import monitor_set
from ft_launcher.agent.ranks.monitor_set import MonitorSet
from ft_launcher.agent.ranks.orphan_watchdog import OrphanWatchdog
from ft_launcher.agent.ranks.workers import Rank
from ft_launcher.rank_monitor.config import FaultToleranceConfig


@pytest.fixture
def monitors(launcher, tmp_path, monkeypatch):
    monkeypatch.setenv("FT_TEST_TOKEN", launcher.token)   # the fixture finds anything left behind
    events = EventLog(str(tmp_path / "events.jsonl"), stream=open(os.devnull, "w"))
    events.cycle = 0
    watchdog = OrphanWatchdog()
    cfg = SimpleNamespace(nproc_per_node=2, ft=FaultToleranceConfig())
    part = MonitorSet(cfg, str(tmp_path / "run"), watchdog, events)
    with ThreadPoolExecutor(2) as pool:
        part.start(pool)
        part.ready()
    yield part
    part.stop_all()
    watchdog.close()


def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    return Rank(local_rank=1, rank=1, proc=proc, pidfd=-1, start_ns=time.monotonic_ns(), output=None)


def test_they_start_one_per_local_rank_and_stop_all(monitors):
    pids = [m.pid for m in monitors.handles]
    assert [m.local_rank for m in monitors.handles] == [0, 1] and all(psutil.pid_exists(p) for p in pids)
    monitors.stop_all()
    wait_for(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                             for p in pids), 10, "the monitors to end")


def test_a_dead_monitor_is_replaced_and_its_rank_killed(monitors, tmp_path):
    rank = sleeper()
    old = monitors.handles[1]
    request = monitors.watchdog   # the watchdog kills the rank's group if this test fails midway
    request.watch(rank.pid)
    sel = selectors.DefaultSelector()
    monitors.register(sel)
    os.kill(old.pid, signal.SIGKILL)
    wait_for(lambda: monitors.reports(1, sel, lambda lr: rank) == [] and monitors.handles[1] is not old, 15,
             "the dead monitor to be replaced")
    assert rank.proc.wait(10) == -signal.SIGKILL     # its rank restarts under the new monitor
    request.forget(rank.pid)
    new = monitors.handles[1]
    assert new.pid != old.pid and psutil.pid_exists(new.pid)
    assert [r["kind"] for r in monitors.take_pending(1, 0)] == ["monitor_died"]   # the rank's failure line
    died = read_events(str(tmp_path), "monitor_died")
    assert died and died[0]["detail"]["local_rank"] == 1


def test_a_monitor_that_stops_ticking_is_killed(monitors, tmp_path, monkeypatch):
    monkeypatch.setattr(monitor_set, "STALL_LIMIT", 1.0)
    stalled = monitors.handles[0]
    os.kill(stalled.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: monitors.check_ticks() or read_events(str(tmp_path), "monitor_stalled"), 15,
                 "the stalled monitor to be noticed")
        wait_for(lambda: stalled.proc.poll() is not None, 10, "the stalled monitor to be killed")
    finally:
        os.kill(stalled.pid, signal.SIGCONT) if stalled.proc.poll() is None else None
    assert stalled.proc.returncode == -signal.SIGKILL
