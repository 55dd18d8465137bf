"""DTensor across an in-place restart: forget torch's caches that hold the failed call's DeviceMesh.

torch caches DTensor sharding decisions process-wide, keyed on DTensorSpecs whose DeviceMesh
compares equal by its shape, rank map and dimension names only, not by its process groups or this
rank's coordinate (torch 2.13: ShardingPropagator's Python and C++ caches, `_gen_transform_infos`,
the redistribute planners, MeshTopoInfo). A cache hit hands out the spec it made first, with the
mesh of the call that made it. After an in-place restart the next call builds an equal mesh over
new process groups, and every DTensor op's output, `nn.Parameter(dtensor)` inside `fully_shard`
included, is then on the previous call's mesh: its group names are the previous world's and its
coordinate is the rank this process had then. Where a rank kept its place the names happen to
resolve to the new groups; where it moved (a lost node, the survivors renumbered) `full_tensor()`
fails with "Could not resolve the process group registered under the name N", and a mesh's
coordinate says the shard the process held before, not the one it holds now.

`forget_meshes()` runs at every restart point (rank_side.inprocess, after the process group is
destroyed): it clears those caches, so the next call's DTensors are on the next call's mesh. The
caches are private to torch: each is cleared where it exists; a missing one is skipped.
"""
from __future__ import annotations

import sys
from typing import List


def forget_meshes() -> List[str]:
    """Clear torch's DTensor caches that hold a DeviceMesh (only where DTensor was imported).
    -> the names of the caches cleared."""
    if "torch.distributed.tensor" not in sys.modules:
        return []
    cleared: List[str] = []

    def clear(name: str, fn) -> None:
        try:
            fn()
            cleared.append(name)
        except (AttributeError, ImportError, RuntimeError, TypeError):
            pass

    def sharding_propagator():
        from torch.distributed.tensor import DTensor

        return DTensor._op_dispatcher.sharding_propagator

    def redistribute():
        from torch.distributed.tensor import _redistribute

        return _redistribute

    def mesh_topo():
        from torch.distributed.tensor._collective_utils import MeshTopoInfo

        return MeshTopoInfo

    import torch

    clear("sharding propagation", lambda: sharding_propagator().propagate_op_sharding.cache_clear())
    clear("sharding propagation (C++)", torch._C._clear_DTensor_sharding_propagator_cache)
    clear("tensor meta propagation", lambda: type(sharding_propagator())._propagate_tensor_meta_cached.cache_clear())
    clear("redistribute transforms", lambda: redistribute()._gen_transform_infos.cache_clear())
    clear("redistribute planners", lambda: redistribute().clear_redistribute_planner_cache())
    clear("mesh topology", lambda: mesh_topo().build_from_mesh.cache_clear())
    return cleared
