"""A state's layout and shard identity (what the step exchange compares) and the device meshes its
DTensors sit on: per tensor, its local shape and dtype; per DTensor, its placements and this rank's
coordinate on the dimensions it is sharded on; a short text of an identity for the fallback line."""
from __future__ import annotations

import collections
import sys
from typing import Optional

from ft_launcher.rank_monitor.rank_side.live import live_wire as W


def _coordinate(mesh) -> list:
    """This rank's coordinate on `mesh`: where this process's rank in the current process group sits
    in the mesh's rank map (not the mesh's own coordinate, which is the rank of the process that made
    it: a mesh from a previous call, as torch's caches handed out before rank_side.dtensor_cycle,
    would name the shard this process held then)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        found = (mesh.mesh == dist.get_rank()).nonzero()
        return found[0].tolist() if len(found) else []
    return list(mesh.get_coordinate() or [])



def identity_entries(state) -> list:
    """Which part of a sharded state this rank holds, from its DTensors: per DTensor, its placements
    and, on every mesh dimension it is not replicated on, that dimension's size and this rank's
    coordinate. The replicated dimensions' sizes are not part of it: a replica is the same state
    whatever the number of replicas (an elastic job that lost a replica keeps it); a sharded
    dimension of another size is another shard. [] for plain tensors (every rank holds the same:
    data parallelism)."""
    out = []
    for path, t in W.flat(state).items():
        if not W.is_dtensor(t):
            continue
        mesh = t.device_mesh
        coord = _coordinate(mesh)
        sharded = tuple((d, mesh.shape[d], coord[d] if d < len(coord) else None) for d, p in enumerate(t.placements)
                        if not p.is_replicate())
        out.append((path, len(mesh.shape), tuple(str(p) for p in t.placements), sharded))
    return out



def distinct_meshes(tensors) -> list:
    """The device meshes of the DTensors among `tensors`, each once (by identity)."""
    out: list = []
    for t in tensors:
        if W.is_dtensor(t) and not any(t.device_mesh is m for m in out):
            out.append(t.device_mesh)
    return out



def layout_entries(state) -> list:
    """(path, local shape, dtype) of every tensor of a state dict."""
    return [(path, tuple(W.local(t).shape), str(t.dtype)) for path, t in W.flat(state).items()]



def describe_identity(entries: list, shard: Optional[int]) -> str:
    """A short text of a shard identity (for the fallback line)."""
    parts = [] if shard is None else [f"shard={shard}"]
    coords = collections.OrderedDict()
    for _, mesh, placements, sharded in entries:
        coords[(mesh, placements, sharded)] = True
    for ndim, placements, sharded in list(coords)[:2]:
        parts.append(f"{ndim}-d mesh {'/'.join(placements)} at " + ", ".join(f"dim {d}={c} of {n}" for d, n, c in sharded))
    return "; ".join(parts) or "unsharded"
