"""The last rung of the ladder: stopping the job for good, and taking one node out of it.

A job stops without a restart when a rank asks (ShutdownWorkload), when it has made no progress
for `max_no_progress_cycles` cycles (agent.recovery.progress), or when a node leaves and too few can remain.
The round's verdict (agent.recovery.restart_policy) is then of kind `stop` (first writer wins, as for any verdict)
and every agent exits with `no_restart_exit_code` (93, NVRx's), saying why in one line, so that
the scheduler does not requeue the job. Running out of restarts is a failure and stays exit 1.

A node leaves (a rank's ExcludeThisNode request, a failed health check) by marking itself in the
store (`excluded/<node_id>`, and the job-wide `excluded` counter): the others restart without it
(a hot spare takes its place). If the job can no longer reach its minimum node count
(`max nodes - excluded < min nodes`, the restart policy's `too_few_left`), it stops as above. The node that hosts the store cannot take
it away: it leaves training but keeps serving the store (parked) until every other agent is gone.
"""
from __future__ import annotations

from typing import Callable, Optional

from ft_launcher.agent.rounds import store_keys
from ft_launcher.agent.rounds.round_types import NoRestart  # noqa: F401 - this rung's exception


def mark_excluded(proto, node_id: str) -> int:
    """Record that `node_id` leaves the job; returns how many nodes have left."""
    if proto.exists(store_keys.excluded_node(node_id)):
        return proto.count(store_keys.excluded())
    proto.put(store_keys.excluded_node(node_id), "1")
    return proto.count(store_keys.excluded(), 1)


def is_excluded(proto, node_id: str) -> bool:
    return proto.exists(store_keys.excluded_node(node_id))


def park_store_host(proto, store, me_id: str, silent_limit: float, stop: Callable[[], Optional[int]],
                    give_up: float) -> None:
    """An excluded node that hosts the store keeps it up until no other agent of the last two
    rounds is alive any more (its liveness port, agent.rounds.keepalive, refuses, or has not
    answered over a window: Misses) or `give_up` s have passed. Ends early (returns) on a signal.
    `silent_limit`: seconds between looks."""
    from ft_launcher.agent.rounds.keepalive import Misses

    misses = Misses.of(proto.cfg, within=0.5)

    def everyone_gone() -> bool:
        try:
            number = int(proto.get(store_keys.next_round()))
            nodes = {}
            for k in (number, number - 1):
                if k >= 0:
                    nodes.update({n.node_id: n for n in proto._nodes(k)})
        except Exception:  # noqa: BLE001 - nobody left to serve
            return True
        others = [n for i, n in nodes.items() if i != me_id and n.alive_port]
        return bool(others) and all([misses.gone(n.host, n.alive_port) for n in others])

    store.linger(everyone_gone, give_up, stop=lambda: bool(stop()), poll=min(silent_limit, 1.0))
