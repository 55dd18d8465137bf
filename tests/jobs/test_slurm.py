"""ft_launcher under a real SLURM cluster (tests/slurm_cluster.py), launched exactly as users do:
`srun -N 2 --ntasks-per-node=1 ft_launcher ...` with no rendezvous flags, and
`sbatch examples/slurm/train.sbatch`.

Every test is bounded (subprocess timeouts, bounded polls) and proves with psutil that nothing
it started outlives it: each srun/sbatch carries FT_TEST_TOKEN=<unique> in its environment,
which SLURM hands to the tasks (the launchers) and they to their ranks and monitors.
"""
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest

from conftest import EXAMPLE, ROOT, SCRIPTS, tagged, wait_for, wait_until_gone

ENV_DUMP = os.path.join(SCRIPTS, "env_dump.py")
PREEMPTIBLE = os.path.join(SCRIPTS, "preemptible.py")
SBATCH_SCRIPT = os.path.join(ROOT, "examples", "slurm", "train.sbatch")
# The interpreter the tests run with, not whatever `ft_launcher` is on PATH (a venv's python that
# was not activated, or NVRx's command of the same name, would run something else).
LAUNCHER = [sys.executable, "-m", "ft_launcher"]
STORE_PORT = 29500  # where the launcher hosts the job's store under SLURM
STEPS = 60          # the DDP example's length in the restart tests (checkpoints every 10)


def same_model(final, reference):
    """A resumed run ends with exactly the clean run's model (the example settles DDP's buckets)."""
    return final["checksum"] == reference["checksum"]


def task_errors(output):
    """srun's per-task failure lines: {task: 'Exited with exit code 1' | 'Killed' | ...}."""
    return {int(m.group(1)): m.group(2).strip()
            for m in re.finditer(r"srun: error: \S+: tasks? (\d+): (.*)", output)}


def progress(progress_dir):
    """{rank: [(cycle, step), ...]} from ddp_train's --progress-dir files."""
    out = {}
    for f in Path(progress_dir).glob("rank_*.txt"):
        rows = [tuple(int(x) for x in line.split()[:2]) for line in f.read_text().splitlines()
                if len(line.split()) == 3]
        out[int(f.stem.split("_")[1])] = rows
    return out


def all_ranks_at(progress_dir, nranks, step):
    p = progress(progress_dir)
    return len(p) == nranks and all(rows and rows[-1][1] >= step for rows in p.values())


