"""Per-rank records (rank_monitor/rank_side/live/rank_record.py): a LiveState's `per_rank` objects
kept in host memory at every commit, read back by a later process of the same local rank slot.

Real files in a 0700 directory (as the agent makes it), a second RankRecord standing for the rank's
next process: the record of exactly the step asked for comes back; another step, identity or
layout, a record abandoned at a fallback, and a torn write are none, each with its words.
"""
import os
import tempfile

import pytest

torch = pytest.importorskip("torch")

from ft_launcher.rank_monitor import buddy_store as S   # noqa: E402
from ft_launcher.rank_monitor.rank_side.live.rank_record import RankRecord   # noqa: E402

ID, LAYOUT, WORLD = 11, 22, 4


def _state(pos):
    return {"loader": {"rank_id": "dp_rank_3", "world_size": WORLD, "state": {"_num_yielded": pos, "buf": [1, 2, pos]}}}


@pytest.fixture
def prefix():
    where = tempfile.mkdtemp(prefix="ft_rec_test_")
    os.chmod(where, 0o700)
    yield os.path.join(where, "local0")
    for name in os.listdir(where):
        os.unlink(os.path.join(where, name))
    os.rmdir(where)


def test_the_record_of_the_resume_step_comes_back_in_the_next_process(prefix):
    rec = RankRecord(prefix)
    for step in (12, 13):
        assert rec.write(_state(step), step, ID, LAYOUT, WORLD, 3, 1) > 0
    rec.write(_state(99), 14, ID, LAYOUT, WORLD, 3, 1)
    slot = rec.slots[0]
    slot.begin()   # a death in the middle of step 14's write: that record is none
    rec.close()
    later = RankRecord(prefix)   # the rank's next process
    slot, why = later.find(13, ID, LAYOUT)
    assert slot is not None and why == ""
    assert later.read(slot, {"loader": ({}, None, None)}) == _state(13)
    assert later.find(14, ID, LAYOUT) == (None, "its node holds records of step 13 only")
    assert later.find(13, ID + 1, LAYOUT)[1] == "its record of step 13 was made under another world size or layout"
    later.close()


def test_a_fallback_abandons_the_records(prefix):
    rec = RankRecord(prefix)
    rec.write(_state(13), 13, ID, LAYOUT, WORLD, 3, 1)
    rec.abandon(2)
    assert rec.find(13, ID, LAYOUT) == (None, "no record of it is on this node")
    rec.write(_state(11), 11, ID, LAYOUT, WORLD, 3, 2)   # the checkpoint's timeline, cycle 2
    assert rec.find(11, ID, LAYOUT)[0] is not None
    rec.close()


def test_a_directory_open_to_others_is_refused(prefix):
    os.chmod(os.path.dirname(prefix), 0o755)
    rec = RankRecord(prefix)
    assert rec.refused and "mode 0755" in rec.refused
    with pytest.raises(OSError):
        rec.write(_state(1), 1, ID, LAYOUT, WORLD, 3, 1)
    assert rec.find(1, ID, LAYOUT)[0] is None
    assert S.Slot(prefix + "_rec1").words is None   # nothing was written there


def test_a_rank_moved_to_another_local_slot_finds_its_record_in_its_previous_slot(prefix):
    """After an exit 16 the two ranks of a node swap slots (devices): rank 3 now runs in slot 1 and
    finds its record of step 13 in slot 0's files (the identity says whose), never slot 1's other
    rank's record (another identity)."""
    where = os.path.dirname(prefix)
    mine, other = RankRecord(os.path.join(where, "local0")), RankRecord(os.path.join(where, "local1"))
    mine.write(_state(13), 13, ID, LAYOUT, WORLD, 3, 1)        # rank 3, dp rank 3, in slot 0
    other.write(_state(70), 13, ID + 1, LAYOUT, WORLD, 2, 1)   # rank 2, another per-rank identity, slot 1
    mine.close()
    other.close()
    moved = RankRecord(os.path.join(where, "local1"))          # rank 3's next process, in slot 1
    slot, why = moved.find(13, ID, LAYOUT)
    assert why == "" and slot.path == os.path.join(where, "local0_rec1")
    assert moved.read(slot, {"loader": ({}, None, None)}) == _state(13)
    assert moved.find(13, ID + 5, LAYOUT)[1] == "its record of step 13 was made under another world size or layout"
    moved.close()
