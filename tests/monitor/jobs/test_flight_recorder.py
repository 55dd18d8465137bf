"""torch's flight recorder on a hang (issue 13), on gloo: torch 2.13 records gloo collectives, so
the whole path runs on CPU. Every rank of the job dumps its trace before any rank is stopped, the
dumps land in the cycle's log dir, and torch's analyzer names the collective and the rank that
never joined it."""
import os
import signal

import psutil
import pytest

from conftest import SCRIPTS, free_port, read_events, wait_for

HANG = os.path.join(SCRIPTS, "collective_hang.py")
TIMEOUTS = ["--ft-rank-section-timeouts", "setup:60,step:2"]


def only(events):
    assert len(events) == 1, events
    return events[0]


def test_hang_dumps_every_rank_and_names_the_collective_never_joined(launcher, tmp_path):
    logs = tmp_path / "logs"
    res = launcher.run(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", logs]
                       + TIMEOUTS + [HANG, "12", "1", "5"], timeout=150)
    assert res.returncode == 0, res.stderr
    fr = only(read_events(logs, "flight_recorder"))
    d = fr["detail"]
    assert fr["cycle"] == 0
    assert d["collective"] == "gloo:all_reduce" and d["missing_ranks"] == [1]
    assert d["dumped"] == [0, 1] and d["skipped"] == {}
    assert d["waiting"]["0"].startswith("gloo:all_reduce")   # rank 0 waits in the one rank 1 never joined
    out = logs / "cycle_0" / "flight_recorder"
    assert (out / "rank_0").stat().st_size > 0 and (out / "rank_1").stat().st_size > 0
    assert "missing ranks: {1}" in (out / "fr_trace.txt").read_text()
    assert (f"flight recorder: gloo:all_reduce (sequence {d['sequence']}, group 0:default_pg) in cycle 0 never "
            f"completed: rank 1 never joined it (dumps of ranks 0, 1 in {out})") in res.stderr
    # Both ranks dumped, so neither had been stopped; the stacks are still taken after the dumps.
    stacks = read_events(logs, "stack_dump")
    assert {e["rank"] for e in stacks} == {0, 1} and all(e["detail"]["stack"] for e in stacks)
    assert "rank 1 done cycle 1" in res.stdout


@pytest.mark.slow
def test_without_a_log_dir_the_line_names_dumps_that_outlive_the_launcher(launcher, tmp_path):
    """No --log-dir: the flight-recorder line names a folder that still holds the dumps and the
    analysis once the launcher has exited (the agent's run dir in the temp dir, kept like the stack
    dumps there); it used to name a scratch folder removed at the exit."""
    import re
    import shutil

    res = launcher.run(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
                       + TIMEOUTS + [HANG, "12", "1", "5"], timeout=150)
    assert res.returncode == 0, res.stderr
    line = next(l for l in res.stderr.splitlines() if "flight recorder: gloo:all_reduce" in l)
    out = re.search(r"\(dumps of ranks 0, 1 in (\S+)\)", line).group(1)
    run_dir = os.path.dirname(os.path.dirname(out))
    try:
        assert os.path.basename(run_dir).startswith("ft_launcher-") and out.endswith("cycle_0/flight_recorder")
        assert os.path.getsize(os.path.join(out, "rank_0")) > 0 and os.path.getsize(os.path.join(out, "rank_1")) > 0
        assert "missing ranks: {1}" in open(os.path.join(out, "fr_trace.txt")).read()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)   # what the operator would read, then remove


@pytest.mark.slow   # test_hang_dumps_every_rank_and_names_the_collective_never_joined gathers through the store
def test_two_agents_gather_every_nodes_dump_through_the_store(launcher, tmp_path):
    logs = tmp_path / "logs"   # one log dir for both agents, as on a shared filesystem
    port = free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "fr2",
              "--max-restarts", "1", "--log-dir", logs] + TIMEOUTS + [HANG, "12", "1", "5"]
    procs = [launcher.start(common, extra_env={"GROUP_RANK": str(i)}) for i in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=150)
        assert proc.returncode == 0, err
    fr = only(read_events(logs, "flight_recorder"))   # the agent that asked gathers, once for the job
    d = fr["detail"]
    assert d["dumped"] == [0, 1] and d["collective"] == "gloo:all_reduce" and d["missing_ranks"] == [1]
    out = logs / "cycle_0" / "flight_recorder"
    assert (out / "rank_0").exists() and (out / "rank_1").exists()


