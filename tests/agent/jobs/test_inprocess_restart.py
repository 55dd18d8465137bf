"""In-process restart end to end: examples/ddp_train.py under `ft.restartable` (--restartable), real
agents, monitors and ranks (tests/harness.py's Job: 1 agent x 2 ranks or 2 agents x 2 ranks).

A fault lands in a phase that every rank holds for IN_PLACE_HOLD s (ddp_train --hold): the test SIGKILLs
the rank (killed) or SIGSTOPs it so that its monitor finds the hang and kills it (hung) once the
agent's status file shows the rank in that phase; or the rank raises once its hold is over (raise).
Then:
- the job ends with exactly the model of a fault-free run (checksum), after one restart, whose
  rung is in_process;
- every healthy rank kept its process: in cycle 1 it is reported `in_place` with its cycle-0 pid;
  a killed or hung rank's slot got a new process; a rank that raised restarts in place too;
- nothing is left behind (the launcher fixture).
Also: node granularity (the failed node's ranks are all replaced, the other node's keep their
processes), a warm reserve node taking over with active_world_size, and 50 in-place restarts in a
row with a healthy rank's RSS, file descriptors and threads flat.
"""
import os
import signal
import subprocess

import pytest

from conftest import LAUNCHER, ROOT, SCRIPTS, node_tree, read_events, wait_for
from harness import RESTARTABLE, Job, check_flat, in_phase, run_faulty, sample_each_cycle, started

PHASES = ("setup", "step", "checkpointing")
FAULTS = ("killed", "hung", "raise")
# By default: a raise here; a kill in place on 2x2 runs by default in tests/live/jobs/test_live_state.py (the
# same in-place path, plus live state) and a hang in place on 1x2 in tests/agent/jobs/test_hang_blame.py
DEFAULT = {("raise", "step", "1x2")}


def check_in_place(job, reference, healthy, replaced):
    results, elapsed = job.wait()
    errors = "\n".join(r[2][-4000:] for r in results)
    assert all(code == 0 for code, _, _ in results), errors
    final = job.final()
    assert final["step"] and final["world_size"] == job.world
    assert final["checksum"] == reference.checksum(job.topology), "in-place restart changed the model"
    evs = job.events()
    restarts = [e for e in evs if e["kind"] == "restart"]
    assert restarts and {e["detail"]["rung"] for e in restarts} == {"in_process"}, restarts
    assert {e["detail"]["next_cycle"] for e in restarts} == {1}, "more than one restart"
    assert not [e for e in evs if e["kind"] == "inprocess_timeout"], "a healthy rank missed its restart point"
    before, after = started(evs, 0), started(evs, 1)
    for rank in healthy:
        assert after[rank] == (before[rank][0], True), f"rank {rank} did not keep its process: {before} -> {after}"
    for rank in replaced:
        assert after[rank][0] != before[rank][0] and not after[rank][1], f"rank {rank} was not replaced: {after}"
    print(f"\n{job.topology}: cycle 0 pids {before}; cycle 1 {after}; {elapsed:.1f}s")
    return evs


def _cases():
    for fault in FAULTS:
        for phase in PHASES:
            for topology in ("1x2", "2x2"):
                marks = () if (fault, phase, topology) in DEFAULT else (pytest.mark.slow,)
                yield pytest.param(fault, phase, topology, marks=marks, id=f"{fault}-{phase}-{topology}")


