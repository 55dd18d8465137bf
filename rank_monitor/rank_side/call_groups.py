"""The process groups of one call of `ft.restartable`: held by the wrapper until torch's threads
have settled, so that no group is destroyed while one of its worker threads waits for the GIL.

Why: a ProcessGroupGloo's destructor joins its worker threads, in whichever thread drops the last
reference, with the GIL held when Python drops it. A worker that has just completed a collective
may still hold its work (an all_gather_object's AsyncAllgatherWork), and freeing that work frees
tensors whose Python objects torch keeps alive from C++: the worker asks for the GIL. If the main
thread drops the group's last reference at that moment, each waits for the other for ever (the
class of pytorch#56297; torch's PR 154976 releases the GIL where Python frees a group, not where a
DDP Reducer does). That is what happens when a training function returns after its closing
all_gather_object and destroy_process_group(): destroy_process_group unregisters the group, DDP's
Reducer (a local of the function) keeps the last reference, and the function's frame drops it.
Seen on ranks restarted in place only, twice in about 30 live acceptance runs; the frame's end is
the same in a fresh process, so it is a race any rank can lose, and this closes it for all of them.

What it does: while the wrapper runs the function, torch's registry of groups
(`distributed_c10d._pg_map`, every group torch makes is entered there) keeps a reference to each
group registered in the call (`hold`, once per call). When the call ends (it returned, or raised
for a restart), `release` sleeps with the GIL released until no other thread is busy
(rank_side.exit_settle.settle: a worker waiting for the GIL gets it and finishes), then drops the
references: a group whose last holder was a freed Reducer is destroyed there, its workers idle.
A group the training code destroyed is let go at the next group's registration (its teardown is
then torch's own, as without us), so a loop that makes groups per epoch holds none for long.
Without torch.distributed imported at the call's start nothing is held (the next call holds).
"""
from __future__ import annotations

from typing import List

from ft_launcher.rank_monitor.rank_side import dist_patch, exit_settle

RELEASE_SETTLE_S = 1.0   # at most this long the GIL is released before the references go

_held: List[object] = []


class _Registry(dict):
    """torch's `_pg_map` that also holds each group entered into it (see the module docstring)."""

    def __setitem__(self, pg, value) -> None:
        if _held:   # groups the training code destroyed meanwhile: torch's to tear down, as without us
            _held[:] = [g for g in _held if dict.__contains__(self, g)]
        _held.append(pg)
        super().__setitem__(pg, value)


def hold() -> bool:
    """Hold every group registered from now on (and those registered already); True if it does."""
    registry = dist_patch.swap_group_registry(_Registry)
    if registry is None:
        return False
    _held.extend(g for g in registry if g not in _held)
    return True


def release(settle_for: float = RELEASE_SETTLE_S) -> int:
    """The call ended: let torch's threads finish with Python, then drop the held groups; how many
    were held."""
    count = len(_held)
    if count:
        exit_settle.settle(settle_for)
        del _held[:]
    return count
