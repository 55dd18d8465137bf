"""What a round costs the store host (issue 34), on a real TCPStore with real round protocols (one
per simulated agent, each its own connection, in threads): O(1) calls and bytes per agent, the
same per agent at 16 and at 48 nodes, no calls while an agent waits for the others; every agent
knows its node rank, rank offset, world size and the two peers it watches.
bench/control_plane_emulator.py measures the same up to thousands of agents.
"""
import threading
import time

import pytest

from ft_launcher.agent.launch_config import LaunchConfig
from ft_launcher.agent.rounds import store_client
from ft_launcher.agent.rounds.job_store import JobStore
from ft_launcher.agent.rounds.rendezvous import RoundProtocol
from ft_launcher.agent.rounds.round_types import NodeInfo

_HOST = {}


def _host():
    if not _HOST:
        cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, entrypoint=["x"], standalone=True, rdzv_port=0)
        _HOST["store"] = JobStore(cfg, lambda line: None)
    return _HOST["store"]


def _round(n, run_id, late_after=0.0):
    """n agents join round 0; the last one `late_after` s after the others. Returns (rounds by
    order, calls, bytes) of the round."""
    cfg = LaunchConfig(min_nodes=n, max_nodes=n, nproc_per_node=4, entrypoint=["x"], is_host=False,
                       rdzv_host="127.0.0.1", rdzv_port=_host().port, rdzv_id=run_id)
    protos = [RoundProtocol(JobStore(cfg, lambda line: None), cfg,
                            NodeInfo(f"{run_id}-{i}", "127.0.0.1", i, 4, alive_port=40000 + i)) for i in range(n)]
    store_client.counting(True)
    before = {m: list(v) for m, v in store_client.STATS.get("main", {}).items()}
    out = [None] * n

    def join(i):
        out[i] = protos[i].join(0)
    threads = [threading.Thread(target=join, args=(i,)) for i in range(n)]
    for t in threads[:-1]:
        t.start()
    time.sleep(late_after)   # the others wait meanwhile: in the store, without calls
    threads[-1].start()
    for t in threads:
        t.join(30)
    after = store_client.STATS["main"]
    calls = sum(v[0] for v in after.values()) - sum(v[0] for v in before.values())
    nbytes = sum(v[1] for v in after.values()) - sum(v[1] for v in before.values())
    for proto in protos:
        proto.store.client.close()
    return out, calls, nbytes


def test_a_round_costs_each_agent_the_same_few_calls_and_bytes_whatever_its_size():
    small, small_calls, small_bytes = _round(16, "scale16")
    large, large_calls, large_bytes = _round(48, "scale48", late_after=2.5)
    for rounds, n in ((small, 16), (large, 48)):
        assert all(r is not None for r in rounds)
        assert [r.group_rank for r in rounds] == list(range(n))
        assert [r.rank_offset for r in rounds] == [4 * i for i in range(n)]
        assert {r.world_size for r in rounds} == {4 * n} and {r.nnodes for r in rounds} == {n}
        assert [[p.node_id for p in r.peers] for r in rounds] == [
            [rounds[(i + 1) % n].me.node_id, rounds[(i + 2) % n].me.node_id] for i in range(n)]
    # join (1 round trip), wait (1), its place (1), and the closer's few: the 47 agents that
    # waited 2.5 s for the last one made no more calls than those that did not wait
    assert large_calls <= 3 * 48 + 16, large_calls
    assert large_calls / 48 <= small_calls / 16 + 0.5, (small_calls, large_calls)
    per_agent_small, per_agent_large = small_bytes / 16, large_bytes / 48
    assert per_agent_large <= 1.3 * per_agent_small, (per_agent_small, per_agent_large)   # O(1) per agent
    assert per_agent_large < 4096, per_agent_large


@pytest.fixture(autouse=True, scope="module")
def _close_host():
    yield
    _HOST.clear()
