"""NUMA binding as NVRx 0.7 does it when NVRX_GPUS_PER_NUMA is set: local rank r runs on the CPUs
of NUMA node r // NVRX_GPUS_PER_NUMA (NVRx: `numactl --cpunodebind`).

The agent sets the affinity of every thread of the rank's process right after it starts (a cold
interpreter or an activated warm reserve alike), from the node's cpulist in
/sys/devices/system/node; no numactl is needed. Memory is not bound: it is allocated on the node
of the CPU that first touches it (the kernel's default, NVRx's `--ft-numa-bind-strict false`,
`--localalloc`); with numa_bind_strict true (NVRx's default, `--membind`) the launcher says so in
one line. A node that does not exist leaves its ranks unbound, said in one line at start.
"""
from __future__ import annotations

import os
from typing import List, Optional, Set

ENV = "NVRX_GPUS_PER_NUMA"
NODE_ROOT = "/sys/devices/system/node"


def gpus_per_numa(env=os.environ) -> Optional[int]:
    text = env.get(ENV, "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def parse_cpulist(text: str) -> Set[int]:
    cpus: Set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def node_cpus(node: int, root: str = NODE_ROOT) -> Optional[Set[int]]:
    try:
        with open(os.path.join(root, f"node{node}", "cpulist")) as fh:
            return parse_cpulist(fh.read()) or None
    except (OSError, ValueError):
        return None


def problems(nproc: int, strict: bool, env=os.environ, root: str = NODE_ROOT) -> List[str]:
    """What the launcher says at start about the binding it will do (nothing without the variable)."""
    per = gpus_per_numa(env)
    if per is None:
        if env.get(ENV):
            return [f"{ENV}={env[ENV]!r} is not a positive number: ranks are not bound to NUMA nodes"]
        return []
    out = []
    missing = sorted({r // per for r in range(nproc) if node_cpus(r // per, root) is None})
    if missing:
        out.append(f"{ENV}={per}: NUMA node{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} "
                   f"{'do' if len(missing) > 1 else 'does'} not exist on this machine: "
                   f"{'their' if len(missing) > 1 else 'its'} local ranks are not bound")
    if strict:
        out.append("numa_bind_strict: memory is not bound to the rank's NUMA node here (its CPUs are); it is "
                   "allocated where it is first touched, as with --ft-numa-bind-strict false")
    return out


def bind(pid: int, local_rank: int, env=os.environ, root: str = NODE_ROOT) -> Optional[Set[int]]:
    """Put every thread of `pid` on the CPUs of local rank `local_rank`'s NUMA node; the CPUs, or None."""
    per = gpus_per_numa(env)
    if per is None:
        return None
    cpus = node_cpus(local_rank // per, root)
    if cpus is None:
        return None
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:   # the thread ended meanwhile, or the CPUs are not ours (a cgroup)
            pass
    return cpus
