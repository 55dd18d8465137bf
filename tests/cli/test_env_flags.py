"""torchrun's environment contract (`PET_<FLAG>`), as Kubeflow's PyTorchJob and Trainer use it:
every flag can come from its variable; the command line beats a variable, a variable beats SLURM;
a malformed variable is a one-line error naming it; the agent's first line says where the node
count and the endpoint came from. (A whole job configured by PET_* variables alone, surviving a
killed rank and a lost pod: tests/jobs/test_k8s_examples.py.)"""
import os

import pytest

from conftest import SCRIPTS
from harness import first_agent_line
from ft_launcher.cli import launch_config

ENV_DUMP = os.path.join(SCRIPTS, "env_dump.py")


@pytest.fixture
def clean_env(monkeypatch):
    """No PET_* or SLURM variables from the machine running the tests."""
    for name in list(os.environ):
        if name.startswith(("PET_", "SLURM_")) or name in ("GROUP_RANK", "FT_SIM_FAULT_DESC"):
            monkeypatch.delenv(name)
    return monkeypatch


# ---- in process: which value wins ----------------------------------------------------------------
def test_pet_variables_stand_in_for_every_flag(clean_env, tmp_path):
    env = {"PET_NNODES": "2:3", "PET_NPROC_PER_NODE": "2", "PET_RDZV_ENDPOINT": "trainer-0:29400",
           "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ID": "job7", "PET_MAX_RESTARTS": "3",
           "PET_RDZV_CONF": "join_timeout=5", "PET_TERM_TIMEOUT": "7", "PET_LOG_DIR": str(tmp_path / "logs"),
           "PET_FT_RANK_SECTION_TIMEOUTS": "step:5", "PET_FT_STATE_PATH": str(tmp_path / "state.json"),
           "PET_FT_CALC_FT_TIMEOUTS": "true", "PET_FT_CFG_PATH": str(tmp_path / "ft.yaml")}
    (tmp_path / "ft.yaml").write_text("fault_tolerance:\n  safety_factor: 3\n")
    for name, value in env.items():
        clean_env.setenv(name, value)
    cfg = launch_config([ENV_DUMP])
    assert cfg.ft.safety_factor == 3.0
    assert (cfg.min_nodes, cfg.max_nodes, cfg.nproc_per_node) == (2, 3, 2)
    assert (cfg.rdzv_backend, cfg.rdzv_host, cfg.rdzv_port, cfg.rdzv_id) == ("c10d", "trainer-0", 29400, "job7")
    assert cfg.max_restarts == 3 and cfg.conf("join_timeout") == 5.0 and cfg.term_timeout == 7.0
    assert cfg.log_dir == str(tmp_path / "logs")
    assert cfg.ft.rank_section_timeouts == {"step": 5.0} and cfg.ft.calc_ft_timeouts is True
    assert cfg.ft.ft_state_path == str(tmp_path / "state.json")
    assert cfg.origins == {"nnodes": "PET_NNODES", "endpoint": "PET_RDZV_ENDPOINT"}
    assert "nnodes 2:3 (from PET_NNODES)" in cfg.summary()
    assert "c10d rendezvous at trainer-0:29400 (from PET_RDZV_ENDPOINT)" in cfg.summary()


def test_static_rendezvous_as_kubeflow_trainer_sets_it(clean_env):
    """Trainer v2 (and PyTorchJob without an elastic policy) set node rank and master address."""
    for name, value in {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "1",
                        "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29501"}.items():
        clean_env.setenv(name, value)
    cfg = launch_config([ENV_DUMP])
    assert (cfg.rdzv_backend, cfg.rdzv_host, cfg.rdzv_port) == ("static", "job-node-0-0.job", 29501)
    assert cfg.order_key == 1 and cfg.is_host is False and cfg.min_nodes == 2
    assert cfg.origins == {"nnodes": "PET_NNODES", "endpoint": "PET_MASTER_ADDR, PET_MASTER_PORT"}


SLURM = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_NNODES": "3", "SLURM_NODEID": "0"}


