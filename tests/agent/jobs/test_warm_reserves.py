"""Warm reserves: a restart activates an interpreter that has already imported torch (and what
the slot's rank imported), instead of starting a cold one. Real agents, reserves and ranks.

The probe script (tests/scripts/reserve_probe.py) records how it was started; a rank that a
reserve became must be indistinguishable from a cold one: argv, __name__, __file__, sys.path[0],
the launcher's variables (also in /proc/<pid>/environ), its output in this cycle's log file, and
what a library it imports after patching torch saw (a reserve imports only torch's and our own
modules ahead: `reserve_preimport`). The slow-library tests ask for `recorded` (every library).
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import EXAMPLE, ROOT, SCRIPTS, free_port, node_tree, read_events, wait_for
from harness import listening, ranks_started

PROBE = os.path.join(SCRIPTS, "reserve_probe.py")
WARM_LIB = os.path.join(ROOT, "tests", "warm_lib")
READY_WITHIN = 90  # a reserve warms at low priority: slow on a loaded 2-core machine


def ready_pids(logs, local_rank, cycle=None):
    return [e["detail"]["pid"] for e in read_events(logs, "reserve_ready")
            if e["detail"]["local_rank"] == local_rank and (cycle is None or e["cycle"] == cycle)]


def identity(out, rank, cycle):
    with open(os.path.join(out, f"identity_{rank}_{cycle}.json")) as fh:
        return json.load(fh)


def reserve_procs(agent_pid):
    return [p for p in psutil.Process(agent_pid).children()
            if " ".join(p.cmdline()).startswith("ft_launcher: warm_reserve")]


@pytest.mark.parametrize("mode", ["script", pytest.param("module", marks=pytest.mark.slow),
                                  pytest.param("run_path", marks=pytest.mark.slow)])
def test_restart_activates_a_warm_reserve_that_runs_the_script_as_a_cold_rank_would(launcher, tmp_path, mode):
    logs, out, go, hold = tmp_path / "logs", tmp_path / "out", tmp_path / "go", tmp_path / "hold"
    out.mkdir()
    target = {"script": [PROBE], "run_path": ["--run-path", PROBE], "module": ["-m", "probe_mod"]}[mode]
    if mode == "module":
        shutil.copy(PROBE, tmp_path / "probe_mod.py")  # found from the cwd, as python -m finds it
    proc = launcher.start(["--standalone", "--nproc-per-node", 2, "--max-restarts", 1, "--log-dir", logs,
                           *target, out, "--fail-rank", 1, "--go", go, "--hold", hold, "--patched-lib",
                           "--extra", "x y"], extra_env={"PYTHONPATH": WARM_LIB + os.pathsep + ROOT})
    for local_rank in (0, 1):
        wait_for(lambda: ready_pids(logs, local_rank) or proc.poll() is not None, READY_WITHIN, "a warm reserve")
    assert proc.poll() is None, proc.communicate()
    # reserves start only once the first ranks are stepping, from what those ranks imported
    first_reserve = min(e["time"] for e in read_events(logs, "reserve_started"))
    assert first_reserve > max(e["time"] for e in read_events(logs, "ranks_started"))
    go.touch()
    wait_for(lambda: len(ranks_started(logs, 1)) == 2 or proc.poll() is not None, 60, "cycle 1")
    cycle1 = ranks_started(logs, 1)
    for rank in (0, 1):
        assert cycle1[rank]["warm"], cycle1
        assert cycle1[rank]["pid"] in ready_pids(logs, rank), "activated a reserve that never said it was ready"
        assert not ranks_started(logs, 0)[rank]["warm"]
    # the reserves used are replaced: new ones warm up while cycle 1 runs
    for local_rank in (0, 1):
        wait_for(lambda: ready_pids(logs, local_rank, cycle=1) or proc.poll() is not None, READY_WITHIN,
                 "a replacement reserve")
    wait_for(lambda: all((out / f"identity_{r}_1.json").exists() for r in (0, 1)), 30, "cycle 1 identities")
    for rank in (0, 1):  # what tools see of a running rank: the rank's environment and command line
        process = psutil.Process(cycle1[rank]["pid"])
        assert process.environ()["RANK"] == str(rank) and process.environ()["TORCHELASTIC_RESTART_COUNT"] == "1"
        assert "probe" in " ".join(process.cmdline())
    hold.touch()
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-3000:]
    assert "ranks started: 0 (warm reserve, pid" in stderr
    ready = read_events(logs, "reserve_ready")
    assert all(e["detail"]["frozen"] > 10000 for e in ready), ready  # torch's objects, out of the GC's way
    for rank in (0, 1):
        cold, warm = identity(out, rank, 0), identity(out, rank, 1)
        assert warm["pid"] == cycle1[rank]["pid"]
        for key in ("argv", "name", "file", "path0", "cwd"):
            assert warm[key] == cold[key], (key, warm[key], cold[key])
        assert warm["name"] == "__main__" and warm["argv"][-2:] == ["--extra", "x y"]
        # a library the script imports after patching torch's device probe (torchtitan's
        # tools.utils on a CPU) is imported by the script, as cold, not ahead by the reserve
        assert warm["patched_lib"] == cold["patched_lib"] == {"device_type": "cpu", "preloaded": False}
        assert warm["torch_preloaded"] and not cold["torch_preloaded"]   # torch itself is imported ahead
        assert warm["env"] == dict(cold["env"], TORCHELASTIC_RESTART_COUNT="1", MASTER_PORT=warm["env"]["MASTER_PORT"])
        # its output went to this cycle's file, with the rank's prefix on the console
        log1 = (logs / "cycle_1" / f"rank_{rank}.log").read_text()
        assert f"probe stdout rank {rank} cycle 1" in log1 and f"probe stderr rank {rank} cycle 1" in log1
        assert "cycle 0" not in log1
        assert f"probe stdout rank {rank} cycle 0" in (logs / "cycle_0" / f"rank_{rank}.log").read_text()
        assert f"[rank {rank}] probe stdout rank {rank} cycle 1" in stdout
    if mode == "module":
        assert cold["argv"][0] == str(tmp_path / "probe_mod.py") and cold["path0"] == str(tmp_path)


@pytest.mark.slow   # 40 s; activation is covered by the test above, an exact resume by tests/jobs/test_launcher.py
def test_example_resumes_exactly_from_warm_reserves(launcher, tmp_path):
    """The example DDP job, a rank killed once every reserve is warm: the restarted ranks are
    reserves and the model ends bit-identical to a fault-free run's."""
    def run(name, kill):
        logs, ckpt = tmp_path / name / "logs", tmp_path / name / "ckpt"
        proc = launcher.start(["--standalone", "--nproc-per-node", 2, "--max-restarts", 1, "--log-dir", logs,
                               EXAMPLE, "--steps", 300, "--ckpt-every", 5, "--step-time", 0.05, "--seed", 3,
                               "--ckpt-dir", ckpt])
        if kill:
            for local_rank in (0, 1):
                wait_for(lambda: ready_pids(logs, local_rank) or proc.poll() is not None, READY_WITHIN,
                         "a warm reserve")
            wait_for(lambda: (ckpt / "ckpt.pt").exists() or proc.poll() is not None, 60, "a checkpoint")
            os.kill(ranks_started(logs, 0)[1]["pid"], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr[-3000:]
        with open(ckpt / "final.json") as fh:
            return json.load(fh), logs
    clean, _ = run("clean", kill=False)
    final, logs = run("faulty", kill=True)
    assert final["cycle"] == 1 and all(r["warm"] for r in ranks_started(logs, 1).values())
    # torch imported ahead; what torch sets itself at import (TORCHINDUCTOR_CACHE_DIR) is no conflict
    ready = read_events(logs, "reserve_ready")
    assert all(e["detail"]["imported"] > 0 and not e["detail"]["environ_conflict"] for e in ready), ready
    assert final["checksum"] == clean["checksum"]


@pytest.mark.slow   # long (10-40 s); the default suite keeps a shorter test of the same path
def test_reserve_killed_or_stalled_while_warming_is_never_used_and_the_restart_goes_cold(launcher, tmp_path):
    """The ranks import a library (tests/warm_lib/slowwarm) that takes 600 s to import in a
    reserve: every reserve is stuck warming. One is SIGKILLed, the next ones stall past
    warm_reserve_timeout; each is reported and replaced, none is used, and the restart does not
    wait for them: it starts cold."""
    logs, out, go = tmp_path / "logs", tmp_path / "out", tmp_path / "go"
    out.mkdir()
    proc = launcher.start(["--standalone", "--nproc-per-node", 2, "--max-restarts", 1, "--log-dir", logs,
                           "--ft-warm-reserve-timeout", 10, "--ft-reserve-preimport", "recorded", PROBE, out,
                           "--fail-rank", 1, "--go", go, "--slow-lib"],
                          extra_env={"PYTHONPATH": WARM_LIB + os.pathsep + ROOT})

    def started_reserves():
        return [e["detail"]["pid"] for e in read_events(logs, "reserve_started") if e["detail"]["local_rank"] == 1]
    victim = wait_for(lambda: started_reserves() or proc.poll() is not None, 60, "a reserve for local rank 1")[0]
    os.kill(victim, signal.SIGKILL)

    def lost():
        return {e["detail"]["pid"]: e["detail"]["why"] for e in read_events(logs, "reserve_lost")}
    wait_for(lambda: victim in lost() or proc.poll() is not None, 30, "the killed reserve reported")
    assert "died while waiting (was killed by SIGKILL)" in lost()[victim]
    stalled = wait_for(lambda: [p for p, why in lost().items() if "not warm after 10s" in why]
                       or proc.poll() is not None, 60, "a stalled reserve reported")
    assert proc.poll() is None, proc.communicate()
    assert not read_events(logs, "reserve_ready")
    go.touch()
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-3000:]
    used = ranks_started(logs, 1)
    assert not any(r["warm"] for r in used.values()), used
    assert not {r["pid"] for r in used.values()} & (set(lost()) | set(stalled) | set(started_reserves()))
    assert f"warm reserve for local rank 1 (pid {victim}) died while waiting" in stderr
    # a slot whose last reserve was lost does not trust the next one still warming: it starts cold
    assert not read_events(logs, "reserve_taken_warming")