class Job:
    """One test's SLURM jobs: srun/sbatch with the cluster's env, tagged with the test's token,
    and the means to find (and kill) what they started."""

    def __init__(self, cluster, tmp_path):
        self.cluster = cluster
        self.tmp = tmp_path
        self.token = uuid.uuid4().hex
        self.name = f"ft-test-{self.token[:8]}"
        self.procs = []
        self.env = dict(FT_TEST_TOKEN=self.token,
                        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                        PYTHONUNBUFFERED="1")  # monitors keep their environ readable (proc_title)

    def start(self, nodes, launcher_args, srun_args=()):
        cmd = ["srun", f"--job-name={self.name}", "-N", str(nodes), "--ntasks-per-node=1",
               "--kill-on-bad-exit=0", "--label", *srun_args, *LAUNCHER, *map(str, launcher_args)]
        proc = self.cluster.popen(cmd, env_extra=self.env, cwd=self.tmp)
        self.procs.append(proc)
        return proc

    def finish(self, proc, timeout):
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            out, _ = proc.communicate(timeout=30)
            pytest.fail(f"did not finish in {timeout} s: {proc.args}\n--- output:\n{out}")
        return proc.returncode, out

    def srun(self, nodes, launcher_args, timeout, srun_args=()):
        return self.finish(self.start(nodes, launcher_args, srun_args), timeout)

    def sbatch(self, args, env):
        return self.cluster.sbatch([f"--job-name={self.name}", f"--chdir={self.tmp}", *args],
                                   env_extra=dict(self.env, **env))

    def job_id(self):
        def find():
            res = self.cluster.run(["squeue", "-h", "-n", self.name, "-o", "%i"], timeout=15, check=False)
            return res.stdout.split()[0] if res.stdout.split() else None
        return wait_for(find, 30, f"job {self.name} in squeue", interval=0.2)

    def node_procs(self, procid):
        """Everything of node `procid` (its srun task): the launcher, its monitors and ranks."""
        out = []
        for p in tagged(self.token):
            try:
                if p.environ().get("SLURM_PROCID") == str(procid):
                    out.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return out

    def ranks_on(self, procid):
        out = []
        for p in self.node_procs(procid):
            try:
                if "RANK" in p.environ():
                    out.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return out

    def kill_node(self, procid):
        """Lose node `procid`: SIGKILL its whole task (launcher, monitors, ranks) at once."""
        victims = self.node_procs(procid)
        assert victims, f"nothing of node {procid} found to kill"
        for p in victims:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(victims, timeout=10)
        # A lost node's /dev/shm and temp dir go with it; on this one host, remove what its agent held
        # (every such path carries the agent's pid; its watchdog died with the task)
        for agent in victims:
            tmp = tempfile.gettempdir()
            for pattern in (f"/dev/shm/ft_launcher_{agent.pid}_*", f"{tmp}/ft_launcher-{agent.pid}",
                            f"{tmp}/ft_launcher_fr_{agent.pid}_*", f"{tmp}/ft_launcher_reserves_{agent.pid}_*",
                            f"{tmp}/ft_launcher-jobs-*/*-{agent.pid}.json"):
                for path in glob.glob(pattern):
                    shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
        for runtime in glob.glob(f"{tempfile.gettempdir()}/ft_launcher-jobs-*"):
            try:
                os.rmdir(runtime)
            except OSError:
                pass
        return victims

    def store_host_procid(self):
        """SLURM_PROCID of the launcher that listens on the job's store port."""
        for conn in psutil.net_connections("tcp"):
            if conn.laddr.port == STORE_PORT and conn.status == psutil.CONN_LISTEN and conn.pid:
                try:
                    return psutil.Process(conn.pid).environ().get("SLURM_PROCID")
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    return None
        return None

    def kill_all(self):
        self.cluster.run(["scancel", "-n", self.name], timeout=15, check=False)
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def cleanup(self):
        """End what is still running; returns what had to be killed after 15 s (a leak)."""
        if any(proc.poll() is None for proc in self.procs):
            self.kill_all()
        for proc in self.procs:
            try:
                proc.communicate(timeout=30)
            except (subprocess.TimeoutExpired, ValueError):
                pass
        self.cluster.run(["scancel", "-n", self.name], timeout=15, check=False)
        described = []
        for p in wait_until_gone(self.token, timeout=15):
            try:
                described.append((p.pid, p.cmdline()))
                p.kill()
            except psutil.NoSuchProcess:
                pass
        return described


@pytest.fixture
def job(slurm_cluster, tmp_path):
    j = Job(slurm_cluster, tmp_path)
    yield j
    left = j.cleanup()
    assert not left, f"processes left behind: {left}"


def ddp_args(ckpt, *extra, launcher=()):
    return [*launcher, EXAMPLE, "--steps", STEPS, "--ckpt-every", 10, "--ckpt-dir", ckpt, *extra]


@pytest.fixture(scope="module")
def reference(slurm_cluster, tmp_path_factory):
    """final.json of a clean `srun -N 2` run of the DDP example: what a recovered run must match."""
    tmp = tmp_path_factory.mktemp("reference")
    j = Job(slurm_cluster, tmp)
    try:
        rc, out = j.srun(2, ddp_args(tmp / "ckpt", launcher=["--nproc-per-node", 2]), timeout=90)
    finally:
        left = j.cleanup()
    assert rc == 0, out
    assert not left, f"processes left behind: {left}"
    return json.loads((tmp / "ckpt" / "final.json").read_text())


# ---------------------------------------------------------------------------------------------