def test_a_dump_in_the_store_naming_a_class_is_skipped_in_one_line_and_nothing_runs(launcher, tmp_path):
    """The store is unauthenticated: a dump that names any class (here one whose __reduce__ would
    create a file) is never unpickled freely, by the gathering agent, the hang blame or torch's
    analyzer; the other rank's trace is analysed and the job recovers."""
    logs, marker = tmp_path / "logs", tmp_path / "ran"
    res = launcher.run(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", logs]
                       + TIMEOUTS + [os.path.join(SCRIPTS, "evil_flight_dump.py"), "12", "1", "5"], timeout=150,
                       extra_env={"EVIL_MARKER": str(marker)})
    assert res.returncode == 0, res.stderr
    assert not marker.exists()
    d = only(read_events(logs, "flight_recorder"))["detail"]
    why = "its dump in the store was not read: it names io.open, which is not admitted"
    assert d["dumped"] == [0] and d["skipped"] == {"1": why}
    assert not (logs / "cycle_0" / "flight_recorder" / "rank_1").exists()   # never handed to torch's analyzer
    assert len([line for line in res.stderr.splitlines() if why in line]) == 1
    assert "rank 1 done cycle 1" in res.stdout


def test_reading_dumps_runs_nothing_they_name(tmp_path):
    import pickle

    from ft_launcher.agent.recovery import flight_recorder as AFR
    from ft_launcher.agent.recovery import hang_blame

    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    evil = pickle.dumps({"entries": [Evil()], "pg_config": {"": {}}})
    good = pickle.dumps({"entries": [{"process_group": ["0", "default_pg"], "collective_seq_id": 3, "state": "started",
                                      "profiling_name": "gloo:all_reduce"}], "pg_config": {}})
    assert AFR.read_trace(evil) == (None, "it names posix.system, which is not admitted")
    assert AFR.read_trace(b"not a pickle")[0] is None and AFR.read_trace(pickle.dumps([1]))[0] is None
    assert AFR.waiting_in({0: good, 1: evil}) == {0: "gloo:all_reduce (sequence 3)"}
    assert AFR._fix_pg_config(evil) == evil
    hang_blame.from_flight_recorder({0: good, 1: evil}, 2)
    assert not marker.exists()


@pytest.mark.slow
def test_recorder_off_keeps_the_python_stack_dump(launcher, tmp_path):
    logs = tmp_path / "logs"
    res = launcher.run(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", logs]
                       + TIMEOUTS + [HANG, "12", "1", "5"], timeout=150, extra_env={"TORCH_FR_BUFFER_SIZE": "0"})
    assert res.returncode == 0, res.stderr
    assert "flight recorder off (TORCH_FR_BUFFER_SIZE=0): a hang is reported with Python stacks only" in res.stderr
    assert read_events(logs, "flight_recorder") == []
    assert not (logs / "cycle_0" / "flight_recorder").exists()
    stacks = read_events(logs, "stack_dump")
    assert {e["rank"] for e in stacks} == {0, 1} and all("collective_hang.py" in e["detail"]["stack"] for e in stacks)


