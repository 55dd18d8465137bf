"""One patch of torch.distributed: rank_monitor/rank_side/dist_patch.py is the only module of ours that
assigns an attribute of `torch.distributed` or `torch.distributed.distributed_c10d` (x.attr = ...,
setattr(x, ...)), whatever name the module is bound to (`import torch.distributed as dist`,
`from torch.distributed import distributed_c10d as c10d`, `sys.modules.get("torch.distributed...")`).
The wrap itself, installed once and asked by its hooks, runs in a real process below.
"""
import ast
import os
import subprocess
import sys

from conftest import ROOT

PATCHER = "rank_monitor/rank_side/dist_patch.py"
TORCH_DIST = {"torch.distributed", "torch.distributed.distributed_c10d"}


def _py_files(*tops):
    for top in tops:
        for folder, _dirs, files in os.walk(os.path.join(ROOT, top)):
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    yield os.path.relpath(path, ROOT), path


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


PROBE = r"""
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from ft_launcher.rank_monitor.rank_side import dist_patch

torch_init, torch_destroy = c10d.init_process_group, c10d.destroy_process_group
asked, drained = [], []
dist_patch.on_init("probe", lambda: asked.append(1) or len(asked) == 2)
dist_patch.before_destroy("probe", lambda: drained.append(1))
dist_patch.install(); dist_patch.on_init("probe", lambda: asked.append(1) or len(asked) == 2)   # again: once
assert dist.init_process_group is c10d.init_process_group and dist.init_process_group.__wrapped__ is torch_init
assert dist.destroy_process_group.__wrapped__ is torch_destroy
store = dist.HashStore()
dist.init_process_group("gloo", store=store, rank=0, world_size=1)   # asked: no
group = dist.group.WORLD
assert dist.init_process_group("gloo", store=store, rank=0, world_size=1) is None   # asked: keep it
assert dist.group.WORLD is group and len(asked) == 2
dist.destroy_process_group()
assert drained == [1] and not dist.is_initialized()
print("ok")
"""


def test_the_wrap_is_installed_once_and_asks_its_hooks():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr
