"""Per-rank records: the state of a LiveState's per-rank objects (`per_rank=`), kept in this node's
host memory at every commit, so a rank replaced on its node heals its replicated state from a
replica and its own part (a loader's position in its part of the data) from here.

Under HSDP (or any data parallelism over sharded replicas) a rank's model and optimizer shard has
replicas, but its loader position is its data-parallel rank's alone: no peer holds it. The objects
named in `LiveState(per_rank={name: k})` are therefore (rank_side.live.live_state):
- left out of the state's shard identity and layout (the rest, model and optimizer, keep the
  identity their DTensors give: a replica is a source) and never compared between replicas;
- written at the end of each commit (after the step counts on the CPU) into one of two record files
  of this local rank's slot, `<prefix>_rec0` / `_rec1` (the step's parity picks it; the other keeps
  the step before), beside the buddy slots in the agent's 0700 directory (rank_monitor.buddy_store:
  the same files, the same trust checks, the same WRITING/COMPLETE marks, so a record torn by a
  death in the middle is none), tagged with the step, the per-rank identity (the world size and
  the `k`s) and the per-rank objects' layout;
- after a heal from anything but the rank's own state (a peer, a buddy's copy), read back from the
  record of exactly the resume step, identity and layout (`read`); none there (the node was lost,
  the rank died inside the commit that the survivors completed, the world size changed) is a
  fallback to the checkpoint on every rank with one line, never a replica's position.
A fallback abandons the records (`abandon`), as it does the buddy copies: a record of the
timeline the checkpoint replaced is never read.

Cost per commit: the per-rank objects' state as a peer would be sent it (live_wire), written into
a mapped file: a loader's position is kilobytes. Memory: two record files per rank, each a 4 KiB
header and 1 MiB of payload at least (buddy_store.file_bytes).
"""
from __future__ import annotations

import os
from typing import Dict, Optional, Tuple

from ft_launcher.rank_monitor import buddy_store as S
from ft_launcher.rank_monitor.rank_side.live import buddy_copy

RECORD_NAMES = ("rec0", "rec1")


class RankRecord:
    """This local rank slot's two record files (module docstring)."""

    def __init__(self, prefix: str) -> None:
        where = os.path.dirname(prefix) or "."
        try:
            self.refused = S.trusted(os.lstat(where), "directory")
        except OSError as exc:
            self.refused = exc.strerror or str(exc)
        self.prefix = prefix
        self.slots = [S.Slot(f"{prefix}_{name}", self.refused) for name in RECORD_NAMES]
        self.borrowed: list = []   # another local slot's record files, opened by find (closed with these)
        self.bytes = 0

    def write(self, states: Dict[str, dict], step: int, identity: int, layout: int, world: int, rank: int,
              cycle: int) -> int:
        """The per-rank objects' committed `states` as of `step`, complete when this returns."""
        self.bytes = buddy_copy.write_snapshot(self.slots[step % 2], states, step, identity, layout, world, rank,
                                               cycle)
        return self.bytes

    def find(self, step: int, identity: int, layout: int) -> Tuple[Optional[S.Slot], str]:
        """The record of `step` with that identity and layout, else (None, why not: words). Its own
        local slot's files first, then the node's other slots' (a rank that moved to another slot of
        its node, as after an exit 16's device swap, left its record in its previous slot's files:
        the identity, which holds the rank's per-rank `k`s, says whose a record is)."""
        if self.refused is not None:
            return None, f"its record directory was refused ({self.refused})"
        seen = []
        for slot in self.slots + self._others():
            if slot.words is None:
                slot._open()   # made by the rank's previous process after this one opened it
            head = slot.header()
            if head is None:
                continue
            if head["step"] == step and head["identity"] == identity and head["layout"] == layout:
                return slot, ""
            seen.append(head)
        if not seen:
            return None, "no record of it is on this node"
        steps = ", ".join(str(h["step"]) for h in sorted(seen, key=lambda h: h["step"]))
        if not any(h["step"] == step for h in seen):
            return None, f"its node holds records of step {steps} only"
        return None, f"its record of step {step} was made under another world size or layout"

    def _others(self) -> list:
        """The record files of this node's other local slots (in the same agent directory, opened
        with the same checks: buddy_store.Slot), once per call of find."""
        for slot in self.borrowed:
            slot.close()
        where, mine = os.path.dirname(self.prefix) or ".", {os.path.basename(s.path) for s in self.slots}
        try:
            names = sorted(os.listdir(where))
        except OSError:
            names = []
        self.borrowed = [S.Slot(os.path.join(where, name)) for name in names
                         if name.rsplit("_", 1)[-1] in RECORD_NAMES and name not in mine]
        return self.borrowed

    def read(self, slot: S.Slot, fresh: Dict[str, tuple], places: Optional[dict] = None) -> Dict[str, dict]:
        """The states in `slot` (buddy_copy.read_snapshot: read as from a peer, layouts checked)."""
        import torch

        return buddy_copy.read_snapshot(slot, fresh, torch.device("cpu"), places)[0]

    def abandon(self, cycle: int) -> None:
        """A fallback to the checkpoint in `cycle`: no record held is ever read."""
        for slot in self.slots:
            if slot.words is None and self.refused is None:
                slot._open()
            slot.abandon(cycle)

    def close(self) -> None:
        for slot in self.slots + self.borrowed:
            slot.close()