def test_srun_gives_each_task_its_node_identity(slurm_cluster):
    """The cluster itself: SLURM sets what agent.rounds.slurm_env reads, one task per emulated node."""
    from ft_launcher.agent.rounds.slurm_env import slurm_info

    res = slurm_cluster.run(["srun", "-N", "2", "--ntasks-per-node=1", "--label", "env"], timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    tasks = {}
    for line in res.stdout.splitlines():  # "<task>: KEY=value"
        task, sep, assignment = line.partition(": ")
        if sep and "=" in assignment:
            key, _, value = assignment.partition("=")
            tasks.setdefault(int(task), {})[key] = value
    assert set(tasks) == {0, 1}
    for task, env in tasks.items():
        assert env["SLURM_PROCID"] == str(task)
        assert env["SLURM_NNODES"] == "2" and env["SLURM_JOB_NODELIST"] == "n[1-2]"
        assert env["SLURMD_NODENAME"] == f"n{task + 1}"
        info = slurm_info(env)
        assert (info.nnodes, info.node_rank, info.first_host, info.job_id) == (2, task, "n1", env["SLURM_JOB_ID"])


def test_srun_job_has_world_size_4_and_group_rank_follows_procid(job, tmp_path):
    rc, out = job.srun(2, ["--nproc-per-node", 2, ENV_DUMP, tmp_path], timeout=90)
    assert rc == 0, out
    records = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in range(4)]
    for rank, rec in enumerate(records):
        assert rec["WORLD_SIZE"] == "4" and rec["GROUP_WORLD_SIZE"] == "2" and rec["allreduce"] == 4.0
        assert rec["GROUP_RANK"] == rec["SLURM_PROCID"] == str(rank // 2)
        assert rec["LOCAL_RANK"] == str(rank % 2)
        assert rec["SLURMD_NODENAME"] == f"n{rank // 2 + 1}"
        assert rec["TORCHELASTIC_RUN_ID"] == rec["SLURM_JOB_ID"]  # rdzv id from SLURM_JOB_ID
        assert rec["agent_origin"] == os.path.join(ROOT, "agent", "__init__.py")  # this tree runs
    assert not task_errors(out)


@pytest.mark.slow   # 48 s; -m slurm runs it; by default a killed rank restarts in test_live_exact and test_warm_reserves
def test_rank_killed_mid_run_restarts_ranks_on_both_nodes(job, tmp_path, reference):
    prog = tmp_path / "progress"
    rc, out = job.srun(2, ddp_args(tmp_path / "ckpt", "--fail-at-step", 25, "--fail-rank", 3,
                                   "--progress-dir", prog,
                                   launcher=["--nproc-per-node", 2, "--max-restarts", 1]), timeout=120)
    assert rc == 0, out
    assert "rank 3 on node 1" in out and "exited with code 1" in out
    assert "0: [ft_launcher node=0 cycle=1] cycle 1: node 0 of 2" in out
    assert "1: [ft_launcher node=1 cycle=1] cycle 1: node 1 of 2" in out
    assert "resumed from step 20 (cycle 1)" in out
    rows = progress(prog)
    assert sorted(rows) == [0, 1, 2, 3]
    for rank, steps in rows.items():  # every rank of both nodes ran again, from the checkpoint
        cycle1 = [s for c, s in steps if c == 1]
        assert cycle1[0] == 21 and cycle1[-1] == STEPS, (rank, steps)
    final = json.loads((tmp_path / "ckpt" / "final.json").read_text())
    assert final["cycle"] == 1 and final["world_size"] == 4
    assert same_model(final, reference)


def _start_long_job(job, tmp_path, nodes, launcher_args, step_time):
    prog = tmp_path / "progress"
    proc = job.start(nodes, ddp_args(tmp_path / "ckpt", "--step-time", step_time, "--progress-dir", prog,
                                     launcher=["--nproc-per-node", 2, *launcher_args]))
    wait_for(lambda: all_ranks_at(prog, 4, 15) or proc.poll() is not None, 90, "all 4 ranks at step 15")
    assert proc.poll() is None, proc.communicate()[0]
    return proc, prog


@pytest.mark.slow
def test_lost_node_without_spare_ends_the_job_in_bounded_time(job, tmp_path):
    proc, _ = _start_long_job(job, tmp_path, 2, ["--max-restarts", 1, "--rdzv-conf", "join_timeout=10"],
                              step_time=0.5)
    assert job.store_host_procid() == "0"  # the store lives on the first node, as on a real cluster
    job.kill_node(1)
    killed_at = time.monotonic()
    rc, out = job.finish(proc, timeout=60)
    elapsed = time.monotonic() - killed_at
    assert rc != 0
    errors = task_errors(out)
    assert errors.get(1) == "Killed" and errors.get(0) == "Exited with exit code 1", out
    assert "rendezvous round 1 timed out after 10s: 1 of 2 needed nodes joined" in out
    assert elapsed < 30, f"node 0 took {elapsed:.1f} s to give up"


@pytest.mark.slow   # spare takeover runs by default in test_warm_reserves and test_store_failover
def test_hot_spare_takes_over_a_lost_node(job, tmp_path, reference):
    proc, prog = _start_long_job(job, tmp_path, 3, ["--nnodes", "2:3", "--max-restarts", 1], step_time=0.1)
    assert job.store_host_procid() == "0"
    assert job.node_procs(2), "the spare's launcher is not running"
    assert not job.ranks_on(2), "the hot spare runs ranks before it is needed"
    assert len(job.ranks_on(0)) == len(job.ranks_on(1)) == 2
    job.kill_node(1)
    rc, out = job.finish(proc, timeout=90)
    assert task_errors(out) == {1: "Killed"}, out  # nodes 0 and 2 exit 0; srun reports the lost one
    assert "2: [ft_launcher node=1 cycle=1] cycle 1: node 1 of 2, ranks 2-3 of 4" in out
    assert "resumed from step 10 (cycle 1)" in out or "resumed from step 20 (cycle 1)" in out
    final = json.loads((tmp_path / "ckpt" / "final.json").read_text())
    assert final["cycle"] == 1 and final["world_size"] == 4
    assert same_model(final, reference)
    assert {c for rows in progress(prog).values() for c, _ in rows} == {0, 1}


def _preempted(job, tmp_path, proc, rc, out):
    """Every rank got SIGTERM, finished its 1 s of saving, and every launcher exited 143."""
    assert rc == 143, out
    for rank in range(4):
        assert (tmp_path / f"sigterm_{rank}").exists() and (tmp_path / f"saved_{rank}").exists(), out
    assert task_errors(out) == {0: "Exited with exit code 143", 1: "Exited with exit code 143"}, out
    assert "received SIGTERM: forwarding to the ranks" in out


def _start_preemptible(job, tmp_path, srun_args=()):
    proc = job.start(2, ["--nproc-per-node", 2, "--term-timeout", 10, PREEMPTIBLE, tmp_path, 1.0], srun_args)
    wait_for(lambda: all((tmp_path / f"ready_{r}").exists() for r in range(4)) or proc.poll() is not None,
             60, "4 ranks ready")
    assert proc.poll() is None, proc.communicate()[0]
    return proc


def test_scancel_signal_term_preempts_with_grace_and_exit_143(job, tmp_path):
    proc = _start_preemptible(job, tmp_path)
    res = job.cluster.run(["scancel", "--signal=TERM", job.job_id()], timeout=15, check=False)
    assert res.returncode == 0, res.stderr
    rc, out = job.finish(proc, timeout=30)
    _preempted(job, tmp_path, proc, rc, out)


@pytest.mark.slow   # slurmctld's 30 s limit checks make it 10-40 s; scancel --signal=TERM runs the same path by default
def test_time_limit_warning_signal_preempts_with_grace_and_exit_143(job, tmp_path):
    # --signal=TERM@80 on a 2-minute limit: slurmctld checks limits every 30 s and sends the
    # warning at the first check within 80 + 30 s of the end, i.e. 10-40 s in; ranks are ready
    # after ~5 s.
    proc = _start_preemptible(job, tmp_path, ["--time=2", "--signal=TERM@80"])
    rc, out = job.finish(proc, timeout=90)
    _preempted(job, tmp_path, proc, rc, out)


def test_sbatch_example_runs_to_completion(job, tmp_path):
    job_id = job.sbatch([SBATCH_SCRIPT], env={"STEPS": "30", "FT_EXAMPLE": EXAMPLE,
                                              "FT_LAUNCHER": " ".join(LAUNCHER)})
    info = job.cluster.wait_job_done(job_id, timeout=120)
    log = (tmp_path / f"ft-ddp-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    assert "FINAL step=30" in log
    final = json.loads((tmp_path / f"ckpt-{job_id}" / "final.json").read_text())
    assert final["world_size"] == 4 and final["cycle"] == 0, log


@pytest.mark.slow
def test_lost_store_host_node_the_next_node_of_the_step_takes_over(job, tmp_path, reference):
    """The first node of the step hosts the store; SIGKILL its whole task: node 1 (the next node
    of the step) hosts generation 1 of the store on port 29501, the spare takes node 0's place,
    and the job ends with the clean run's model."""
    proc, prog = _start_long_job(job, tmp_path, 3, ["--nnodes", "2:3", "--max-restarts", 1], step_time=0.1)
    assert job.store_host_procid() == "0"
    assert job.node_procs(2) and not job.ranks_on(2), "the third node should wait as a spare"
    job.kill_node(0)
    rc, out = job.finish(proc, timeout=90)
    assert task_errors(out) == {0: "Killed"}, out
    assert re.search(r"^1: .*store failover: generation 1 of the store at \S+:29501 \(hosted here\)", out, re.M), out
    assert re.search(r"^2: .*store failover: generation 1 of the store at \S+:29501 replaces", out, re.M), out
    assert "resumed from step" in out
    final = json.loads((tmp_path / "ckpt" / "final.json").read_text())
    assert final["cycle"] == 1 and final["world_size"] == 4
    assert same_model(final, reference)
