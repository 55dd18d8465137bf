"""GPU memory after a kill: before this node's ranks are started again (cold or warm), wait until
NVML no longer lists the previous cycle's rank processes on any GPU, with a bound.

A rank killed by SIGKILL is gone from the process table at once, but the driver frees its GPU
memory (and NVML stops listing it) a little later; a rank started in between can run out of memory
on that GPU. `wait_released` waits for the driver, at most `RELEASE_WAIT` seconds; the agent's
health check (agent.health_checks) fails the node for a GPU that still holds a dead rank's
process after that. Without NVML (no driver, no `pynvml`: a CPU node) it returns at once.
NVML lists processes by their pid in the host's namespace: inside a container whose pids differ,
a dead rank is never seen there, and the wait ends at once.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, Iterable, Optional, Set

RELEASE_WAIT = 10.0     # seconds
POLL = 0.05

Query = Callable[[], Dict[int, Set[int]]]   # -> {GPU index: pids NVML lists on it}


def nvml_query() -> Optional[Query]:
    """NVML's view of the GPUs' processes, or None where NVML is not available."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - ImportError, NVMLError: no NVML here
        return None

    def query() -> Dict[int, Set[int]]:
        out: Dict[int, Set[int]] = {}
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            pids: Set[int] = set()
            for lister in (pynvml.nvmlDeviceGetComputeRunningProcesses,
                           getattr(pynvml, "nvmlDeviceGetGraphicsRunningProcesses", None)):
                if lister is None:
                    continue
                try:
                    pids.update(p.pid for p in lister(handle))
                except pynvml.NVMLError:
                    pass
            out[index] = pids
        return out

    return query


def wait_released(pids: Iterable[int], query: Optional[Query], timeout: float = RELEASE_WAIT,
                  poll: float = POLL) -> Dict[int, Set[int]]:
    """Wait until no GPU lists any of `pids`; -> {GPU index: pids still listed} ({} when released).
    `query` None (no NVML) or no pids: {} at once."""
    wanted = set(pids)
    if query is None or not wanted:
        return {}
    deadline = time.monotonic() + timeout
    while True:
        try:
            held = {gpu: listed & wanted for gpu, listed in query().items() if listed & wanted}
        except Exception:  # noqa: BLE001 - a query that fails says nothing about the dead ranks
            return {}
        if not held or time.monotonic() >= deadline:
            return held
        time.sleep(poll)


def describe(held: Dict[int, Set[int]], waited: float) -> str:
    return "; ".join(f"GPU {gpu} still holds the memory of dead rank process(es) "
                     f"{', '.join(map(str, sorted(pids)))} after {waited:g}s" for gpu, pids in sorted(held.items()))
