"""Each source a recovering rank's state arrives from sits behind one small interface, `Transport`
(rank_monitor/rank_side/live/transport.py), one class per source in restore_transfer.py (issue 46,
as torchft's CheckpointTransport): a new source is a new transport, not an edit of `arrive`. The
modules are read, not imported (no torch here).

- every class of restore_transfer.py that derives from Transport implements each method that
  Transport leaves unimplemented (`raise NotImplementedError`), says what it moves (a docstring),
  and is in TRANSPORTS once: kept state, then buddy copies, then the live transfers;
- `arrive` lets each of TRANSPORTS act (a `for` over it) and names no source's own call: no
  buddy_copy, no live_wire move/send/receive, no torch send/recv, no per-rank record, and
  it asks no `plan.kept` nor whether buddy copies are on.
"""
import ast
import os

from class_shapes import methods, unimplemented
from conftest import ROOT

LIVE = os.path.join(ROOT, "rank_monitor", "rank_side", "live")
INTERFACE = os.path.join(LIVE, "transport.py")
SOURCES = os.path.join(LIVE, "restore_transfer.py")
SOURCE_ATTRIBUTES = {"fetch", "move_state", "send_state", "recv_state", "send", "recv", "_records", "kept"}
SOURCE_MODULES = {"buddy_copy", "W"}   # buddy copies, live_wire
PASSED_ON = {"buddy", "copies"}        # arrive's arguments that only a transport reads


def _tree(path: str) -> ast.Module:
    return ast.parse(open(path).read())


def _classes(tree: ast.Module) -> dict:
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def _transports(tree: ast.Module) -> dict:
    return {name: cls for name, cls in _classes(tree).items()
            if any(isinstance(b, ast.Name) and b.id == "Transport" for b in cls.bases)}


def _listed(tree: ast.Module) -> list:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "TRANSPORTS" for t in node.targets):
            assert isinstance(node.value, (ast.Tuple, ast.List)), "TRANSPORTS is not a tuple of transports"
            return [e.func.id for e in node.value.elts if isinstance(e, ast.Call) and isinstance(e.func, ast.Name)]
    raise AssertionError("restore_transfer.py has no TRANSPORTS")


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"restore_transfer.py has no {name}()"
    return found[0]


def test_every_transport_implements_the_interface_and_is_listed():
    interface = _classes(_tree(INTERFACE))
    assert "Transport" in interface, "transport.py has no Transport"
    required = {n for n, fn in methods(interface["Transport"]).items() if unimplemented(fn)}
    assert required, "Transport leaves nothing to its sources: the interface is gone"
    tree = _tree(SOURCES)
    transports = _transports(tree)
    assert {"KeptState", "BuddyCopyRead", "PeerTransfer", "OwnRecord"} <= set(transports), sorted(transports)
    for name, cls in transports.items():
        assert ast.get_docstring(cls), f"restore_transfer.{name} says not what it moves and over what"
        for method in sorted(required):
            fn = methods(cls).get(method)
            assert fn is not None and not unimplemented(fn), f"restore_transfer.{name} does not implement {method}"
    listed = _listed(tree)
    assert sorted(listed) == sorted(transports) and len(set(listed)) == len(listed), (
        f"TRANSPORTS {listed} is not each transport once ({sorted(transports)})")
    assert listed.index("KeptState") < listed.index("BuddyCopyRead") < listed.index("PeerTransfer"), (
        f"the order is kept state, buddy copies, then live transfers: {listed}")


def test_arrive_lets_each_transport_act_and_names_no_source():
    fn = _function(_tree(SOURCES), "arrive")
    loops = [n for n in ast.walk(fn) if isinstance(n, ast.For)
             and isinstance(n.iter, ast.Name) and n.iter.id == "TRANSPORTS"]
    assert len(loops) == 1, "arrive does not let each of TRANSPORTS act in one loop"
    for node in ast.walk(fn):
        if isinstance(node, ast.Attribute):
            assert node.attr not in SOURCE_ATTRIBUTES, (
                f"restore_transfer.py:{node.lineno}: arrive calls .{node.attr}: what one source does goes into its "
                f"transport")
        if isinstance(node, ast.Name):
            assert node.id not in SOURCE_MODULES, (
                f"restore_transfer.py:{node.lineno}: arrive uses {node.id}: what one source does goes into its "
                f"transport")
    tests = [n for node in ast.walk(fn) if isinstance(node, (ast.If, ast.IfExp, ast.While))
             for n in ast.walk(node.test)]
    asked = sorted({n.id for n in tests if isinstance(n, ast.Name) and n.id in PASSED_ON})
    assert not asked, f"arrive asks {asked}: whether a source acts is its transport's own question"
