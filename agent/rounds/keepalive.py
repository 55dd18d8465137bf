"""Reading keep-alive counters: each agent's watcher adds 1 to its `alive/<node_id>` counter every
keep_alive_interval; a node whose counter has not moved for longer than the limit (by default
keep_alive_interval * keep_alive_max_attempt) counts as silent. Used by the round watcher (the
peers it watches), the restart round's liveness check and a parked store host."""
from __future__ import annotations

from typing import Any, Dict, Tuple


class SilenceWatch:
    """Which nodes' counters have stood still for more than `limit` seconds. A counter is
    judged from the first value seen; one never seen (None) is never judged silent."""

    def __init__(self, limit: float):
        self.limit = limit
        self._seen: Dict[str, Tuple[Any, float]] = {}

    def silent(self, node_id: str, count: Any, now: float) -> bool:
        last, since = self._seen.get(node_id, (None, now))
        if count != last:
            self._seen[node_id] = (count, now)
            return False
        return now - since > self.limit