@pytest.mark.parametrize("evidence", [
    "spinning",                                      # used more CPU than a cold start took
    pytest.param("asleep", marks=pytest.mark.slow),  # younger than a (long) cold start, but asleep
])
def test_a_reserve_stuck_warming_is_not_taken_by_an_early_restart(launcher, tmp_path, evidence):
    """The early rung (agent.ranks.reserve_pool): a restart before any reserve is ready takes the one
    still warming, unless the evidence says it is stuck: it has used twice the CPU time a cold rank
    of its slot took to its first step ("spinning": the probe's cold start is well under the 2 s
    the test waits, while the reserve spins), or, where the cold start was long (8 s), it has used
    no CPU for a second while asleep ("asleep"). Every reserve here is stuck importing
    tests/warm_lib/slowwarm (600 s, the default 120 s warm_reserve_timeout never fires first): each
    is reported and discarded, and the restart starts cold. Wall time alone is no evidence: see
    test_a_reserve_starved_of_cpu_is_taken_not_called_stuck."""
    logs, out, go = tmp_path / "logs", tmp_path / "out", tmp_path / "go"
    out.mkdir()
    slow = ["--slow-start", 8] if evidence == "asleep" else []
    proc = launcher.start(["--standalone", "--nproc-per-node", 2, "--max-restarts", 1, "--log-dir", logs,
                           "--ft-reserve-preimport", "recorded", PROBE, out, "--fail-rank", 1, "--go", go,
                           "--slow-lib", *slow],
                          extra_env={"PYTHONPATH": WARM_LIB + os.pathsep + ROOT,
                                     "FT_TEST_SPIN_WARM": "1" if evidence == "spinning" else "0"})
    reserves = wait_for(lambda: read_events(logs, "reserve_started") if len(read_events(logs, "reserve_started")) == 2
                        or proc.poll() is not None else None, 60, "a reserve per slot")
    assert proc.poll() is None, proc.communicate()
    # stuck for a while: 2 s since the later one started
    time.sleep(max(0.0, max(e["time"] for e in reserves) + 2.0 - time.time()))
    for e in reserves:   # warming at nice +10, its session's autogroup too (where the kernel has them)
        if os.path.exists(f"/proc/{e['detail']['pid']}/autogroup") and os.getpriority(os.PRIO_PROCESS,
                                                                                       e["detail"]["pid"]) >= 10:
            with open(f"/proc/{e['detail']['pid']}/autogroup") as fh:
                assert fh.read().split()[-1] == "10", e
    go.touch()
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-3000:]
    assert not any(r["warm"] for r in ranks_started(logs, 1).values()), ranks_started(logs, 1)
    assert not read_events(logs, "reserve_taken_warming") and not read_events(logs, "reserve_ready")
    lost = {e["detail"]["pid"]: e["detail"]["why"] for e in read_events(logs, "reserve_lost")}
    for e in reserves:
        why = lost.get(e["detail"]["pid"], "")
        assert "stuck, not taken" in why, (e, lost)
        assert ("of CPU warming" if evidence == "spinning" else "has used no CPU") in why, why
    assert "stuck, not taken" in stderr


