"""agent/'s folders import one way: recovery -> ranks -> observation -> rounds (each may import those
after it, never one before it), and agent/agent.py above them all. The import statements of every
module are read, those inside functions too (a lazy import is an import all the same).

- rounds: the job's store, its keys and the round protocol: what every other part stands on;
- observation: what the operator reads (events, status, stragglers, learned timeouts);
- ranks: the node's processes (they log events, they belong to a round);
- recovery: what ended a cycle and what to do (the supervisor, the policy and the round's end,
  the hang blame): it reads the ranks and the store and decides.
"""
import ast
import os

from conftest import ROOT

ORDER = ["recovery", "ranks", "observation", "rounds"]   # top to bottom


def _imports(path):
    """The agent folders a module imports (ft_launcher.agent.<folder>...), with their lines."""
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[:2] == ["ft_launcher", "agent"] and len(parts) > 2 and parts[2] in ORDER:
                yield node.lineno, parts[2]
                break


def test_no_folder_of_agent_imports_one_above_it():
    upward = []
    for folder in ORDER:
        for name in sorted(os.listdir(os.path.join(ROOT, "agent", folder))):
            if not name.endswith(".py"):
                continue
            path = os.path.join(ROOT, "agent", folder, name)
            for line, target in _imports(path):
                if ORDER.index(target) < ORDER.index(folder):
                    upward.append(f"agent/{folder}/{name}:{line} imports agent.{target}")
    assert not upward, "\n".join(upward)


def test_the_order_names_every_folder():
    folders = {d for d in os.listdir(os.path.join(ROOT, "agent"))
               if os.path.isfile(os.path.join(ROOT, "agent", d, "__init__.py"))}
    assert folders == set(ORDER)
