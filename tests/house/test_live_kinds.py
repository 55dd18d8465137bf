"""Each kind of object a LiveState keeps sits behind one small interface, `Form`, one class per kind
(rank_monitor/rank_side/live/live_kinds.py; issue 46): a new kind is a new form, not an edit of
every place that switches on the kind. The modules are read, not imported (no torch here).

- every form in live_kinds.py derives from Form, has a `kind` (its own or a form's it derives from)
  and implements each method that Form leaves unimplemented (`raise NotImplementedError`), itself
  or through a form it derives from;
- no other module of live/ switches on a kind: none names MODULE, OPTIMIZER or SNAPSHOT, and
  live_objects.py (the holder, `Tracked`) neither compares a `.kind` nor asks isinstance().
"""
import ast
import glob
import os

from class_shapes import methods, unimplemented
from conftest import ROOT

LIVE = os.path.join(ROOT, "rank_monitor", "rank_side", "live")
KINDS = os.path.join(LIVE, "live_kinds.py")
HOLDER = os.path.join(LIVE, "live_objects.py")
KIND_NAMES = {"MODULE", "OPTIMIZER", "SNAPSHOT"}


def _classes(path: str) -> dict:
    return {node.name: node for node in ast.parse(open(path).read()).body if isinstance(node, ast.ClassDef)}


def _assigns(cls: ast.ClassDef, name: str) -> bool:
    return any(isinstance(s, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in s.targets)
               for s in cls.body)


def _lineage(classes: dict, name: str) -> list:
    """`name` and the forms it derives from in this module, nearest first (single inheritance)."""
    out = []
    while name in classes:
        out.append(classes[name])
        bases = [b.id for b in classes[name].bases if isinstance(b, ast.Name)]
        name = bases[0] if bases else ""
    return out


def test_every_kind_implements_the_form():
    classes = _classes(KINDS)
    assert "Form" in classes, "live_kinds.py has no Form"
    required = {n for n, fn in methods(classes["Form"]).items() if unimplemented(fn)}
    assert required, "Form leaves nothing to its kinds: the interface is gone"
    forms = {n: _lineage(classes, n) for n in classes if n != "Form" and classes["Form"] in _lineage(classes, n)}
    assert len(forms) >= 3, f"fewer forms than kinds (module, optimizer, snapshot): {sorted(forms)}"
    for name, lineage in forms.items():
        below = lineage[:lineage.index(classes["Form"])]
        assert any(_assigns(c, "kind") for c in below), f"live_kinds.{name} names no kind"
        for method in sorted(required):
            assert any(method in methods(c) and not unimplemented(methods(c)[method]) for c in below), (
                f"live_kinds.{name} does not implement Form.{method}")


def test_no_kind_switches_outside_the_forms():
    for path in sorted(glob.glob(os.path.join(LIVE, "*.py"))):
        if path == KINDS:
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            named = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            assert named not in KIND_NAMES, (f"{os.path.basename(path)}:{node.lineno} names {named}: what differs "
                                             f"by kind goes into a method of live_kinds.Form")
    for node in ast.walk(ast.parse(open(HOLDER).read())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            assert not any(isinstance(s, ast.Attribute) and s.attr == "kind" for s in sides), (
                f"live_objects.py:{node.lineno} compares a kind: a method of live_kinds.Form instead")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            raise AssertionError(f"live_objects.py:{node.lineno} asks isinstance(): which form an object has "
                                 f"is live_kinds.form_for's")