@pytest.mark.slow   # by default test_a_reserve_stuck_warming_is_not_taken_by_an_early_restart[spinning] reads the same CPU evidence
def test_a_reserve_starved_of_cpu_is_taken_not_called_stuck(launcher, tmp_path):
    """A reserve warms at nice +10: while the job keeps both cores busy (--spin) it gets little CPU
    and is still warming long after a cold start would have finished. That is not evidence that
    it is stuck (its CPU time is): the early restart takes it, raised to full priority, and it
    becomes the rank (it used to be discarded as stuck, and the rank started cold)."""
    logs, out, go = tmp_path / "logs", tmp_path / "out", tmp_path / "go"
    out.mkdir()
    proc = launcher.start(["--standalone", "--nproc-per-node", 2, "--max-restarts", 1, "--log-dir", logs,
                           "--ft-reserve-preimport", "recorded", PROBE, out, "--fail-rank", 1, "--go", go,
                           "--slow-lib", "--slow-start", 2, "--spin"],
                          extra_env={"PYTHONPATH": WARM_LIB + os.pathsep + ROOT, "FT_TEST_WARM_CPU": "1.5"})
    reserves = wait_for(lambda: read_events(logs, "reserve_started") if len(read_events(logs, "reserve_started")) == 2
                        or proc.poll() is not None else None, 60, "a reserve per slot")
    assert proc.poll() is None, proc.communicate()
    cold = 2.0   # at least: the probe's --slow-start
    time.sleep(max(0.0, max(e["time"] for e in reserves) + cold + 1.5 - time.time()))
    for e in reserves:   # the premise: warming longer than a cold start, with less CPU than one used
        cpu = psutil.Process(e["detail"]["pid"]).cpu_times()
        assert cpu.user + cpu.system < 1.5, (e, cpu)
    assert not read_events(logs, "reserve_ready")
    go.touch()
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-3000:]
    assert not read_events(logs, "reserve_lost"), read_events(logs, "reserve_lost")
    assert len(read_events(logs, "reserve_taken_warming")) == 2, stderr[-3000:]
    used = ranks_started(logs, 1)
    assert all(r["warm"] for r in used.values()) and {r["pid"] for r in used.values()} == {
        e["detail"]["pid"] for e in reserves}, used