@pytest.mark.parametrize("fault,phase,topology", list(_cases()))
def test_in_place_restart(launcher, tmp_path, reference, fault, phase, topology):
    rank = 1 if topology == "1x2" else 3
    world = 2 if topology == "1x2" else 4
    job = run_faulty(launcher, tmp_path, topology, fault, phase, rank)
    if fault == "raise":   # the rank that raised restarts in place too
        healthy, replaced = list(range(world)), []
    else:
        healthy, replaced = [r for r in range(world) if r != rank], [rank]
    if fault == "hung" and phase != "step":
        # every rank waits in the same section from about the same moment, so every monitor may
        # fire (test_fault_matrix's docstring): the job still ends exactly, and a rank not killed
        # by its monitor keeps its process
        results, _ = job.wait()
        assert all(code == 0 for code, _, _ in results)
        assert job.final()["checksum"] == reference.checksum(topology)
        evs = job.events()
        before, after = started(evs, 0), started(evs, 1)
        assert all(after[r][0] == before[r][0] for r in after if after[r][1]), (before, after)
        return
    evs = check_in_place(job, reference, healthy, replaced)
    failure = [e for e in evs if e["kind"] == "failure"][0]
    assert failure["rank"] == rank, failure
    if fault == "raise":
        assert "raised RuntimeError: simulated exception in " + phase in failure["detail"]["what"]
    # the operator's report tells the incident as it happened: who noticed, and the restart's rung
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run(LAUNCHER + ["report", str(job.logs), "-o", str(tmp_path / "report.html")], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    incident = [line for line in res.stdout.splitlines() if line.startswith("  cycle 0 ")]
    assert len(incident) == 1 and "restarted in place (healthy ranks kept their processes): cycle 1" in incident[0], \
        res.stdout
    if fault == "raise":
        assert "(an exception); noticed by the rank itself" in incident[0], res.stdout


@pytest.mark.slow   # the policy's granularity rules: tests/agent/unit/test_restart_policy.py
def test_node_granularity_replaces_the_failed_node_and_keeps_the_other(launcher, tmp_path, reference):
    job = run_faulty(launcher, tmp_path, "2x2", "killed", "step", 3, ft_args=["--ft-restart-granularity", "node"])
    evs = check_in_place(job, reference, healthy=[0, 1], replaced=[2, 3])
    restart = [e for e in evs if e["kind"] == "restart"][0]["detail"]
    assert len(restart["replace_nodes"]) == 1


class SpareJob(Job):
    """2x2 that trains (active_world_size 4) plus a third agent waiting as a warm reserve node."""

    def __init__(self, launcher, root, ft_args, job_args):
        super().__init__(launcher, root, "2x2", ft_args, job_args)
        i = self.args.index("--nnodes")
        self.args[i + 1] = 3
        self.nodes = 3


@pytest.mark.slow
def test_active_world_size_a_warm_reserve_node_takes_over_a_lost_node(launcher, tmp_path, reference):
    # every rank holds 40 s in step 3 (cycle 0) until node 1 is killed, which waits for the reserve
    # node's reserves (several seconds warming beside 4 ranks and 4 other reserves on 2 cores): the
    # step timeout must outlast that wait, or the held ranks are caught as hung first
    ft = ["--ft-rank-section-timeouts", "setup:20,step:60,checkpointing:60", "--ft-active-world-size", "4"]
    job = SpareJob(launcher, tmp_path, ft, RESTARTABLE + ["--hold", "step:40"]).launch()
    wait_for(lambda: len([e for e in job.events() if e["kind"] == "reserve_ready"]) >= 2, 90,
             "the reserve node's warm reserves")
    wait_for(lambda: in_phase(job, 3, "step"), 60, "rank 3 in the held step")
    victim = job.agents[1]                 # node 1 (ranks 2, 3): its agent and ranks are killed
    for proc in node_tree(victim.pid):
        proc.kill()
    results, _ = job.wait(bound=180)
    assert [code for i, (code, _, _) in enumerate(results) if i != 1] == [0, 0], results[0][2][-3000:]
    assert job.final()["checksum"] == reference.checksum("2x2")
    evs = job.events()
    before, after = started(evs, 0), started(evs, 1)
    assert after[0] == (before[0][0], True) and after[1] == (before[1][0], True), (before, after)
    spare = [e for e in evs if e["kind"] == "ranks_started" and e["cycle"] == 1 and e["detail"]["ranks"][0]["rank"] == 2]
    assert spare and all(r["warm"] for r in spare[0]["detail"]["ranks"]), spare


@pytest.mark.slow
def test_fifty_in_place_restarts_leave_a_healthy_rank_flat(launcher, tmp_path):
    """Rank 1 dies in step 5 of cycles 0..49; rank 0 restarts in place 50 times. Its RSS, open file
    descriptors and threads are sampled at every cycle start and printed."""
    restarts = 50
    args = ["--standalone", "--nproc-per-node", 2, "--max-restarts", restarts + 5, "--log-dir", tmp_path / "logs",
            "--ft-max-no-progress-cycles", 0, "--ft-warm-reserves", 2,
            os.path.join(ROOT, "examples", "ddp_train.py"), "--restartable",
            "--steps", 8, "--ckpt-every", 1, "--fail-at-step", 5, "--fail-rank", 1, "--fail-cycles", restarts,
            "--ckpt-dir", tmp_path / "ckpt"]
    proc = launcher.start(args)
    logs = str(tmp_path / "logs")
    first = wait_for(lambda: started(read_events(logs), 0), 60, "cycle 0")
    samples = sample_each_cycle(proc, logs, first[0][0], timeout=600)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    evs = read_events(logs)
    last = started(evs, restarts)
    assert last[0] == (first[0][0], True), "rank 0 did not keep its process to the end"
    check_flat(samples, settled=5)


def test_restartable_outside_the_launcher_only_calls_the_function(tmp_path):
    """Under plain python (or torchrun) the wrapper calls the function once and returns its value;
    an exception propagates as it would without the wrapper."""
    import subprocess
    import sys

    script = tmp_path / "plain.py"
    script.write_text(
        "import ft_launcher as ft\n"
        "calls = []\n"
        "@ft.restartable\n"
        "def train(x):\n"
        "    calls.append(x)\n"
        "    if x == 'boom':\n"
        "        raise ValueError('boom')\n"
        "    return x * 2\n"
        "assert train(21) == 42 and calls == [21]\n"
        "assert ft.restartable(train)(1) == 2\n"
        "try:\n"
        "    train('boom')\n"
        "except ValueError:\n"
        "    print('propagated', calls)\n")
    root = ROOT
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FT_", "TORCHELASTIC"))}
    env["PYTHONPATH"] = root
    res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "propagated [21, 1, 'boom']"


def run_stuck(launcher, tmp_path, inprocess_timeout):
    """tests/scripts/stuck_restart.py on 1 agent x 2 ranks: rank 0 ignores the restart signal in
    cycle 0, rank 1 raises. Returns (the launcher process, its log dir, its output dir)."""
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    proc = launcher.start(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", logs,
                           "--ft-inprocess-timeout", inprocess_timeout,
                           os.path.join(SCRIPTS, "stuck_restart.py"), out, 0, 1])
    return proc, logs, out