@pytest.mark.slow
def test_a_stopped_rank_is_skipped_in_one_line_and_the_others_dump(launcher, tmp_path):
    logs = tmp_path / "logs"   # the launcher's simulated rank_hung SIGSTOPs rank 1: it cannot dump
    res = launcher.run(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", logs,
                        "--ft-simulate-fault", "true", "--ft-simulated-fault-type", "rank_hung",
                        "--ft-simulated-fault-rank", "1", "--ft-simulated-fault-base-delay", "6"]
                       + TIMEOUTS + [HANG, "400", "9", "0", "0.05"], timeout=150)
    assert res.returncode == 0, res.stderr
    assert ("flight recorder: rank 1 skipped: nothing reads its dump pipe: it is stopped, has exited, or does "
            "not run ft_launcher's client") in res.stderr
    d = only(read_events(logs, "flight_recorder"))["detail"]
    assert d["dumped"] == [0] and list(d["skipped"]) == ["1"]
    assert d["waiting"]["0"].startswith("gloo:all_reduce")


@pytest.mark.slow
def test_a_rank_holding_the_gil_is_skipped_after_its_second(launcher, tmp_path):
    logs = tmp_path / "logs"
    res = launcher.run(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", logs]
                       + TIMEOUTS + [HANG, "12", "1", "5", "0", "gil"], timeout=150)
    assert res.returncode == 0, res.stderr
    assert "flight recorder: rank 1 skipped: no dump within 1s: stopped, or holding the GIL in native code" in res.stderr
    d = only(read_events(logs, "flight_recorder"))["detail"]
    assert d["dumped"] == [0] and list(d["skipped"]) == ["1"]
    assert d["waiting"]["0"].startswith("gloo:all_reduce")
    stacks = {e["rank"]: e["detail"]["stack"] for e in read_events(logs, "stack_dump")}
    assert "collective_hang.py" in stacks[1]   # the stack dump still works there (faulthandler)


def test_the_dump_directory_goes_with_the_agent_even_when_it_is_sigkilled(launcher, tmp_path):
    proc = launcher.start(["--standalone", "--nproc-per-node", "1", os.path.join(SCRIPTS, "sleeper.py"), tmp_path])
    wait_for(lambda: (tmp_path / "pids_0").exists(), 60, "the rank to start")
    rank_pid = int((tmp_path / "pids_0").read_text().split()[0])
    fr_dir = psutil.Process(rank_pid).environ()["FT_LAUNCHER_FR_DIR"]
    assert os.path.isdir(fr_dir)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    wait_for(lambda: not os.path.exists(fr_dir), 10, f"{fr_dir} to be removed by the orphan watchdog")


FR_TWO_CALLS = """
import os, sys, time
import torch, torch.distributed as dist
from ft_launcher.rank_monitor import flight_recorder as FR
from ft_launcher.rank_monitor.rank_side import call_groups
for call in range(2):
    FR.mark_call()
    call_groups.hold()
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % int(sys.argv[1]), rank=0, world_size=1)
    for _ in range(3 + 2 * call):
        dist.all_reduce(torch.ones(2))
    dist.destroy_process_group() if call == 0 else None
    call_groups.release()
FR.dump(sys.argv[2], 0, 1)
"""


def test_a_dump_holds_the_current_calls_collectives_only(tmp_path):
    """A rank restarted in place keeps torch's recorder (torch 2.13 cannot reset it from Python):
    its dump of cycle 1 held cycle 0's collectives, in a group of the same name and members (issue
    39: an unfinished all_reduce of cycle 0 blamed the rank that had raised then). The call's start
    (rank_monitor.flight_recorder.mark_call) leaves them out, and the pg_status of their group."""
    import subprocess
    import sys

    from conftest import ROOT
    from ft_launcher.rank_monitor import flight_recorder as FR

    res = subprocess.run([sys.executable, "-c", FR_TWO_CALLS, str(free_port()), str(tmp_path)], cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=ROOT, TORCH_FR_BUFFER_SIZE="100"),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    trace = FR.load_trace((tmp_path / "slot_0_cycle_1.pkl").read_bytes())
    entries = trace["entries"]
    assert [e["collective_seq_id"] for e in entries] == [1, 2, 3, 4, 5], entries   # not cycle 0's 1, 2, 3
    assert {e["process_group"][0] for e in entries} == {"0"}
    assert set(trace["pg_status"]) == {str(entries[0]["pg_id"])}, trace["pg_status"]
    assert FR.this_call(b"not a pickle", 5) == b"not a pickle"