def test_warm_reserves_0_starts_every_rank_cold(launcher, tmp_path):
    logs, out, go = tmp_path / "logs", tmp_path / "out", tmp_path / "go"
    out.mkdir()
    proc = launcher.start(["--standalone", "--nproc-per-node", 2, "--max-restarts", 1, "--log-dir", logs,
                           "--ft-warm-reserves", 0, PROBE, out, "--fail-rank", 1, "--go", go])
    wait_for(lambda: (out / "identity_1_0.json").exists() or proc.poll() is not None, 60, "the ranks")
    assert reserve_procs(proc.pid) == []
    go.touch()
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-3000:]
    assert not any(r["warm"] for r in ranks_started(logs, 1).values())
    assert not [e for e in read_events(logs) if e["kind"].startswith("reserve_")]


def test_no_python_has_no_reserves_and_says_so(launcher, tmp_path):
    program = tmp_path / "prog.sh"
    program.write_text("#!/bin/sh\necho \"program rank $RANK\"\n")
    program.chmod(0o755)
    result = launcher.run(["--standalone", "--nproc-per-node", 2, "--no-python", program], timeout=60)
    assert result.returncode == 0, result.stderr
    assert "warm reserves off: --no-python runs a program" in result.stderr
    assert "program rank 1" in result.stdout