def test_a_rank_that_misses_its_restart_point_is_killed_and_its_slot_starts_afresh(launcher, tmp_path):
    proc, logs, out = run_stuck(launcher, tmp_path, 1)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    evs = read_events(logs)
    late = [e for e in evs if e["kind"] == "inprocess_timeout"]
    assert [(e["rank"], e["detail"]["exited"]) for e in late] == [(0, False)], late
    assert late[0]["detail"]["waited"] >= 1.0 and "did not reach its restart point within inprocess_timeout=1s" in err
    assert [e["detail"]["rung"] for e in evs if e["kind"] == "restart"] == ["in_process"]
    before, after = started(evs, 0), started(evs, 1)
    assert after[1] == (before[1][0], True), (before, after)      # the rank that raised kept its process
    assert after[0][0] != before[0][0] and not after[0][1]        # the stuck one was replaced
    assert sorted(os.listdir(out)) == sorted(["ignoring", f"done_0_1_{after[0][0]}", f"done_1_1_{before[1][0]}"])
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run(LAUNCHER + ["report", str(logs), "-o", str(tmp_path / "report.html")], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "rank 0 did not reach its restart point in time and started afresh" in res.stdout, \
        res.stdout + res.stderr


def test_a_signal_while_waiting_for_restart_points_stops_the_job_at_once(launcher, tmp_path):
    """SIGTERM to the agent while it waits (inprocess_timeout 60 s) for a rank that will never get
    to its restart point: the job stops now with 128+15, the waiting ranks get the signal too."""
    proc, logs, out = run_stuck(launcher, tmp_path, 60)
    wait_for(lambda: any(e["cycle"] == 1 for e in read_events(logs, "cycle_start")) or proc.poll() is not None,
             60, "cycle 1 to start (the agent then waits for the restart points)")
    assert proc.poll() is None, proc.communicate()[1]
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=30)   # well before inprocess_timeout
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    evs = read_events(logs)
    assert evs[-1]["kind"] == "job_stopped" and not [e for e in evs if e["kind"] == "inprocess_timeout"]
    assert not [f for f in os.listdir(out) if f.startswith("done_")]


def test_a_peers_loss_is_known_by_torchs_types_and_by_gloos_words_only_on_its_runtime_errors():
    """A rank whose collective failed because a peer went away waits for the restart that peer's
    failure brings (rank_monitor.rank_side.inprocess._peer_lost): torch's typed errors by type, gloo's bare
    RuntimeError by its words (what gloo raised here when its peer exited), nothing else."""
    import torch.distributed as dist

    from ft_launcher.rank_monitor.rank_side.inprocess import _peer_lost

    gloo = RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                        "[127.0.0.1]:20911. This is typically caused by a remote worker crashing.")
    for lost in (gloo, dist.DistBackendError("NCCL communicator was aborted"), dist.DistNetworkError("x"),
                 ConnectionResetError(104, "reset"), BrokenPipeError()):
        assert _peer_lost(lost), lost
    for other in (RuntimeError("CUDA error: out of memory"), ValueError("Connection reset by peer in my data"),
                  KeyError("Broken pipe")):
        assert not _peer_lost(other), other
