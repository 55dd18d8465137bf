"""The live-recovery summary at any world size (rank_monitor/live_summary.py, agent/observation/live_recovery.py).

512 simulated ranks through the real path: the recovery plan (live_plan.plan_recovery), global
rank 0's summary (live_summary.build, written by live_summary.write into a real shared-memory
record as `LiveState.restore()` does, then its H_LIVE_* words), and the agent's reader
(live_recovery.News polling that record, an EventLog writing events.jsonl and the console). The
event names every rank's source, the console line stays one readable line, and a summary that
would not fit the record's area gives up detail, never the event.
"""
import io
import json
import random

import pytest

from ft_launcher.agent.observation.events import EventLog
from ft_launcher.agent.observation import live_recovery
from ft_launcher.rank_monitor import live_summary as S
from ft_launcher.rank_monitor import shm_layout as L
from ft_launcher.rank_monitor.rank_side.live.live_plan import Need, Offer, plan_recovery


class _Rank0Record:
    """The agent's view of global rank 0's monitor: its shared-memory record (MonitorHandle.record)."""

    def __init__(self, path):
        self.mm, self.words = L.create(str(path))

    def record(self):
        return self.mm, self.words

    def close(self):
        self.words.release()
        self.mm.close()


class _Goodput:
    def __init__(self):
        self.resumed = []

    def live_resumed(self, resume):
        self.resumed.append(resume)


def _restore_on_rank0(rec, cycle, steps, shards, moved=0, transfer_s=0.0, restore_s=0.0):
    """What LiveState.restore() does on global rank 0 once the exchange is done: plan, summary into
    the record, then the words the agent waits for (H_LIVE_CYCLE last)."""
    plan = plan_recovery([Offer(r, s, shards[r], 7) for r, s in enumerate(steps) if s >= 0],
                         [Need(shard, 7) for shard in shards])
    resume, reason = plan.resume, plan.reason
    sources = [None if src is None else src.holder for src in plan.sources]
    summary = S.build(cycle, resume, None if resume is None else max(0, max(steps) - resume), sources, moved,
                      transfer_s, restore_s, reason)
    S.write(rec.mm, rec.words, summary)
    rec.words[L.H_LIVE_RESUME] = 0 if resume is None else resume + 1
    rec.words[L.H_LIVE_SOURCE] = L.LIVE_DISK if resume is None else L.LIVE_KEPT if sources[0] == 0 else L.LIVE_PEER
    rec.words[L.H_LIVE_CYCLE] = cycle
    return resume, sources


def _agent_reads(tmp_path, rec, cycle):
    console = io.StringIO()
    events = EventLog(str(tmp_path / "events.jsonl"), stream=console)
    events.node, events.cycle = 0, cycle
    goodput = _Goodput()
    news = live_recovery.News(goodput, events)
    news.begin_cycle(cycle, rank_offset=0)
    news.poll([rec])
    with open(tmp_path / "events.jsonl") as fh:
        told = [json.loads(line) for line in fh]
    return told, console.getvalue().splitlines(), goodput.resumed


@pytest.fixture
def rank0(tmp_path):
    rec = _Rank0Record(tmp_path / "rank0.shm")
    yield rec
    rec.close()