@pytest.mark.parametrize("argv,env,nnodes,origin", [
    (["--nnodes", "3"], {"PET_NNODES": "2"}, 3, "--nnodes"),                # command line > PET_*
    (["--nnodes=3"], {"PET_NNODES": "2", **SLURM}, 3, "--nnodes"),
    ([], {"PET_NNODES": "2", **SLURM}, 2, "PET_NNODES"),                     # PET_* > SLURM
    ([], SLURM, 3, "SLURM_NNODES"),                                          # SLURM > default
    ([], {}, 1, "default"),
    ([], {"PET_NNODES": "", **SLURM}, 3, "SLURM_NNODES"),                   # empty: not set
    ([ENV_DUMP, "--nnodes", "5"], {"PET_NNODES": "2"}, 2, "PET_NNODES"),     # a script's own argument
], ids=["flag-over-pet", "flag-over-pet-and-slurm", "pet-over-slurm", "slurm", "default", "empty-pet", "script-arg"])
def test_precedence_command_line_then_pet_then_slurm_then_default(clean_env, argv, env, nnodes, origin):
    for name, value in env.items():
        clean_env.setenv(name, value)
    cfg = launch_config(argv if argv[:1] == [ENV_DUMP] else argv + [ENV_DUMP])
    assert cfg.min_nodes == cfg.max_nodes == nnodes
    assert cfg.origins["nnodes"] == origin


@pytest.mark.parametrize("value,standalone", [("1", True), ("", True), ("true", True), ("0", False), ("no", False)])
def test_switches_from_pet(clean_env, value, standalone):
    """`PET_STANDALONE=""` is how the training operator says standalone: on."""
    clean_env.setenv("PET_STANDALONE", value)
    assert launch_config([ENV_DUMP]).standalone is standalone


# ---- real processes ------------------------------------------------------------------------------
BAD_PET = [
    ({"PET_NNODES": "two"}, "PET_NNODES (for --nnodes): expected N or MIN:MAX, got 'two'"),
    ({"PET_NNODES": "3:1"}, "PET_NNODES (for --nnodes): need 1 <= MIN <= MAX"),
    ({"PET_MAX_RESTARTS": "many"}, "PET_MAX_RESTARTS: expected an integer for --max-restarts, got 'many'"),
    ({"PET_RDZV_BACKEND": "etcd"}, "PET_RDZV_BACKEND (for --rdzv-backend): etcd is not supported: ft_launcher has no etcd"),
    ({"PET_RDZV_BACKEND": "zk"}, "PET_RDZV_BACKEND (for --rdzv-backend): expected c10d or static, got 'zk'"),
    ({"PET_STANDALONE": "maybe"}, "PET_STANDALONE: expected 1 or 0"),
    ({"PET_FT_SAFETY_FACTOR": "big"}, "PET_FT_SAFETY_FACTOR: safety_factor must be a number, got 'big'"),
]


@pytest.mark.parametrize("env,message", BAD_PET, ids=[next(iter(e)) + "=" + next(iter(e.values())) for e, _ in BAD_PET])
def test_malformed_pet_variable_is_a_one_line_error_naming_it(launcher, env, message):
    res = launcher.run([ENV_DUMP], timeout=60, extra_env=env)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ft_launcher: error:"), res.stderr
    assert message in lines[0]


def test_command_line_beats_pet_in_a_real_job_and_a_typo_is_named(launcher, tmp_path):
    res = launcher.run(["--standalone", "--nproc-per-node", "1", ENV_DUMP, tmp_path], timeout=90,
                       extra_env={"PET_NPROC_PER_NODE": "3", "PET_NNODE": "2", "PET_SHUTDOWN_TIMEOUT": "5"})
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in tmp_path.glob("rank_*.json")) == ["rank_0.json"]
    assert "ft_launcher: warning: PET_NNODE is not a launcher flag; ignored (did you mean PET_NNODES?)" in res.stderr
    assert "PET_SHUTDOWN_TIMEOUT" not in res.stderr  # torchrun's flag, now ours (--term-timeout's twin)
    assert "1 rank per node, a local store on a free port (from --standalone)" in first_agent_line(res.stderr)
