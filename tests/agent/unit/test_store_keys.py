"""The store's keys have one owner (agent/rounds/store_keys.py): every key the agents share is declared
there with its shape, writer, readers and what a store failover does with it; no other module
composes a key; and a failover carries exactly the keys marked CARRIED (a real store host, a real
successor hosting the next store, the round protocol and the failover of agent/rounds).
Whole jobs that fail over between failures: tests/agent/jobs/test_store_failover.py.
"""
import ast
import inspect
import json
import os
import re

from conftest import ROOT, free_port

from ft_launcher.agent.launch_config import LaunchConfig
from ft_launcher.agent.recovery.no_restart import mark_excluded
from ft_launcher.agent.recovery.round_end import RoundEnd
from ft_launcher.agent.rounds import store_keys
from ft_launcher.agent.rounds.job_store import JobStore
from ft_launcher.agent.rounds.rendezvous import RoundProtocol
from ft_launcher.agent.rounds.round_types import NodeInfo, Round, StoreLost
from ft_launcher.agent.rounds.store_failover import StoreFailover
from ft_launcher.rank_monitor.config import FaultToleranceConfig

NODES = ("node-a", "node-b", "node-c")
ROUNDS = (0, 1, 2)


def _samples(key):
    """Every name of `key` for the test's rounds, nodes and parts, with its pattern filled in."""
    params = list(inspect.signature(key.name).parameters)
    out = []

    def fill(values):
        text = key.pattern
        for placeholder, value in values.items():
            text = text.replace(placeholder, str(value))
        return text

    if not params:
        return [(key.name(), key.pattern)]
    rounds = ROUNDS if params[0] in ("r", "c") else [None]
    for r in rounds:
        for node in (NODES if "node_id" in params else [None]):
            parts = {"blame": store_keys.BLAME_PARTS, "flight": store_keys.FR_PARTS}.get(key.name.__name__, [None])
            for part in parts:
                args, places = [], {}
                if r is not None:
                    args.append(r)
                    places.update({"<R>": r, "<c>": r})
                if node is not None:
                    args.append(node)
                    places["<node>"] = node
                if "group_rank" in params or "rank" in params:
                    args.append(0)
                    places.update({"<g>": 0, "<rank>": 0})
                if part is not None:
                    args.append(part)
                    places["<part>"] = part
                out.append((key.name(*args), fill(places)))
    return out


def test_every_key_is_declared_with_its_shape_writer_readers_and_failover_mark():
    assert len(store_keys.KEYS) > 30
    for key in store_keys.KEYS.values():
        assert key.shape and key.writer and key.readers, key.pattern
        assert key.failover in (store_keys.SEEDED, store_keys.CARRIED) or key.failover.startswith("not carried: ")
        for name, expected in _samples(key):
            assert name == expected, (key.pattern, name)
    # every function of the module that names a key is a declared key's
    functions = {n for n, f in vars(store_keys).items() if inspect.isfunction(f) and f.__module__ == store_keys.__name__}
    helpers = {"key", "carry_rounds", "carried_names"}
    assert functions - helpers == {k.name.__name__ for k in store_keys.KEYS.values()}


def test_a_key_without_its_failover_mark_cannot_be_declared():
    try:
        store_keys.key("x/<node>", shape="s", writer="w", readers="r", failover="maybe")
    except ValueError as exc:
        assert "failover must be" in str(exc)
    else:
        raise AssertionError("declared without a failover mark")


STORE_CALLS = {"put", "get", "count", "exists", "get_many", "get_raw", "put_raw", "k", "key", "_k", "set", "add",
               "check", "compare_set", "append", "wait", "begin_wait", "get_now", "multi_get_now", "multi_set"}
RECEIVER = re.compile(r"(proto|store|client|news|^self\.s$|^self$)")
JOB_WIDE = {k.name() for k in store_keys.KEYS.values() if not inspect.signature(k.name).parameters}


