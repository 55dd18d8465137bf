"""agent/'s folders import one way: recovery -> ranks -> observation -> rounds (each may import those
after it, never one before it), and agent/agent.py above them all, on at most AGENT_IMPORTS of our
modules; --elastic is read in elastic's room only; rank_monitor/rank_side/ never imports its live/
folder; only rank_side/dist_patch.py patches torch.distributed. The import statements of every
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


# ---- elastic's room -------------------------------------------------------------------------------
# --elastic (cfg.elastic, args.elastic) is read in elastic's room only: the rules of MIN/MAX, shrink,
# grow, the spare's wait and the resize line; every other module asks it (agent.rounds.elastic). The
# command line hands the option over once, where it builds the launch config.
ELASTIC_ROOM = {"agent/rounds/elastic.py"}
ELASTIC_DOOR = {"ft_launcher/cli.py": 1}   # where the option becomes the config: how many reads


def _py_files(*tops):
    for top in tops:
        for folder, _dirs, files in os.walk(os.path.join(ROOT, top)):
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    yield os.path.relpath(path, ROOT), path


def _elastic_reads(path):
    """Lines that read an `elastic` attribute (x.elastic, getattr(x, "elastic"))."""
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Attribute) and node.attr == "elastic":
            yield node.lineno
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value == "elastic"):
            yield node.lineno


def test_no_module_outside_elastics_room_reads_the_elastic_flag():
    readers = []
    for rel, path in _py_files("agent", "rank_monitor", "ft_launcher"):
        if rel in ELASTIC_ROOM:
            continue
        lines = list(_elastic_reads(path))
        if len(lines) > ELASTIC_DOOR.get(rel, 0):
            readers.append(f"{rel}:{','.join(map(str, lines))} reads the elastic flag")
    assert not readers, "\n".join(readers)
    assert all(list(_elastic_reads(os.path.join(ROOT, rel))) for rel in ELASTIC_ROOM | set(ELASTIC_DOOR))


# ---- agent.py stays the node's loop ---------------------------------------------------------------
# It keeps the node's life, the loop over rounds that switches on the cycle's next step
# (agent.recovery.cycle_end), the signal path and the exit codes; running a cycle is
# agent.recovery.node_cycle's. Every project module it imports counts, lazy ones too.
AGENT_IMPORTS = 12
PACKAGES = {"ft_launcher.agent": "agent", "ft_launcher.rank_monitor": "rank_monitor", "ft_launcher": "ft_launcher"}


def _module_path(dotted):
    """The file of project module `dotted` (a package's __init__), or None."""
    for prefix, folder in PACKAGES.items():
        if dotted == prefix or dotted.startswith(prefix + "."):
            rest = dotted[len(prefix):].lstrip(".").split(".") if dotted != prefix else []
            base = os.path.join(ROOT, folder, *rest)
            for path in (base + ".py", os.path.join(base, "__init__.py")):
                if os.path.isfile(path):
                    return path
            return None
    return None


def project_imports(path, package):
    """The project modules a module imports (`from X import m` counts module m, `from X import name` X)."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            if not base.startswith("ft_launcher"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if _module_path(sub) else base)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("ft_launcher"))
    return found


def test_agent_py_imports_at_most_twelve_of_our_modules():
    mods = project_imports(os.path.join(ROOT, "agent", "agent.py"), "ft_launcher.agent")
    assert all(_module_path(m) for m in mods), mods
    assert len(mods) <= AGENT_IMPORTS, f"{len(mods)} > {AGENT_IMPORTS}: " + ", ".join(sorted(mods))


# ---- rank_side/ and its live/ ---------------------------------------------------------------------
# Live state (rank_monitor/rank_side/live/: LiveState, buddy copies, the step guard) stands on the
# rank's side (rank_monitor/rank_side/: the in-place restart, the exit settle, the group's backend,
# dist_patch, gpu_commit, dtensor_cycle); no module of rank_side/ imports live/, lazy imports too, so
# the two never form a cycle. A part both need belongs in rank_side/.
RANK_SIDE = os.path.join(ROOT, "rank_monitor", "rank_side")
LIVE = "ft_launcher.rank_monitor.rank_side.live"


def test_rank_side_never_imports_its_live_folder():
    upward = []
    for name in sorted(os.listdir(RANK_SIDE)):
        if name.endswith(".py"):
            mods = project_imports(os.path.join(RANK_SIDE, name), "ft_launcher.rank_monitor.rank_side")
            upward += [f"rank_monitor/rank_side/{name} imports {m}" for m in sorted(mods)
                       if m == LIVE or m.startswith(LIVE + ".")]
    assert not upward, "\n".join(upward)
    live = os.path.join(RANK_SIDE, "live", "live_state.py")   # the other way is the design's: the check sees it
    assert any(m.startswith("ft_launcher.rank_monitor.rank_side.") and not m.startswith(LIVE)
               for m in project_imports(live, LIVE))


# ---- one patch of torch.distributed --------------------------------------------------------------
# rank_monitor/rank_side/dist_patch.py is the only module of ours that assigns an attribute of
# `torch.distributed` or `torch.distributed.distributed_c10d` (x.attr = ..., setattr(x, ...)), whatever
# name the module is bound to (`import torch.distributed as dist`, `from torch.distributed import
# distributed_c10d as c10d`, `sys.modules.get("torch.distributed...")`). Its wrap, installed once and
# asking its hooks, runs in tests/monitor/unit/test_dist_patch.py.
PATCHER = "rank_monitor/rank_side/dist_patch.py"
TORCH_DIST = {"torch.distributed", "torch.distributed.distributed_c10d"}


def _dotted(node):
    """'a.b.c' for a chain of names and attributes, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id] + parts[::-1])
    return None


def _torch_dist_names(tree):
    """The local names a module binds to torch.distributed or its distributed_c10d."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.asname for a in node.names if a.asname and a.name in TORCH_DIST)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update(a.asname or a.name for a in node.names if f"{node.module}.{a.name}" in TORCH_DIST)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            if any(isinstance(arg, ast.Constant) and arg.value in TORCH_DIST for arg in node.value.args):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _patches(path):
    """Lines that assign an attribute of torch.distributed / distributed_c10d."""
    tree = ast.parse(open(path).read())
    names = _torch_dist_names(tree)

    def is_torch_dist(node):
        dotted = _dotted(node)
        return dotted is not None and (dotted in names or dotted in TORCH_DIST)

    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            if node.args and is_torch_dist(node.args[0]):
                yield node.lineno
            continue
        if any(isinstance(t, ast.Attribute) and is_torch_dist(t.value) for t in targets):
            yield node.lineno


def test_only_dist_patch_assigns_to_torch_distributed():
    found = {rel: list(_patches(path)) for rel, path in _py_files("agent", "rank_monitor", "ft_launcher")}
    others = [f"{rel}:{','.join(map(str, lines))}" for rel, lines in found.items() if lines and rel != PATCHER]
    assert not others, "assigns to torch.distributed outside dist_patch.py: " + " ".join(others)
    assert found[PATCHER], "the check no longer sees dist_patch.py's own assignments"
