"""The step exchange of `LiveState.restore` (steps 2 and 3, rank_side.live.live_state): each rank's
row (`Row`, int64 words: what it offers, what it needs), and the plan made from every rank's rows
and the buddy copies' offers (`plan_from_rows`: live_plan.plan_recovery, and when there is no resume
step, the true reason in words, `ranks_text` naming the ranks).
"""
from __future__ import annotations

import collections
from typing import List, Optional

from ft_launcher.rank_monitor.rank_side.live import buddy_copy
from ft_launcher.rank_monitor.rank_side.live import live_wire as W
from ft_launcher.rank_monitor.rank_side.live.live_plan import Need, Offer, Plan, plan_recovery
from ft_launcher.rank_monitor.rank_side.live.live_registry import REG, Held

NOT_HELD = -1

# Why a rank offers nothing in the step exchange (column STATUS of Row).
HOLDS, NEW, NONE, SUSPECT, REFUSED = 0, 1, 2, 3, 4
STATUS_WORDS = {NEW: ("is a new process", "are new processes"),
                NONE: ("held no state under this name", "held no state under this name"),
                SUSPECT: ("holds suspect state (an exception left its training function or commit)",
                          "hold suspect state (an exception left their training function or commit)"),
                REFUSED: ("refused the state at its first commit (see that line)",
                          "refused the state at their first commit (see that line)")}


class Row:
    """One rank's line of the step exchange (int64 words): what it offers and what it needs."""

    K = 16   # per-object layout digests carried (for the line that names the object that differs)
    (STATUS, STEP, RAW, OFFER_ID, OFFER_LAYOUT, OFFER_WORLD, NEED_ID, NEED_LAYOUT, NAMES, REFUSED_NOW,
     RANK0_BUFFERS, FAILED) = range(12)
    H = 12
    SIZE = H + 2 * K

    def __init__(self, values: list) -> None:
        self.values = [int(v) for v in values]

    @classmethod
    def mine(cls, live, held: Optional[Held], now: Optional[dict], failed: bool = False) -> "Row":
        v = [0] * cls.SIZE
        status = HOLDS
        if held is None:
            status = REFUSED if live.name in REG.refused else NEW if REG.calls <= 1 else NONE
        elif held.dirty or REG.suspect:
            status = SUSPECT
        v[cls.STATUS] = status
        v[cls.RAW] = held.step if held is not None else NOT_HELD
        v[cls.STEP] = held.step if status == HOLDS else NOT_HELD
        if status == HOLDS:
            made = held.live._describe()
            v[cls.OFFER_ID], v[cls.OFFER_LAYOUT], v[cls.OFFER_WORLD] = made["identity"], made["layout"], made["world"]
            for i, d in enumerate(list(made["objects"].values())[:cls.K]):
                v[cls.H + cls.K + i] = d
        v[cls.NAMES] = W.digest64(sorted(live.tracked))
        if failed:   # reading its new objects failed (its words come by broadcast: LiveState._failed_reason)
            v[cls.FAILED] = 1
            return cls(v)
        if now is None:   # its state was refused just now
            v[cls.REFUSED_NOW] = 1
            return cls(v)
        v[cls.NEED_ID], v[cls.NEED_LAYOUT] = now["identity"], now["layout"]
        v[cls.RANK0_BUFFERS] = int(bool(now["rank0_buffers"]))
        for i, d in enumerate(list(now["objects"].values())[:cls.K]):
            v[cls.H + i] = d
        return cls(v)

    def __getattr__(self, key):
        return self.values[getattr(Row, key.upper())]

    def need_objects(self) -> list:
        return self.values[self.H:self.H + self.K]

    def offer_objects(self) -> list:
        return self.values[self.H + self.K:]


def plan_from_rows(live, rows: List[Row], world: int, copies: Optional[list] = None):
    """The plan from the exchanged rows (and the buddy copies' offers), and the true reason when
    there is no resume step."""
    names = sorted(live.tracked)
    odd = [r for r, row in enumerate(rows) if row.names != rows[0].names]
    if odd:
        return no_plan(world), (f"LiveState '{live.name}' holds other objects on {ranks_text(odd)} than "
                                f"on rank 0 (here: {', '.join(names)})")
    refused = [r for r, row in enumerate(rows) if row.refused_now]
    if refused:
        return no_plan(world), (f"LiveState '{live.name}' was refused on {ranks_text(refused)}: "
                                f"{live.refused or 'see the line above'}")
    # offers made under another world size count: the identity says whether the shard is the same
    offers = [Offer(r, row.step, row.offer_id, row.offer_layout) for r, row in enumerate(rows)
              if row.status == HOLDS] + list(copies or [])
    other_world = sorted({row.offer_world for row in rows if row.status == HOLDS and row.offer_world != world})
    plan = plan_recovery(offers, [Need(row.need_id, row.need_layout) for row in rows])
    if plan.resume is not None and rows[0].rank0_buffers and not plan.kept(0):
        modules = ", ".join(f"'{n}'" for n in live._describe()["rank0_buffers"])
        return no_plan(world), (
            f"LiveState '{live.name}': rank 0 would heal, but {modules} holds BatchNorm running statistics that each "
            f"rank updates from its own batch and DDP broadcasts from rank 0 at the next step: rank 0's exist nowhere "
            f"else (SyncBatchNorm keeps them equal on every rank)")
    if plan.resume is not None:
        return plan, ""
    lost = buddy_copy.unmet_text([Need(row.need_id, row.need_layout) for row in rows], offers, ranks_text) \
        if copies else ""
    if lost:
        return plan, f"LiveState '{live.name}': {lost}"
    if other_world and "no rank holds the shard" in plan.reason:
        return plan, (f"the world size changed ({'/'.join(map(str, other_world))} -> {world}) since the live state "
                      f"'{live.name}' was committed, and the shards with it: {plan.reason}; this rank's shard: "
                      f"{live._describe()['identity_text']}")
    if not offers:
        by_status = collections.defaultdict(list)
        for r, row in enumerate(rows):
            by_status[row.status].append(r)
        parts = [f"{ranks_text(rs)} {STATUS_WORDS[s][len(rs) > 1]}" for s, rs in sorted(by_status.items())]
        return plan, f"no rank holds live state '{live.name}': " + "; ".join(parts)
    reason = plan.reason
    if "another layout" in reason:
        differ = [names[i] for i in range(min(len(names), Row.K))
                  if len({row.need_objects()[i] for row in rows} | {row.offer_objects()[i] for row in rows
                                                                   if row.status == HOLDS}) > 1]
        if differ:
            reason += f" ({', '.join(differ)} differ{'s' if len(differ) == 1 else ''})"
    elif "different shard" in reason or "no rank holds the shard" in reason:
        reason += f"; this rank's shard: {live._describe()['identity_text']}"
    return plan, f"LiveState '{live.name}': {reason}"


def no_plan(world: int, reason: str = "") -> Plan:
    """No resume step: every rank loads its checkpoint."""
    return Plan(None, [None] * world, reason)


def ranks_text(ranks) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
