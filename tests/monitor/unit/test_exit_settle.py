"""rank_monitor/rank_side/exit_settle.py: at a rank's end, the process's other threads finish what
still needs Python before the interpreter finalizes.

- a daemon thread inside a torch op (the GIL released) when the script ends, with an interpreter end
  that takes a second: without the settle, the op returns while the interpreter finalizes and the
  process aborts (SIGABRT, "terminate called without an active exception": the kept rank of
  test_buddy_copy's two-node case died so, there from a gloo worker freeing the last all-gather's
  output); with it, the process exits 0 after the thread ended;
- busy_threads sees a thread that runs and not one that waits;
- the settle returns at once when nothing else runs, and after at most its bound when a thread
  never stops.
"""
import os
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT, SCRIPTS

SCRIPT = os.path.join(SCRIPTS, "busy_at_exit.py")


def _run(*args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="CPython 3.14 parks such a thread instead of ending it")
def test_a_thread_inside_torch_at_the_interpreters_end_aborts_the_process():
    done = _run()
    assert "main done" in done.stdout
    assert done.returncode == -6 and "terminate called without an active exception" in done.stderr, \
        (done.returncode, done.stderr[-2000:])


def test_with_the_exit_settle_the_process_waits_for_the_thread_and_exits_0():
    done = _run("settle")
    assert "main done" in done.stdout
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])


def test_busy_threads_sees_a_running_thread_and_not_a_waiting_one():
    from ft_launcher.rank_monitor.rank_side import exit_settle

    stop, ids = threading.Event(), {}

    def spin():
        ids["spin"] = threading.get_native_id()
        while not stop.is_set():
            sum(range(1000))

    def wait():
        ids["wait"] = threading.get_native_id()
        stop.wait()

    threads = [threading.Thread(target=spin), threading.Thread(target=wait)]
    for t in threads:
        t.start()
    try:
        while len(ids) < 2:
            time.sleep(0.001)
        seen = set()
        for _ in range(50):   # the spinning thread holds the GIL in turns with this one: runnable when looked at
            time.sleep(0.002)
            seen.update(exit_settle.busy_threads())
        assert ids["spin"] in seen and ids["wait"] not in seen
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_the_settle_is_quick_when_nothing_runs_and_bounded_when_something_never_stops():
    from ft_launcher.rank_monitor.rank_side import exit_settle

    assert exit_settle.settle() < 0.2
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        took = exit_settle.settle(bound=0.3)
        assert 0.3 <= took < 0.6
    finally:
        stop.set()
        spinner.join()


# ---- a call's process groups outlive its frame (rank_side.call_groups) ----------------------------
GATHER = os.path.join(SCRIPTS, "gather_at_return.py")


def _gather(calls, *args):
    from conftest import free_port

    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, GATHER, str(free_port(following=calls + 1)), str(calls), *args],
                          capture_output=True, text=True, timeout=60 + 12 * calls, env=env)


@pytest.mark.slow
def test_a_call_that_ends_with_a_gather_and_a_destroyed_group_ends_under_the_hold():
    """Issue 39: ranks restarted in place hung at the job's end, the main thread freeing DDP's
    Reducer (the group's last reference) as the training function returned while a gloo worker
    freeing the closing all_gather_object's work waited for the GIL. With the wrapper's hold every
    call ends (12 calls here; without it the same loop deadlocked within its first 10 calls, 3 of 3 runs:
    the slow test below)."""
    done = _gather(12, "hold")
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert "rank 0: 12 calls ended" in done.stdout and "rank 1: 12 calls ended" in done.stdout


@pytest.mark.slow
def test_without_the_hold_such_a_call_deadlocks():
    """The negative of the test above (it shows the hold is what ends the calls): the worker waits
    for the GIL inside the group's destructor (a thread with no Python frame), the main thread at
    the function's return."""
    done = _gather(20)
    assert done.returncode != 0 and "Timeout" in done.stderr, (done.returncode, done.stdout, done.stderr[-2000:])
