"""Elastic's room: `--elastic --nnodes MIN:MAX`, torchrun's meaning (up to MAX nodes train, the job
goes on down to MIN at once and grows back), and every rule that follows from it. The other modules
ask `Elastic` (one per job: `Elastic.of(cfg)`); none of them reads the flag itself
(tests/house/test_agent_layers.py holds it). Without `--elastic`, MIN train and the other nodes wait as
hot spares (NVRx's meaning).

- **MIN/MAX**: how many nodes train (`trainers`) and how many a round needs before it closes
  (`needed`); the flag's check and its words (`check_flag`, `words`).
- **Shrink**: a restart round closes on the nodes there once every one still missing is dead
  (agent.rounds.rendezvous asks `closes_on_the_living`); a node that must leave with no hot spare
  (an exit 16 or 17, agent.recovery.rerun_exits) is dropped while MIN remain (`drops`,
  `too_few_words`, `dropped_words`).
- **The spare's wait, and grow**: a node that joined a job training on fewer than MAX nodes asks
  the job to re-form with it once its warm reserves are ready (`grow_deadline`, `grow_report`:
  the policy's kind `grow`).
- **Resize**: the round trains on fewer (or again more) nodes than the previous one: one line on
  node 0 (`resized`, event `elastic_resize`).
"""
from __future__ import annotations

import sys
import time
from typing import Optional, Tuple

from ft_launcher.agent.rounds import store_keys
from ft_launcher.agent.rounds.round_types import NAMED_UP_TO


def check_flag(on: bool, ft, min_nodes: int, max_nodes: int) -> Optional[str]:
    """--elastic needs --nnodes MIN:MAX with MIN < MAX (the fewest nodes the job goes on with), and
    chooses the training nodes itself (no active_world_size, no --ft-segment); without it, a
    MIN:MAX gets one note saying it means hot spares (NVRx's meaning, not torchrun's). The usage
    error's words, or None."""
    if not on:
        if min_nodes < max_nodes:
            print(f"ft_launcher: note: --nnodes {min_nodes}:{max_nodes}: {min_nodes} node(s) train and the others "
                  f"wait as hot spares (NVRx's meaning); for torchrun's (up to {max_nodes} train, the job goes on "
                  f"with as few as {min_nodes}) add --elastic", file=sys.stderr)
        return None
    if min_nodes >= max_nodes:
        return (f"--elastic needs --nnodes MIN:MAX with MIN < MAX (the fewest nodes the job goes on with), "
                f"got {min_nodes}:{max_nodes}")
    if ft.active_world_size is not None or ft.segment:
        return ("--elastic chooses the training nodes itself: it cannot be combined with "
                + ("active_world_size" if ft.active_world_size is not None else "--ft-segment"))
    return None


ENV_ELASTIC = "FT_LAUNCHER_ELASTIC"