@pytest.mark.slow   # a spare taking over runs by default (test_operations)
def test_a_hot_spare_node_keeps_warm_reserves_and_takes_over_with_them(launcher, tmp_path):
    """--nnodes 1:2: the spare parks with warm reserves; when the training node dies, the spare's
    ranks start from them."""
    logs, ckpt = tmp_path / "logs", tmp_path / "ckpt"
    port = free_port()
    args = ["--nnodes", "1:2", "--nproc-per-node", 2, "--max-restarts", 1, "--log-dir", logs,
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"spare{port}",
            "--rdzv-conf", "join_timeout=30,last_call_timeout=20",  # closes once both joined
            EXAMPLE, "--steps", 400, "--ckpt-every", 5, "--step-time", 0.05, "--ckpt-dir", ckpt]
    spare = launcher.start(args, extra_env={"GROUP_RANK": "1"})  # hosts the store; second in order
    wait_for(lambda: listening(port), 30, "the store host to listen")
    trainer = launcher.start(args, extra_env={"GROUP_RANK": "0"})
    wait_for(lambda: read_events(logs, "spare_waiting") or spare.poll() is not None, 60, "the spare parking")
    # at once: a spare has no launch to leave the CPU to
    wait_for(lambda: len(reserve_procs(spare.pid)) == 2 or spare.poll() is not None, 30, "the spare's reserves")
    spare_node = read_events(logs, "spare_waiting")[0]["node"]
    wait_for(lambda: len({e["detail"]["local_rank"] for e in read_events(logs, "reserve_ready")
                          if e["node"] == spare_node}) == 2 or spare.poll() is not None,
             READY_WITHIN, "the spare's reserves")
    wait_for(lambda: (ckpt / "ckpt.pt").exists(), 60, "a checkpoint")
    for p in node_tree(trainer.pid):
        p.kill()  # the training node is lost: agent, monitors, ranks, reserves
    trainer.communicate()
    wait_for(lambda: len(ranks_started(logs, 1)) == 2 or spare.poll() is not None, 60, "the spare training")
    assert all(r["warm"] for r in ranks_started(logs, 1).values()), ranks_started(logs, 1)
    log = logs / "cycle_1" / "rank_0.log"
    wait_for(lambda: "resumed from step" in log.read_text() or spare.poll() is not None, 60, "the resume")
    spare.send_signal(signal.SIGTERM)
    stdout, stderr = spare.communicate(timeout=60)
    assert spare.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "stopped answering -> the hot spare asks for a new round" in stderr
    assert "[rank 0] resumed from step" in stdout


def test_what_a_reserve_imports_ahead_follows_reserve_preimport(tmp_path):
    """rank_monitor.rank_side.import_record, on a record as a rank writes it: `torch` keeps the
    modules of torch and ft_launcher (in the rank's order), `recorded` every library (never
    `__main__` or the script's own modules), `none` nothing; without a record, torch and what DDP
    imports lazily. The rank side of it runs in the process tests above."""
    from ft_launcher.rank_monitor.rank_side.import_record import DEFAULT_MODULES, modules_to_import

    site, user = str(tmp_path / "site-packages"), str(tmp_path / "job")
    record = tmp_path / "imports.json"
    record.write_text(json.dumps({"cuda_device": 0, "modules": [
        ["__main__", f"{user}/train.py"], ["json", "/usr/lib/python3.11/json/__init__.py"],
        ["numpy", f"{site}/numpy/__init__.py"], ["torch", f"{site}/torch/__init__.py"],
        ["ft_launcher", f"{site}/ft_launcher/__init__.py"], ["model", f"{user}/model.py"],
        ["device_probe", f"{WARM_LIB}/device_probe/__init__.py"], ["torch._dynamo", f"{site}/torch/_dynamo/__init__.py"],
        ["torchtitan.tools.utils", f"{site}/torchtitan/tools/utils.py"]]}))
    assert modules_to_import(str(record), user) == (["torch", "ft_launcher", "torch._dynamo"], 0)
    assert modules_to_import(str(record), user, "recorded") == (
        ["json", "numpy", "torch", "ft_launcher", "device_probe", "torch._dynamo", "torchtitan.tools.utils"], 0)
    assert modules_to_import(str(record), user, "none") == ([], None)
    for preimport in ("torch", "recorded"):
        assert modules_to_import(str(tmp_path / "none_yet.json"), user, preimport) == (list(DEFAULT_MODULES), None)
    # a script that chose its devices gets no CUDA context made for it; what torch reads at
    # import is checked once torch is imported (environ_conflicts): not here
    data = json.loads(record.read_text())
    for environ, device in (({"OMP_NUM_THREADS": "2"}, 0), ({"CUDA_VISIBLE_DEVICES": "1"}, None)):
        record.write_text(json.dumps(dict(data, torch_environ=environ)))
        assert modules_to_import(str(record), user) == (["torch", "ft_launcher", "torch._dynamo"], device)
        assert modules_to_import(str(record), user, "recorded")[1] == device


