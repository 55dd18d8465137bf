"""ft_launcher.rendezvous_endpoint: where and with whom a node meets, from the flags, SLURM and
GROUP_RANK (torchrun's rules), checked on the parser's own namespaces."""
import os

import pytest

from ft_launcher.flag_values import parse_backend
from ft_launcher.flags import UsageError, build_parser
from ft_launcher.rendezvous_endpoint import DEFAULT_C10D_PORT, resolve_rendezvous, slurm_or_none

SLURM = {"SLURM_JOB_ID": "77", "SLURM_NNODES": "2", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "2",
         "SLURM_PROCID": "1"}


@pytest.fixture
def env(monkeypatch):
    """No PET_*, SLURM or GROUP_RANK variables from the machine running the tests."""
    for name in list(os.environ):
        if name.startswith(("PET_", "SLURM")) or name == "GROUP_RANK":
            monkeypatch.delenv(name)
    return monkeypatch


def resolve(*flags):
    args = build_parser().parse_args([*flags, "train.py"])
    return resolve_rendezvous(args, parse_backend(args.rdzv_backend), slurm_or_none())


def test_standalone_is_one_node_on_a_local_store_at_a_free_port(env):
    rdzv = resolve("--standalone")
    assert (rdzv.backend, rdzv.min_nodes, rdzv.max_nodes, rdzv.host, rdzv.port) == ("c10d", 1, 1, "127.0.0.1", 0)
    assert len(rdzv.run_id) == 12 and rdzv.is_host is None and rdzv.order_key is None
    assert rdzv.conf["join_timeout"] == 600.0
    assert resolve("--standalone", "--rdzv-id", "job7", "--nnodes", "1:1").run_id == "job7"
    with pytest.raises(UsageError, match="^--standalone is one node: it cannot be combined with --nnodes 2$"):
        resolve("--standalone", "--nnodes", "2")


def test_an_endpoint_means_c10d_on_its_port_or_29400(env):
    rdzv = resolve("--nnodes", "2:4", "--rdzv-endpoint", "node0", "--rdzv-id", "job7")
    assert (rdzv.backend, rdzv.host, rdzv.port, rdzv.min_nodes, rdzv.max_nodes) == ("c10d", "node0", DEFAULT_C10D_PORT, 2, 4)
    assert (rdzv.run_id, rdzv.order_key, rdzv.is_host) == ("job7", None, None)
    rdzv = resolve("--nnodes", "2", "--rdzv-endpoint", "[::1]:5000", "--rdzv-conf", "is_host=true,join_timeout=5")
    assert (rdzv.host, rdzv.port, rdzv.is_host, rdzv.run_id) == ("::1", 5000, True, "none")
    assert rdzv.conf["join_timeout"] == 5.0 and "is_host" not in rdzv.conf
    with pytest.raises(UsageError, match="^--rdzv-endpoint: bad port in 'node0:99999'$"):
        resolve("--nnodes", "2", "--rdzv-endpoint", "node0:99999")


def test_static_is_the_default_and_node_0_hosts_its_store(env):
    rdzv = resolve("--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "1234")
    assert (rdzv.backend, rdzv.host, rdzv.port, rdzv.order_key, rdzv.is_host) == ("static", "10.0.0.1", 1234, 1, False)
    rdzv = resolve("--nnodes", "2")
    assert (rdzv.order_key, rdzv.is_host) == (0, True)
    env.setenv("GROUP_RANK", "3")   # torchrun's variable: the node rank when --node-rank is not given
    assert resolve("--nnodes", "2").order_key == 3
    assert resolve("--nnodes", "2", "--node-rank", "1").order_key == 1
    with pytest.raises(UsageError, match=r"^--rdzv-backend static needs a fixed --nnodes N \(use c10d for MIN:MAX\)$"):
        resolve("--nnodes", "1:3", "--rdzv-backend", "static")


def test_under_slurm_the_store_is_on_the_first_node(env):
    for name, value in SLURM.items():
        env.setenv(name, value)
    rdzv = resolve()
    assert (rdzv.backend, rdzv.host, rdzv.port, rdzv.min_nodes, rdzv.max_nodes) == ("c10d", "n1", 29500, 2, 2)
    assert (rdzv.run_id, rdzv.order_key, rdzv.is_host) == ("77", 1, None)   # no SLURMD_NODENAME: by address
    env.setenv("SLURMD_NODENAME", "n2")
    assert resolve().is_host is False
    env.setenv("SLURMD_NODENAME", "n1")
    assert resolve().is_host is True
    rdzv = resolve("--rdzv-backend", "static", "--master-addr", "h", "--node-rank", "0")   # the flags win
    assert (rdzv.backend, rdzv.host, rdzv.order_key, rdzv.is_host) == ("static", "h", 0, True)
    env.setenv("SLURM_NNODES", "0")
    with pytest.raises(UsageError, match="^SLURM environment: SLURM node count must be >= 1, got 0$"):
        slurm_or_none()