def _composed_keys(path):
    """(line, source) of every key name a module composes itself: an f-string naming a round's key
    (f"r{...}/..."), or handed to a store call, or a job-wide key's name or a path handed to one
    (a part's name handed to a module's own helper, `_k("hung")`, is named by store_keys there)."""
    tree = ast.parse(open(path).read())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr) and ast.unparse(node).startswith(("f'r{", 'f"r{')):
            found.append((node.lineno, ast.unparse(node)))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in STORE_CALLS
                and RECEIVER.search(ast.unparse(node.func.value)) and node.args):
            first = node.args[0]
            items = first.elts if isinstance(first, (ast.List, ast.Tuple)) else [first]
            for item in items:
                if isinstance(item, ast.JoinedStr) or (isinstance(item, ast.Constant) and isinstance(item.value, str)
                                                       and (item.value in JOB_WIDE or "/" in item.value)):
                    found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_module_composes_a_store_key_but_store_keys():
    agent_dir = os.path.join(ROOT, "agent")
    offenders = []
    for folder, _, files in os.walk(agent_dir):
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".py") and path != store_keys.__file__ and not name == "store_client.py":
                offenders += [f"{os.path.relpath(path, ROOT)}:{line}: {src}" for line, src in _composed_keys(path)]
    assert not offenders, "compose store keys through agent/rounds/store_keys.py:\n" + "\n".join(offenders)


def _node_cfg(port, node, ft):
    return LaunchConfig(min_nodes=2, max_nodes=3, nproc_per_node=1, entrypoint=["x"], rdzv_host="127.0.0.1",
                        rdzv_port=port, rdzv_id="carry", is_host=node == NODES[0], max_restarts=10, ft=ft)


def test_a_failover_carries_exactly_the_keys_marked_carried():
    """Every declared key is in the lost store (rounds 0-2, every node); the survivor at the head
    of round 3's order read what a failover carries when it joined, and hosts the successor: there
    it finds exactly the CARRIED keys with their values, the SEEDED ones fresh, round 3 ended as a
    store loss, and none of the rest. The excluded node is still excluded: too few may remain."""
    ft = FaultToleranceConfig(max_identical_failures=3)
    port = free_port()
    host_cfg, cfg = _node_cfg(port, NODES[0], ft), _node_cfg(port, NODES[1], ft)
    host = JobStore(host_cfg, lambda line: None)
    nodes = [NodeInfo(n, "127.0.0.1", i, 1, hosts_store=i == 0) for i, n in enumerate(NODES)]
    old = RoundProtocol(host, host_cfg, nodes[0])
    written = {}
    for key in store_keys.KEYS.values():
        for name, _ in _samples(key):
            written[name] = (key, f'{{"n": "{name}"}}' if key.pattern.endswith(("interrupt", "origin")) else "7")
    old.put_raw(list(written), [v for _, v in written.values()])
    store = JobStore(cfg, lambda line: None)
    proto = RoundProtocol(store, cfg, nodes[1])
    failover = StoreFailover(cfg, store, proto, nodes[1], lambda line: None)
    round_end = failover.round_end = RoundEnd(proto, cfg)
    before = dict(zip(written, old.get_raw(list(written))))   # (each agent drew its order from `agents`)
    try:
        failover.remember(Round(3, nodes[1], nodes[:2], nodes[2:]))
        assert failover.take_over(StoreLost("test: the store host is gone")) == (4, 2)
        assert store.is_host and store.port == port + 1
        values = dict(zip(written, proto.get_raw(list(written))))
        for name, (key, _) in written.items():
            if key.failover == store_keys.CARRIED:
                assert values[name] == before[name], (name, values[name])
            elif key.failover != store_keys.SEEDED:
                assert values[name] == b"", (name, values[name])
        assert proto.get(store_keys.next_round()) == "4" and proto.restarts_used() == 8
        assert json.loads(proto.get(store_keys.interrupt(3)))["kind"] == "store_lost"
        # the policy's inputs on the successor: the node that left is still gone
        assert proto.exists(store_keys.excluded_node("node-c")) and mark_excluded(proto, "node-c") == 7
        assert round_end.policy.too_few_left(proto.count(store_keys.excluded()))
    finally:
        for s in (store, host):
            s.client.close()