@pytest.mark.parametrize("case", ["a node lost", "half the ranks from distinct peers", "hsdp"])
def test_512_ranks_one_event_and_one_readable_line(tmp_path, rank0, case):
    world = 512
    steps, shards = [136] * world, [0] * world
    if case == "a node lost":           # ranks 256-263 were replaced, rank 5 raised
        lost = list(range(256, 264)) + [5]
    elif case == "half the ranks from distinct peers":   # every odd rank: 256 receivers, 256 sources
        lost = list(range(1, world, 2))
    else:                               # HSDP, 64 replicas x 8 shards: node 3 (ranks 24-31) lost
        shards = [r % 8 for r in range(world)]
        lost = list(range(24, 32))
    for r in lost:
        steps[r] = -1
    resume, sources = _restore_on_rank0(rank0, 1, steps, shards, moved=47_000_000 * len(lost), transfer_s=0.2,
                                        restore_s=0.25)
    assert resume == 136
    told, lines, resumed = _agent_reads(tmp_path, rank0, 1)
    assert resumed == [136]
    assert [e["kind"] for e in told] == ["live_recovery"], told
    d = told[0]["detail"]
    assert d["resume_step"] == 136 and d["world"] == world
    assert d["counts"] == {"kept": world - len(lost), "peer": len(lost), "disk": 0}, d["counts"]
    expected = {str(r): ("kept" if s == r else f"peer {s}") for r, s in enumerate(sources)}
    assert live_recovery.per_rank(d["sources"]) == expected   # every rank's source, from the event alone
    assert len(json.dumps(d)) < 6000, len(json.dumps(d))
    line = [ln for ln in lines if "live recovery: resumed at step 136" in ln]
    assert len(line) == 1 and len(line[0]) < 400, line
    print(f"\n{case}: event {len(json.dumps(d))} bytes; {line[0]}")
    if case == "a node lost":
        assert "ranks 0-4, 6-255, 264-511 kept" in line[0], line[0]
        assert "rank 5 from peer rank 0" in line[0] and "rank 256 from peer rank 1" in line[0], line[0]
        assert "4 more ranks from 4 other sources" in line[0], line[0]


def test_the_fallback_to_disk_at_512_ranks(tmp_path, rank0):
    steps = [-1] * 512
    _restore_on_rank0(rank0, 2, steps, [0] * 512)
    told, lines, resumed = _agent_reads(tmp_path, rank0, 2)
    d = told[0]["detail"]
    assert resumed == [-1] and d["resume_step"] is None and d["sources"] == {"disk": "0-511"}, d
    assert any("live recovery: no live state (no rank holds live state" in ln for ln in lines), lines


def test_a_summary_too_big_for_the_record_gives_up_detail_not_the_event(tmp_path, rank0):
    """200,000 ranks, every other one received from a distinct peer (100,000 sources, 100,000
    ranges): first the per-peer detail goes, then the ranges; the event and line still come."""
    world = 200_000
    sources = [r if r % 2 == 0 else r - 1 for r in range(world)]
    summary = S.build(1, 10, 0, sources, 1, 0.1, 0.2)
    data = S.encode(summary, L.LIVE_TEXT_BYTES)
    assert len(data) <= L.LIVE_TEXT_BYTES
    small = json.loads(data)
    assert small["counts"] == {"kept": world // 2, "peer": world // 2, "disk": 0} and small["sources_elided"]
    # the per-peer detail alone: 12,000 ranks, every 4th received from its neighbour (3,000 peers)
    sources = [r - 1 if r % 4 == 1 else r for r in range(12_000)]
    mid = json.loads(S.encode(S.build(1, 10, 0, sources, 1, 0.1, 0.2), L.LIVE_TEXT_BYTES))
    assert set(mid["sources"]) == {"kept", "peer"} and "3000 peers" in mid["sources_elided"], mid["sources_elided"]
    assert live_recovery.per_rank(mid["sources"])["1"] == "peer"
    # through the record and the agent: one event, one line
    S.write(rank0.mm, rank0.words, summary)
    rank0.words[L.H_LIVE_RESUME], rank0.words[L.H_LIVE_CYCLE] = 11, 1
    told, lines, _ = _agent_reads(tmp_path, rank0, 1)
    assert [e["kind"] for e in told] == ["live_recovery"] and told[0]["detail"]["sources_elided"]
    line = [ln for ln in lines if "live recovery: resumed at step 10" in ln]
    assert len(line) == 1 and len(line[0]) < 400 and "100000 ranks kept, 100000 from peers" in line[0], line


def test_ranges_round_trip():
    rng = random.Random(5)
    for _ in range(50):
        ranks = sorted(rng.sample(range(1000), rng.randint(0, 300)))
        assert S.parse_ranges(S.ranges(ranks)) == ranks
    assert S.ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8" and S.ranges([]) == ""
