"""GPU memory after a kill: before this node's ranks are started again (cold or warm), wait until
NVML no longer lists the previous cycle's rank processes on any GPU, with a bound.

A rank killed by SIGKILL is gone from the process table at once, but the driver frees its GPU
memory (and NVML stops listing it) a little later; a rank started in between can run out of memory
on that GPU. `wait_released` waits for the driver, at most `RELEASE_WAIT` seconds (NVRx 0.7's
`gpu_memory_reclaim_timeout`), looking every `gpu_memory_poll_interval` seconds; a dead rank's
process still listed with at most `gpu_memory_tolerance_mb` MB counts as gone. The agent's
health check (agent.recovery.health_checks) fails the node for a GPU that still holds a dead rank's
process after that. Without NVML (no driver, no `pynvml`: a CPU node) it returns at once.
NVML lists processes by their pid in the host's namespace: inside a container whose pids differ,
a dead rank is never seen there, and the wait ends at once.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, Iterable, Optional, Set

RELEASE_WAIT = 10.0     # seconds
POLL = 0.05

# -> {GPU index: pids NVML lists on it}, as a set or as {pid: MB used (None: unknown)}
Query = Callable[[], Dict[int, object]]


def nvml_query() -> Optional[Query]:
    """NVML's view of the GPUs' processes, or None where NVML is not available."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - ImportError, NVMLError: no NVML here
        return None

    def query() -> Dict[int, Dict[int, Optional[float]]]:
        out: Dict[int, Dict[int, Optional[float]]] = {}
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            pids: Dict[int, Optional[float]] = {}
            for lister in (pynvml.nvmlDeviceGetComputeRunningProcesses,
                           getattr(pynvml, "nvmlDeviceGetGraphicsRunningProcesses", None)):
                if lister is None:
                    continue
                try:
                    for p in lister(handle):
                        used = getattr(p, "usedGpuMemory", None)
                        pids[p.pid] = None if used is None else used / (1 << 20)
                except pynvml.NVMLError:
                    pass
            out[index] = pids
        return out

    return query


def _holding(listed, wanted: Set[int], tolerance_mb: float) -> Set[int]:
    """The wanted pids a GPU lists with more than tolerance_mb MB (unknown use: held)."""
    if not isinstance(listed, dict):
        return set(listed) & wanted
    return {pid for pid, mb in listed.items() if pid in wanted and (mb is None or mb > tolerance_mb)}


def wait_released(pids: Iterable[int], query: Optional[Query], timeout: float = RELEASE_WAIT,
                  poll: float = POLL, tolerance_mb: float = 0.0) -> Dict[int, Set[int]]:
    """Wait until no GPU lists any of `pids` with more than `tolerance_mb` MB; -> {GPU index:
    pids still holding memory} ({} when released). `query` None (no NVML) or no pids: {} at once."""
    wanted = set(pids)
    if query is None or not wanted:
        return {}
    deadline = time.monotonic() + timeout
    while True:
        try:
            held = {gpu: hold for gpu, hold in ((g, _holding(listed, wanted, tolerance_mb))
                                                for g, listed in query().items()) if hold}
        except Exception:  # noqa: BLE001 - a query that fails says nothing about the dead ranks
            return {}
        if not held or time.monotonic() >= deadline:
            return held
        time.sleep(poll)


def describe(held: Dict[int, Set[int]], waited: float) -> str:
    return "; ".join(f"GPU {gpu} still holds the memory of dead rank process(es) "
                     f"{', '.join(map(str, sorted(pids)))} after {waited:g}s" for gpu, pids in sorted(held.items()))
