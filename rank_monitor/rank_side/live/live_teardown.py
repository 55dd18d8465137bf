"""The ends a rank with live state meets, and what ends first at each: this cycle's buddy exchange
in flight (rank_side.live.buddy_copy), whose thread waits inside torch, and, at the script's own
destroy_process_group, the replicas' last comparison (end_fingerprint).

- a restart's teardown (rank_side.inprocess): `teardown_buddy`, the exchange abandoned;
- the script's `destroy_process_group()` (rank_side.dist_patch's wrap, `drain_before_destroy`):
  the replicas compare once more, then the exchange ends (a group destroyed under it aborts the
  process);
- the rank's end (rank_side.exit_settle, `drain_at_exit`), for a script that never destroys its
  process group: the exchange in flight, and any a restart left running, end first.
"""
from __future__ import annotations

import sys

from ft_launcher.rank_monitor.rank_side import dist_patch
from ft_launcher.rank_monitor.rank_side.live import buddy_copy, end_fingerprint
from ft_launcher.rank_monitor.rank_side.live.live_registry import REG

EXIT_JOIN_S = 10.0   # seconds the rank's end waits for a buddy exchange still in flight


def drain_before_destroy() -> None:
    """The script's own `destroy_process_group()` (at its end) first compares the replicas once more
    (end_fingerprint, when guarded) and waits for the buddy exchange in flight: a group destroyed
    under it aborts the process. (A restart's teardown calls the unwrapped one.) The wrap is
    rank_side.dist_patch's."""
    dist_patch.before_destroy("live_state.end", _before_destroy)


def _before_destroy() -> None:
    try:   # the replicas' last comparison (a flip within the fingerprint's last period)
        end_fingerprint.compare()
    except Exception as exc:  # noqa: BLE001 - the script's end goes on
        print(f"ft_launcher: the replicas' last comparison failed: {exc!r}", file=sys.stderr, flush=True)
    teardown_buddy(join_for=60.0)


def drain_at_exit() -> None:
    """The rank's end (rank_side.exit_settle), for a script that never destroys its process group:
    the buddy exchange in flight, and any a restart left running, end first. Their threads wait
    inside torch with the GIL released; one that returned while the interpreter finalizes would
    abort the process."""
    teardown_buddy(join_for=EXIT_JOIN_S)
    buddy_copy.join_left(EXIT_JOIN_S)


def teardown_buddy(join_for: float = 0.0) -> None:
    """A restart's teardown (rank_side.inprocess): the buddy exchange in flight is abandoned (its
    peers' connections are shut down; at most `join_for` s waited for its thread)."""
    if REG.buddy is not None:
        REG.buddy.close(join_for)
        REG.buddy = None
