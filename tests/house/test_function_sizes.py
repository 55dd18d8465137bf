"""Functions that read as the protocol they run stay short enough to read in one screen: a phase
that grows goes into a method or a module of its own with its docstring (issue 46).

- `LiveState.restore` (rank_monitor/rank_side/live/live_state.py): at most RESTORE_LINES lines, its
  docstring included: read fresh objects, exchange rows and plan, move / fetch / send and receive
  (rank_side/live/restore_transfer.py), bind, verify, load, report.
"""
import ast
import os

from conftest import ROOT

LIVE_STATE = os.path.join(ROOT, "rank_monitor", "rank_side", "live", "live_state.py")
RESTORE_LINES = 60


def _method(path: str, cls: str, name: str) -> ast.FunctionDef:
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return item
    raise AssertionError(f"{path} has no {cls}.{name}")


def test_live_state_restore_reads_in_one_screen():
    fn = _method(LIVE_STATE, "LiveState", "restore")
    lines = fn.end_lineno - fn.lineno + 1
    assert lines <= RESTORE_LINES, (f"LiveState.restore is {lines} lines (at most {RESTORE_LINES}): move a phase "
                                    f"into a method or rank_side/live/restore_transfer.py")
