"""Live recovery's plan: from what every rank offers and needs, the step the job resumes at and
where each rank's state comes from. Pure (no torch, no I/O): the step exchange of
`LiveState.restore()` (rank_monitor.rank_side.live.live_state) gathers its inputs.

- An `Offer` is a state some rank can give: its completed `step`, the shard `identity` it is of
  (which part of a sharded state, under which world size), and the `layout` of the objects it was
  made by (names, shapes, dtypes), both as digests; `holder` is the rank that sends it and `kind`
  where it holds it ("own": its committed state in its process; "slot<i>": a copy in its node's
  host memory, rank_side.live.buddy_copy: its own state's or its buddy's).
- A `Need` is what a rank's new objects take: the identity and layout it has now.
- The job resumes at the highest step at which every rank's need is met by an offer of that step
  with the same identity and layout (identity before data: a rank never loads another shard's or
  another layout's state). A rank whose own offer meets its need keeps its state; one whose host
  copy does loads it; any other receives from a matching holder, a live one first (a peer's
  process), else a copy, spread round robin over them. No such step: every rank takes
  its checkpoint, and the plan says which rank's need nothing met, and why.
"""
from __future__ import annotations

import collections
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple


class Offer(NamedTuple):
    holder: int       # the rank that sends it
    step: int         # the completed step it holds
    identity: int     # digest: which part of the state (shard, world size)
    layout: int       # digest: the objects' names, shapes and dtypes
    kind: str = "own"


class Need(NamedTuple):
    identity: int
    layout: int


class Plan(NamedTuple):
    resume: Optional[int]                 # the step the job resumes at; None: every rank's checkpoint
    sources: List[Optional[Offer]]        # per rank: the offer its state comes from (its own: kept)
    reason: str                           # why there is no resume step ("" when there is one)

    def kept(self, rank: int) -> bool:
        src = self.sources[rank]
        return src is not None and src.holder == rank and src.kind == "own"

    def transfers(self) -> List[Tuple[int, int]]:
        """(source rank, receiving rank) of the live transfers (from a process's committed state,
        not a copy) in the order every rank walks them (by receiver): each pair of ranks meets in
        the same order on both sides, so no send waits on a cycle."""
        return [(src.holder, r) for r, src in enumerate(self.sources)
                if src is not None and not self.kept(r) and src.kind == "own"]


def _ranks(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def plan_recovery(offers: Sequence[Offer], needs: Sequence[Need]) -> Plan:
    """The plan (module docstring) for len(needs) ranks."""
    n = len(needs)
    none = [None] * n
    steps = sorted({o.step for o in offers if o.step >= 0}, reverse=True)
    if not steps:
        return Plan(None, none, "no rank holds live state")
    for step in steps:
        holders: Dict[Need, List[Offer]] = collections.defaultdict(list)
        for o in offers:
            if o.step == step:
                holders[Need(o.identity, o.layout)].append(o)
        if all(holders.get(need) for need in needs):
            return Plan(step, _sources(step, holders, needs), "")
    return Plan(None, none, _why(steps[0], offers, needs))


def _sources(step: int, holders: Dict[Need, List[Offer]], needs: Sequence[Need]) -> List[Optional[Offer]]:
    sources: List[Optional[Offer]] = []
    turn: Dict[Need, int] = collections.defaultdict(int)
    for r, need in enumerate(needs):
        own = ([o for o in holders[need] if o.holder == r and o.kind == "own"]
               or [o for o in holders[need] if o.holder == r])   # kept, else its host copy
        if own:
            sources.append(own[0])
            continue
        group = [o for o in holders[need] if o.kind == "own"] or holders[need]   # a live peer first
        sources.append(group[turn[need] % len(group)])
        turn[need] += 1
    return sources


def _why(step: int, offers: Sequence[Offer], needs: Sequence[Need]) -> str:
    """Why the highest step cannot be resumed at: the first kind of unmet need, with its ranks."""
    at = [o for o in offers if o.step == step]
    met = {Need(o.identity, o.layout) for o in at}
    unmet = [r for r, need in enumerate(needs) if need not in met]
    other_layout = [r for r in unmet if any(o.identity == needs[r].identity for o in at)]
    if other_layout:
        return (f"{_ranks(other_layout)} now hold objects of another layout (names, shapes or dtypes) than the "
                f"holders of their shard at step {step}")
    identities = collections.Counter(need.identity for need in needs)
    if len(needs) > 1 and all(c == 1 for c in identities.values()):
        return (f"no rank holds the shard {_ranks(unmet)} need{'s' if len(unmet) == 1 else ''} at step {step}: "
                f"every rank's state is a different shard (sharded without replicas, e.g. FSDP without a "
                f"replicate dimension), so it cannot heal from a peer")
    return (f"no rank holds the shard {_ranks(unmet)} need{'s' if len(unmet) == 1 else ''} at step {step} "
            f"(every replica of it was lost or is behind)")
