"""The live-recovery summary: what global rank 0's `LiveState.restore()` says about a cycle's
recovery (rank_monitor.rank_side.live.live_state), as it goes through its shared-memory record to the
agent (agent.observation.live_recovery), at any world size.

    {"cycle": 3, "resume_step": 136, "steps_redone": 0, "world": 512,
     "sources": {"kept": "0-255,257-511", "peer 0": "256"},     # where each rank's state came from
     "counts": {"kept": 511, "peer": 1, "disk": 0},
     "bytes": ..., "transfer_s": ..., "restore_s": ..., "mb_per_s": ..., "reason": ...}

`sources` maps each source ("kept", "peer N", "buddy N", "host copy", "disk") to the ranks it served, as ranges
("0-3,7"): its size grows with the number of distinct sources and gaps, not with the world. When
the JSON would not fit the record's area (shm_layout.LIVE_TEXT_BYTES: tens of thousands of
fragmented ranges), the per-peer detail goes first (`sources` keeps "kept", "peer", "disk" and
`sources_elided` says what is missing), then the ranges (counts only); `counts` is always there.
"""
from __future__ import annotations

import json
from typing import Dict, Iterable, List, Optional, Sequence

from ft_launcher.rank_monitor import shm_layout as L

KEPT, PEER, BUDDY, HOST_COPY, DISK = "kept", "peer", "buddy", "host copy", "disk"
ORDER = {KEPT: 0, PEER: 1, BUDDY: 2, HOST_COPY: 3, DISK: 4}


def kind(name: str) -> str:
    """A source's kind: 'kept', 'peer' ('peer N'), 'buddy' ('buddy N': a copy rank N held in its
    node's host memory), 'host copy' (the rank's own copy on its node) or 'disk'."""
    return name if name == HOST_COPY else name.split(" ", 1)[0]


def source_name(rank: int, source: Optional[int]) -> str:
    """'disk' (no live state), 'kept' (its own memory) or 'peer N' (received from global rank N)."""
    return DISK if source is None else KEPT if source == rank else f"{PEER} {source}"


def ranges(ranks: Iterable[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    out: List[str] = []
    run: List[int] = []
    for r in sorted(set(ranks)):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [r]
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(out)


def parse_ranges(text: str) -> List[int]:
    """'0-2,5' -> [0, 1, 2, 5] (the inverse of `ranges`)."""
    out: List[int] = []
    for part in (text or "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def by_source(sources: Sequence[Optional[int]]) -> Dict[str, str]:
    """Per rank's source (its rank, a peer's rank, None: disk, or a source's name, e.g. 'buddy 3')
    -> {source name: rank ranges}."""
    groups: Dict[str, List[int]] = {}
    for rank, source in enumerate(sources):
        groups.setdefault(source if isinstance(source, str) else source_name(rank, source), []).append(rank)
    return {name: ranges(ranks) for name, ranks in sorted(groups.items(), key=source_order)}


def source_order(item) -> tuple:
    """Sort key of a (source name, ranges) item: kept, then peers by rank, then disk."""
    name = item[0]
    peer = name.partition(" ")[2]
    return (ORDER.get(kind(name), len(ORDER)), int(peer) if peer.isdigit() else -1)


def counts(sources: Dict[str, str]) -> Dict[str, int]:
    out = {KEPT: 0, PEER: 0, DISK: 0}
    for name, text in sources.items():
        out[kind(name)] = out.get(kind(name), 0) + len(parse_ranges(text))
    return out


def build(cycle: int, resume: Optional[int], redone: Optional[int], sources: Sequence[Optional[int]],
          moved: int, transfer_s: float, restore_s: float, reason: str = "", name: Optional[str] = None,
          check: Optional[dict] = None) -> dict:
    """The summary of one restore: `sources` per rank (its own rank: kept, a peer's rank, None:
    disk), `moved` the bytes received by every rank, `transfer_s` the slowest receiver's and
    `restore_s` the slowest rank's seconds; `name` the LiveState's, `check` the replicas' digest
    check ({"bytes", "s", "ms_per_gb"})."""
    named = by_source(sources)
    summary = {"cycle": cycle, "name": name, "resume_step": resume, "steps_redone": redone, "world": len(sources),
               "sources": named, "counts": counts(named), "bytes": int(moved),
               "transfer_s": round(transfer_s, 6), "restore_s": round(restore_s, 6)}
    if summary["bytes"] and summary["transfer_s"]:
        summary["mb_per_s"] = round(summary["bytes"] / 1e6 / summary["transfer_s"], 1)
    if check is not None:
        summary["check"] = check
    if reason:
        summary["reason"] = reason
    return summary



def encode(summary: dict, limit: int) -> bytes:
    """The summary as JSON of at most `limit` bytes (see the module docstring for what gives way)."""
    data = _json(summary)
    if len(data) <= limit:
        return data
    sources = summary.get("sources") or {}
    peers = [name for name in sources if kind(name) in (PEER, BUDDY)]
    coarse: Dict[str, List[int]] = {}
    for name, text in sources.items():
        coarse.setdefault(kind(name), []).extend(parse_ranges(text))
    smaller = dict(summary, sources={k: ranges(v) for k, v in sorted(coarse.items(), key=source_order)},
                   sources_elided=f"which peer each receiving rank got its state from ({len(peers)} peers)")
    data = _json(smaller)
    if len(data) <= limit:
        return data
    smaller = dict(summary, sources={}, sources_elided="which rank got its state from where (too many ranges)")
    if "reason" in smaller:
        smaller["reason"] = str(smaller["reason"])[:400]
    return _json(smaller)   # a few hundred bytes: counts, numbers and a reason


def write(mm, words, summary: dict) -> None:
    """Global rank 0: the summary into its record's live text area (before its H_LIVE_* words)."""
    L.write_live_text(mm, words, encode(summary, L.LIVE_TEXT_BYTES))


def decode(data: bytes) -> Optional[dict]:
    try:
        out = json.loads(data.decode("utf-8", "replace"))
    except ValueError:
        return None
    return out if isinstance(out, dict) else None


def _json(value: dict) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode("utf-8", "replace")