def test_the_rank_records_what_its_script_set_of_what_torch_reads_at_import(tmp_path):
    """The rank side of the record (a real process): the variables torch reads at import that
    the script set, changed or removed since the process started (no other variable), and the
    check a reserve makes once it has imported torch (here: this process's environment)."""
    from ft_launcher.rank_monitor.rank_side.import_record import environ_conflicts

    path = tmp_path / "imports.json"
    code = ("import os; os.environ['OMP_NUM_THREADS'] = '3'; os.environ['TORCH_LOGS'] = '+dynamo'; "
            "del os.environ['MKL_NUM_THREADS']; os.environ['KMP_AFFINITY'] = 'same'; os.environ['FT_TEST_NEW'] = '1'; "
            "from ft_launcher.rank_monitor.rank_side import import_record; import_record.record(%r)" % str(path))
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", KMP_AFFINITY="same")
    env.pop("TORCH_LOGS", None)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    record = json.loads(path.read_text())
    assert record["torch_environ"] == {"MKL_NUM_THREADS": None, "OMP_NUM_THREADS": "3", "TORCH_LOGS": "+dynamo"}
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MKL_NUM_THREADS", raising=False)
        mp.setenv("OMP_NUM_THREADS", "3")
        mp.setenv("TORCH_LOGS", "+dynamo")
        assert environ_conflicts(str(path)) == []
        mp.setenv("OMP_NUM_THREADS", "1")
        assert environ_conflicts(str(path)) == ["OMP_NUM_THREADS"]


@pytest.mark.slow   # 20 s; the decision and the record are covered by the two tests above
def test_a_script_that_sets_what_torch_reads_at_import_gets_reserves_that_import_nothing_ahead(launcher, tmp_path):
    """The probe sets OMP_NUM_THREADS (which OpenMP reads when torch loads it) before anything
    else: the first reserve of each slot, once it has imported torch, finds it has another value
    and is dismissed unused; the next ones import nothing ahead (one line says why), and the warm
    rank imports torch itself, after that, as the cold one did. (torch's own TORCHINDUCTOR_CACHE_DIR,
    which every rank that imports torch._dynamo sets, is no conflict: test_example_resumes_exactly_...)"""
    logs, out, go = tmp_path / "logs", tmp_path / "out", tmp_path / "go"
    out.mkdir()
    proc = launcher.start(["--standalone", "--nproc-per-node", 2, "--max-restarts", 1, "--log-dir", logs,
                           PROBE, out, "--fail-rank", 1, "--go", go, "--set-env", "OMP_NUM_THREADS=2", "--patched-lib"],
                          extra_env={"PYTHONPATH": WARM_LIB + os.pathsep + ROOT})   # the probe imports torch

    def ready_without_preimport(local_rank):
        none = {e["detail"]["pid"] for e in read_events(logs, "reserve_started") if e["detail"]["preimport"] == "none"}
        return none & set(ready_pids(logs, local_rank))
    for local_rank in (0, 1):
        wait_for(lambda: ready_without_preimport(local_rank) or proc.poll() is not None, READY_WITHIN * 2,
                 "a warm reserve that imports nothing ahead")
    go.touch()
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-3000:]
    assert all(r["warm"] for r in ranks_started(logs, 1).values()), ranks_started(logs, 1)
    first = [e["detail"] for e in read_events(logs, "reserve_ready") if e["detail"]["environ_conflict"]]
    assert sorted(d["local_rank"] for d in first) == [0, 1] and all(
        d["environ_conflict"] == ["OMP_NUM_THREADS"] for d in first), first
    assert not {d["pid"] for d in first} & {r["pid"] for r in ranks_started(logs, 1).values()}
    for rank in (0, 1):
        assert not identity(out, rank, 1)["torch_preloaded"]
    lines = [ln for ln in stderr.splitlines() if "warm reserves import nothing ahead of the script" in ln]
    assert len(lines) == 1 and "script sets OMP_NUM_THREADS itself" in lines[0], lines
