"""Tests for agent/rounds.slurm_env.py: host list expansion and reading the SLURM environment."""

import subprocess

import pytest

from ft_launcher.agent.rounds import slurm_env
from ft_launcher.agent.rounds.slurm_env import SlurmInfo, expand_hostlist, slurm_info


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("n1", ["n1"]),
        ("n[1-3]", ["n1", "n2", "n3"]),
        ("gpu-[001-004,010],login1",
         ["gpu-001", "gpu-002", "gpu-003", "gpu-004", "gpu-010", "login1"]),
        ("n[01-10]", [f"n{i:02d}" for i in range(1, 11)]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("n[1-2,5,7-8]", ["n1", "n2", "n5", "n7", "n8"]),
        ("rack[1-2]-node[01-02]",
         ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
        ("dgx-a100-[01-02],dgx-h100-[7,9]",
         ["dgx-a100-01", "dgx-a100-02", "dgx-h100-7", "dgx-h100-9"]),
        ("my-cluster-node-[3-4]-ib", ["my-cluster-node-3-ib", "my-cluster-node-4-ib"]),
        ("alpha,beta,gamma", ["alpha", "beta", "gamma"]),
        ("zeta,alpha", ["zeta", "alpha"]),  # SLURM's order is kept, not sorted
        ("node.example.com", ["node.example.com"]),
        ("  n[1-2]\n", ["n1", "n2"]),
    ],
)
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(
    "text", ["", "   ", "n[1-", "n[1-2]]", "n[3-1]", "n[a-b]", "n[]", "n[1,,2]", "foo bar"]
)
def test_expand_hostlist_garbage(text):
    with pytest.raises(ValueError) as e:
        expand_hostlist(text)
    assert "\n" not in str(e.value)


def test_expand_hostlist_scontrol_fallback(monkeypatch):
    """Without python-hostlist, expansion goes through `scontrol show hostnames`."""
    import builtins

    real_import = builtins.__import__

    def no_hostlist(name, *a, **k):
        if name == "hostlist":
            raise ImportError("no hostlist")
        return real_import(name, *a, **k)

    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        if cmd[-1] == "n[1-2]":
            return subprocess.CompletedProcess(cmd, 0, "n1\nn2\n", "")
        return subprocess.CompletedProcess(cmd, 1, "", "scontrol: error: Invalid hostlist\n")

    monkeypatch.setattr(builtins, "__import__", no_hostlist)
    monkeypatch.setattr(slurm_env.shutil, "which", lambda name: "/usr/bin/scontrol")
    monkeypatch.setattr(slurm_env.subprocess, "run", fake_run)
    assert expand_hostlist("n[1-2]") == ["n1", "n2"]
    assert calls[0][1:] == ["show", "hostnames", "n[1-2]"]
    with pytest.raises(ValueError, match="Invalid hostlist"):
        expand_hostlist("n[1-")
    monkeypatch.setattr(slurm_env.shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match="neither python-hostlist nor scontrol"):
        expand_hostlist("n1")


def test_not_under_slurm():
    assert slurm_info({}) is None
    assert slurm_info({"PATH": "/usr/bin", "HOSTNAME": "x"}) is None
    assert slurm_info({"SLURM_JOB_ID": "12"}) is None  # no node list
    assert slurm_info({"SLURM_JOB_NODELIST": "n[1-2]"}) is None  # no job id


# What `srun -N 2 --ntasks-per-node=1 env` prints on the emulated cluster (task 1 of 2).
SRUN_TASK1 = {
    "SLURM_JOB_ID": "7",
    "SLURM_JOBID": "7",
    "SLURM_JOB_NODELIST": "n[1-2]",
    "SLURM_NODELIST": "n[1-2]",
    "SLURM_STEP_NODELIST": "n[1-2]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NNODES": "2",
    "SLURM_NTASKS": "2",
    "SLURM_NPROCS": "2",
    "SLURM_PROCID": "1",
    "SLURM_NODEID": "1",
    "SLURM_LOCALID": "0",
    "SLURMD_NODENAME": "n2",
}


def test_srun_one_task_per_node():
    assert slurm_info(SRUN_TASK1) == SlurmInfo(
        nnodes=2, node_rank=1, job_id="7", first_host="n1", nodename="n2"
    )


def test_procid_preferred_when_one_task_per_node():
    env = dict(SRUN_TASK1, SLURM_PROCID="0", SLURM_NODEID="1")
    assert slurm_info(env).node_rank == 0


def test_nodeid_when_several_tasks_per_node():
    env = dict(SRUN_TASK1, SLURM_NTASKS="4", SLURM_PROCID="3", SLURM_NODEID="1")
    assert slurm_info(env).node_rank == 1


def test_batch_script_environment():
    """Inside the sbatch script (no srun): the batch step runs on the first node."""
    env = {
        "SLURM_JOB_ID": "99",
        "SLURM_JOB_NODELIST": "gpu-[001-004]",
        "SLURM_NODELIST": "gpu-[001-004]",
        "SLURM_JOB_NUM_NODES": "4",
        "SLURM_NNODES": "4",
        "SLURM_NODEID": "0",
        "SLURM_PROCID": "0",
        "SLURMD_NODENAME": "gpu-001",
    }
    assert slurm_info(env) == SlurmInfo(4, 0, "99", "gpu-001", "gpu-001")


def test_step_nodelist_wins_over_job_nodelist():
    """srun -N 2 inside a 3-node allocation: the rendezvous host is the step's first node."""
    env = dict(
        SRUN_TASK1,
        SLURM_JOB_NODELIST="n[1-3]",
        SLURM_JOB_NUM_NODES="3",
        SLURM_STEP_NODELIST="n[2-3]",
        SLURM_NODELIST="n[2-3]",
        SLURMD_NODENAME="n3",
    )
    info = slurm_info(env)
    assert (info.nnodes, info.node_rank, info.first_host) == (2, 1, "n2")


def test_job_num_nodes_and_nodelist_fallbacks():
    env = {"SLURM_JOB_ID": "5", "SLURM_NODELIST": "a,b,c", "SLURM_JOB_NUM_NODES": "3",
           "SLURMD_NODENAME": "c"}
    # No NODEID/PROCID (e.g. under salloc): rank from the position in the node list.
    assert slurm_info(env) == SlurmInfo(3, 2, "5", "a", "c")


def test_nodename_falls_back_to_hostname(monkeypatch):
    monkeypatch.setattr(slurm_env.socket, "gethostname", lambda: "myhost")
    env = {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "myhost", "SLURM_NNODES": "1"}
    assert slurm_info(env) == SlurmInfo(1, 0, "5", "myhost", "myhost")


@pytest.mark.parametrize(
    "override, match",
    [
        ({"SLURM_NNODES": "two"}, "SLURM_NNODES"),
        ({"SLURM_PROCID": "5", "SLURM_NODEID": "5"}, "outside"),
        ({"SLURM_JOB_NODELIST": "n[1-", "SLURM_STEP_NODELIST": "n[1-",
          "SLURM_NODELIST": "n[1-"}, "bad host list"),
    ],
)
def test_malformed_slurm_environment(override, match):
    with pytest.raises(ValueError, match=match):
        slurm_info(dict(SRUN_TASK1, **override))
