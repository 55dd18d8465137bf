"""rank_monitor/rank_side/dist_patch.py, the one patch of torch.distributed, in a real process:
installed once however often it is asked for, it asks its hooks at init_process_group (one that
answers True keeps the default group there) and runs them before destroy_process_group. That no
other module patches torch.distributed is tests/house/test_agent_layers.py's.
"""
import subprocess
import sys

from conftest import ROOT

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