class Elastic:
    """The job's size rules: `on` with --elastic; MIN and MAX from --nnodes."""

    def __init__(self, min_nodes: int, max_nodes: int, on: bool = False):
        self.min_nodes, self.max_nodes, self.on = min_nodes, max_nodes, bool(on)
        self._trained_on: Optional[tuple] = None   # the last cycle's (world size, nodes, {node id: label})

    @classmethod
    def of(cls, cfg) -> "Elastic":
        """The job's rules from its launch config (agent.launch_config)."""
        return cls(cfg.min_nodes, cfg.max_nodes, cfg.elastic)

    def rank_env(self) -> dict:
        """What a rank is told of it: FT_LAUNCHER_ELASTIC=1 under --elastic (its world may shrink and
        grow back; ft_launcher.integrations.torchtitan reads it), nothing without."""
        return {ENV_ELASTIC: "1"} if self.on else {}

    # ---- MIN/MAX ----------------------------------------------------------------------------
    def words(self) -> str:
        """The start line's words for it ('' without --elastic)."""
        return f" elastic (up to {self.max_nodes} train, down to {self.min_nodes} go on)" if self.on else ""

    def trainers(self, fixed: int) -> int:
        """How many nodes train in a round: up to MAX, else `fixed` (MIN, or active_world_size's)."""
        return self.max_nodes if self.on else fixed

    def needed(self, trainers: int) -> int:
        """How many nodes a round needs before it may close: MIN (a round closes on fewer than MAX
        after the last call, or once the missing are dead), else the training nodes."""
        return self.min_nodes if self.on else trainers

    # ---- shrink ------------------------------------------------------------------------------
    def closes_on_the_living(self, target: Optional[int]) -> bool:
        """A restart round (expecting `target` nodes back) closes on those there once the missing are dead."""
        return self.on and bool(target)

    def too_few_to_go_on(self, alive: int, need: int) -> str:
        """The line of a restart round with fewer nodes alive than it needs: the job exits 1."""
        return (f"elastic: the job cannot go on: {alive} node{'s' if alive != 1 else ''} left, fewer than the "
                f"{need} --nnodes {self.min_nodes}:{self.max_nodes} needs (no hot spare left) -> exiting 1")

    def drops(self, left: int) -> bool:
        """A node that must leave with no spare is dropped (the job goes on with `left` nodes)."""
        return self.on and left >= self.min_nodes

    def too_few_words(self, left: int) -> str:
        """Why dropping a node cannot keep the job going ('' for a job of fixed size)."""
        if not self.on:
            return ""
        return (f", and without it {left} node{'s' if left != 1 else ''} would remain, fewer than the "
                f"{self.min_nodes} of --elastic --nnodes {self.min_nodes}:{self.max_nodes}")

    def dropped_words(self, left: int) -> str:
        """The words of a node dropped under --elastic."""
        return (f"dropped (--elastic, no hot spare): the job goes on with {left} node{'s' if left != 1 else ''} "
                f"(--nnodes {self.min_nodes}:{self.max_nodes})")

    # ---- the spare's wait, and grow ---------------------------------------------------------------
    def grow_deadline(self, rnd, warm_reserve_timeout: float) -> Optional[float]:
        """A spare of round `rnd` that joined late while the job trains on fewer than MAX nodes asks
        it to grow once its warm reserves are ready, at the latest at this monotonic time; None: it
        waits to be needed."""
        if self.on and rnd.late and rnd.nnodes < self.max_nodes:
            return time.monotonic() + warm_reserve_timeout
        return None

    def grow_report(self, rnd, label: str, node_id: str) -> dict:
        """The report of kind `grow` (agent.recovery.restart_policy) that re-forms the job with this node."""
        what = (f"node {label} joined: the job grows from {rnd.nnodes} to "
                f"{min(self.max_nodes, rnd.nnodes + 1)} nodes")
        return {"kind": "grow", "what": what, "node_id": node_id}

    # ---- resize -------------------------------------------------------------------------------
    def resized(self, rnd, get_raw) -> Optional[Tuple[str, dict]]:
        """The round trains on fewer (or again more) nodes than the previous one: the line on node 0
        (`elastic_resize`) saying what changed for the training (TorchFT's rule: the global batch
        shrinks with the replicas, the learning rate stays; docs/migrating-from-torchrun.md), and
        its fields; None: nothing to say. `get_raw`: the round protocol's read of several keys."""
        before, self._trained_on = self._trained_on, (rnd.world_size, rnd.nnodes,
                                                      {n.node_id: n.label() for n in rnd.active}
                                                      if self.on and rnd.members <= NAMED_UP_TO else {})
        if not self.on or before is None or before[0] == rnd.world_size or rnd.group_rank != 0:
            return None
        world, nodes, names = before
        gone = [node_id for node_id in names if node_id not in self._trained_on[2]]
        came = [label for node_id, label in self._trained_on[2].items() if node_id not in names]
        # a node that left the job (excluded: an exit 17 or 16 under --elastic, ExcludeThisNode) was dropped, not lost
        out = get_raw([store_keys.excluded_node(n) for n in gone]) if rnd.world_size < world else []
        lost = [names[n] for n, mark in zip(gone, out) if not mark]
        dropped = [names[n] for n, mark in zip(gone, out) if mark]
        if rnd.world_size < world:
            why = "; ".join(f"node{'s' if len(labels) > 1 else ''} {', '.join(labels)} {how}"
                            for how, labels in (("lost", lost), ("dropped", dropped)) if labels) or "nodes lost"
            why += ", no spare"
        else:
            why = f"node{'s' if len(came) > 1 else ''} {', '.join(came)} joined"
        line = (f"training on {rnd.nnodes} of {self.max_nodes} nodes, world size {rnd.world_size} instead of "
                f"{world}: the global batch is {rnd.world_size}/{world} of the previous one, the learning rate as "
                f"it was ({why})")
        return line, dict(world_size=rnd.world_size, previous_world_size=world, nnodes=rnd.nnodes,
                          previous_nnodes=nodes, lost=lost, dropped=dropped, joined=came)
