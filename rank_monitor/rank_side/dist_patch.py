"""The one place that patches torch.distributed: what the rank's side changes in torch, and why.

Two of torch's functions are wrapped, once per process (`install`, idempotent), where a script finds
them (`torch.distributed.X`) and where torch's own modules call them (`distributed_c10d.X`); each
wrapper asks hooks that the rank's parts register by name (registering a name again replaces it):
- `init_process_group`: every `on_init` hook is asked; when one answers True and a default group
  exists, the call keeps that group and returns None (rank_side.inprocess: a step's re-run from
  memory finds its call's group; without this torch fails with "initialize the default process
  group twice"). Each hook is asked at every call, so it can forget what it asked for.
- `destroy_process_group`: every `before_destroy` hook runs first (rank_side.live.live_teardown: the
  buddy exchange in flight ends first: a group destroyed under it aborts the process).
And torch's registry of process groups (`distributed_c10d._pg_map`) is swapped, once, for a dict of
rank_side.call_groups that also holds each group entered (`swap_group_registry`).

A script that bound a function before the wrap (`from torch.distributed import init_process_group`
at its top, before a re-run or a buddy copy asked for the wrap) keeps torch's own. Nothing else in
the project assigns to torch.distributed (tests/house/test_agent_layers.py; the wrap itself:
tests/monitor/unit/test_dist_patch.py).
"""
from __future__ import annotations

import functools
import sys
from typing import Callable, Dict, Optional

_ON_INIT: Dict[str, Callable[[], bool]] = {}
_BEFORE_DESTROY: Dict[str, Callable[[], None]] = {}
MARK = "_ft_patch"   # set on our wrappers: a wrapped function is never wrapped again


def on_init(name: str, keep: Callable[[], bool]) -> None:
    """Ask `keep()` at each init_process_group: True keeps the default group that exists."""
    _ON_INIT[name] = keep
    install()


def before_destroy(name: str, fn: Callable[[], None]) -> None:
    """Run `fn()` at each destroy_process_group, before torch destroys the group."""
    _BEFORE_DESTROY[name] = fn
    install()


def install() -> None:
    """Wrap init_process_group and destroy_process_group (once; imports torch.distributed)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not getattr(c10d.init_process_group, MARK, False):
        original_init = c10d.init_process_group

        @functools.wraps(original_init)
        def init_process_group(*args, **kwargs):
            keep = [ask() for ask in list(_ON_INIT.values())]   # every hook is asked: each forgets its wish
            if any(keep) and dist.is_initialized():
                return None
            return original_init(*args, **kwargs)

        setattr(init_process_group, MARK, True)
        dist.init_process_group = c10d.init_process_group = init_process_group

    if not getattr(c10d.destroy_process_group, MARK, False):
        original_destroy = c10d.destroy_process_group

        @functools.wraps(original_destroy)
        def destroy_process_group(*args, **kwargs):
            for fn in list(_BEFORE_DESTROY.values()):
                fn()
            return original_destroy(*args, **kwargs)

        setattr(destroy_process_group, MARK, True)
        dist.destroy_process_group = c10d.destroy_process_group = destroy_process_group


def swap_group_registry(registry_type: type) -> Optional[dict]:
    """torch's registry of groups (`distributed_c10d._pg_map`) as a `registry_type` (a dict subclass
    made from torch's), swapped in once; None where torch.distributed is not imported or has none."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    registry = getattr(c10d, "_pg_map", None)
    if not isinstance(registry, dict):
        return None
    if not isinstance(registry, registry_type):
        c10d._pg_map = registry = registry_type(registry)
    return registry
