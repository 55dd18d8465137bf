"""NVLink-domain segments (`segment`, NVRx 0.7's --ft-segment N): nodes train in whole segments.

On NVSwitch systems (GB200 NVL72 and the like) the nodes of one NVLink domain share a cluster
UUID, which NVML reports for each GPU (`nvmlDeviceGetGpuFabricInfo`). With `segment` N, as in
NVRx, a segment is N nodes of one domain: each node publishes its domain when it joins a round
(NodeInfo.domain), a round closes only once the nodes that joined hold enough whole segments for
the nodes that train (MIN of --nnodes, which must be a multiple of N), and every node then
computes the same split: walking the domains in node order (the domain of the first node in
order first), each gives as many whole segments as it has and the job still needs; those nodes
train, taking consecutive group ranks (so consecutive global ranks share a domain), and every
other node, a domain's remainder included, waits as a hot spare. A node that cannot tell its
domain (no NVML, no fabric) cannot join a segmented job: one line says so.
"""
from __future__ import annotations

import ctypes
import uuid
from typing import Dict, List, Optional, Sequence, Tuple


def node_domain() -> Tuple[Optional[str], str]:
    """-> (this node's NVLink domain: the cluster UUID of its first GPU, or None; why not)."""
    try:
        import pynvml
    except ImportError:
        return None, "pynvml (nvidia-ml-py) is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return None, f"NVML is not available ({exc})"
    try:
        if pynvml.nvmlDeviceGetCount() == 0:
            return None, "NVML sees no GPU"
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        info = pynvml.c_nvmlGpuFabricInfo_t()
        pynvml.nvmlDeviceGetGpuFabricInfo(handle, info)
        field = type(info).clusterUuid   # raw bytes: reading the field would stop at a zero byte
        raw = ctypes.string_at(ctypes.addressof(info) + field.offset, min(field.size, 16))
        if not raw.strip(b"\0"):
            return None, "GPU 0 reports no NVLink fabric cluster UUID"
        return str(uuid.UUID(bytes=raw.ljust(16, b"\0"))), ""
    except (pynvml.NVMLError, AttributeError) as exc:
        return None, f"GPU 0 reports no NVLink fabric ({exc})"
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def split(nodes: Sequence, train: int, segment: int) -> Optional[Tuple[List, List]]:
    """(training nodes, spares) from `nodes` in node order, in whole segments of one domain each;
    None when they do not hold train // segment whole segments."""
    domains: Dict[str, List] = {}
    for node in nodes:
        domains.setdefault(node.domain or "", []).append(node)
    need = train // segment
    active: List = []
    for members in domains.values():   # in the order of each domain's first node
        take = min(len(members) // segment, need - len(active) // segment)
        active += members[: take * segment]
    if len(active) < train:
        return None
    chosen = {id(n) for n in active}
    return active, [n for n in nodes if id(n) not in chosen]


def shortfall(nodes: Sequence, train: int, segment: int) -> str:
    """Why `nodes` cannot train `train` nodes in whole segments, in one line."""
    domains: Dict[str, int] = {}
    for node in nodes:
        domains[node.domain or "?"] = domains.get(node.domain or "?", 0) + 1
    whole = sum(count // segment for count in domains.values())
    return (f"{len(nodes)} node(s) in {len(domains)} NVLink domain(s) ({', '.join(f'{d[:8]}: {c}' for d, c in domains.items())}) "
            f"hold {whole} whole segment(s) of {segment}; {train // segment} are needed for {train} training nodes")
