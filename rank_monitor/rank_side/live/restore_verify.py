"""The restore's check, after the state arrived (step 6 of `LiveState.restore`,
rank_side.live.live_state): per object a digest of the restored state, and the replicas of each
shard in which some rank healed from a peer must agree (`verify`, one all_gather that also carries
whether the restore failed on some rank). And the two small collectives the restore's steps share:
`all_gather` of one int64 row per rank, and `broadcast_text` of one rank's words (the lowest
failing rank's, for the fallback's one line).
"""
from __future__ import annotations

import collections
import time
from typing import Any, Dict, List

from ft_launcher.rank_monitor.rank_side.live import live_rng
from ft_launcher.rank_monitor.rank_side.live import live_wire as W
from ft_launcher.rank_monitor.rank_side.live.live_plan import Plan
from ft_launcher.rank_monitor.rank_side.live.restore_transfer import failure
from ft_launcher.rank_monitor.rank_side.live.step_exchange import Row, ranks_text

TEXT_BYTES = 512


def broadcast_text(mine: str, src: int, device) -> str:
    """Rank `src`'s words (at most TEXT_BYTES of UTF-8) on every rank: a collective."""
    import torch
    import torch.distributed as dist

    buf = torch.zeros(TEXT_BYTES, dtype=torch.uint8)
    if dist.get_rank() == src:
        raw = mine.encode()[:TEXT_BYTES]
        buf[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    buf = buf.to(device)
    dist.broadcast(buf, src)
    return bytes(buf.cpu().tolist()).rstrip(b"\0").decode(errors="replace") or "(it said nothing)"


def verify(live, plan: Plan, rows: List[Row], ready: Dict[str, Any], names: List[str], device,
           world: int, failed: str = ""):
    """Step 6: per object, a digest of the restored state; the replicas of each shard in which some
    rank healed from a peer must agree; and whether the restore failed on some rank so far
    (`failed`: this rank's words). -> (the check's figures, the reason to fall back or "", the
    ranks on which it failed, this rank's words of what failed)."""
    import torch

    t0 = time.perf_counter()
    digests, nbytes = [], 0
    if not failed:
        try:
            for n in names:
                d, b = W.digest(live.tracked[n].comparable(ready[n]))
                digests.append(d)
                nbytes += b
        except Exception as exc:  # noqa: BLE001 - whatever the state holds: the checkpoint, said
            failed, digests = failure(n, "the digest of the state", exc), []
    own_s = time.perf_counter() - t0
    k = Row.K
    mine = (digests + [0] * k)[:k] + [nbytes, int(own_s * 1e9), int(bool(failed))]
    table = all_gather(torch.tensor(mine, dtype=torch.int64, device=device), world)
    failing = [r for r, row in enumerate(table) if row[k + 2]]
    groups = collections.defaultdict(list)
    for r, row in enumerate(rows):
        groups[(row.need_id, row.need_layout)].append(r)
    reason = ""
    for members in (groups.values() if not failing else ()):
        if all(plan.kept(r) for r in members):
            continue   # every rank of this shard restored its own committed state: nothing came from a peer
        for i, n in enumerate(names[:k]):
            if n in live.per_rank:
                continue   # this rank's own part (a loader's position): replicas differ in it
            values = collections.defaultdict(list)
            for r in members:
                values[table[r][i]].append(r)
            if len(values) > 1:
                split = " vs ".join(ranks_text(rs) for rs in sorted(values.values()))
                hint = (" (per-rank random streams: with rng=False a healed rank draws its own)"
                        if n == live_rng.NAME else "")
                reason = (f"after the live recovery of '{live.name}', the replicas of one shard differ in '{n}' "
                          f"({split}){hint}")
                break
        if reason:
            break
    slowest = max(int(row[k + 1]) for row in table) / 1e9
    total = sum(int(row[k]) for row in table)
    check = {"bytes": total, "s": round(slowest, 6),
             "ms_per_gb": round(slowest * 1e3 / max(1e-9, max(int(row[k]) for row in table) / 1e9), 1)}
    return check, reason, failing, failed


def all_gather(t, world: int) -> list:
    """Every rank's row (one int64 tensor each), as lists, on every rank: a collective."""
    import torch
    import torch.distributed as dist

    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t)
    return [o.cpu().tolist() for o in out]
