"""Python tracebacks in a rank's stderr (agent/ranks/tracebacks.py), read line by line as
agent.ranks.rank_output passes them on: where a block starts and when it is complete, its exception
line (the last of a chain), whether it is only a collective's error from a peer that went away,
the signature that tells two failures are the same, and the one-line form. Pure: lines and clock
values in, words out. (A whole job's folded victims: tests/jobs/test_first_hour.py.)
"""
import pytest

from ft_launcher.agent.ranks.tracebacks import MAX_AGE, MAX_LINES, QUIET, Block, short, starts, text_of

RAISED = [
    b"Traceback (most recent call last):",
    b'  File "/job/train.py", line 120, in <module>',
    b"    main()",
    b'  File "/job/train.py", line 88, in main',
    b"    loss = step(batch)",
    b"ValueError: loss is NaN at step 0x7f3a2c00 (batch 17)",
]


def read(lines, start=0.0, gap=0.01):
    """A Block fed `lines`, one every `gap` s from `start`; returns it and the time of the last line."""
    block, now = Block(lines[0], start), start
    for line in lines[1:]:
        now += gap
        block.add(line, now)
    return block, now


def test_a_block_starts_at_the_traceback_line_whatever_the_rank_prefix():
    assert starts(b"Traceback (most recent call last):")
    assert starts(b"[rank3]: Traceback (most recent call last):")        # torch's prefix
    assert starts(b"[rank 3] Traceback (most recent call last):")        # ours
    assert not starts(b"  Traceback (most recent call last):") and not starts(b"step 5 loss 0.3")
    assert text_of(b"[rank0]: [rank 0] KeyError: 'x'\r") == "KeyError: 'x'"
    assert text_of(b"caf\xc3\xa9 \xff") == "caf\u00e9 \ufffd"


def test_it_is_complete_a_quiet_moment_after_its_exception_line():
    block, last = read(RAISED[:-1], gap=0.001)
    assert not block.complete(last + QUIET)                                # frames only: no exception yet
    block.add(RAISED[-1], last)
    assert not block.complete(last + QUIET / 2)                            # more may follow
    assert block.complete(last + QUIET)
    assert block.exception() == "ValueError: loss is NaN at step 0x7f3a2c00 (batch 17)"


def test_it_is_passed_on_at_its_age_or_length_limit_whatever_follows():
    block = Block(RAISED[0], 0.0)
    block.add(RAISED[1], 0.1)
    assert not block.complete(MAX_AGE - 0.01) and block.complete(MAX_AGE)
    long = Block(RAISED[0], 0.0)
    for i in range(MAX_LINES - 1):
        long.add(b'  File "/job/deep.py", line %d, in f' % i, 0.0)
    assert long.complete(0.0)


def test_a_chained_exception_stays_in_one_block_and_its_last_exception_is_the_one():
    chained = RAISED + [
        b"",
        b"During handling of the above exception, another exception occurred:",
        b"",
        b"Traceback (most recent call last):",
        b'  File "/job/train.py", line 91, in main',
        b"    save_and_exit()",
        b"RuntimeError: checkpoint write failed",
    ]
    block, last = read(chained, gap=0.001)
    assert block.complete(last + QUIET) and len(block.lines) == len(chained)
    assert block.exception() == "RuntimeError: checkpoint write failed"
    half, last = read(chained[:9], gap=0.001)                             # after the second header only
    assert half.exception() == "ValueError: loss is NaN at step 0x7f3a2c00 (batch 17)"


@pytest.mark.parametrize("exception, victim", [
    ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4312", True),
    ("torch.distributed.DistNetworkError: Broken pipe", True),
    ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited", True),
    ("RuntimeError: [gloo] Timed out waiting 1800000ms for recv operation to complete", True),
    ("ValueError: loss is NaN", False),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", False),
])
def test_only_a_collectives_error_from_a_peer_that_went_away_is_a_victims(exception, victim):
    block, _ = read(RAISED[:-1] + [exception.encode()])
    assert block.victim() is victim


def test_the_signature_is_the_raising_frame_and_the_exception_without_addresses():
    cold, _ = read(RAISED)
    warm_lines = [RAISED[0], b'  File "<frozen runpy>", line 88, in _run_code', b"    exec(code, run_globals)"] + \
        RAISED[1:-1] + [b"ValueError: loss is NaN at step 0x55aa00ff (batch 17)"]
    warm, _ = read([b"[rank1]: " + line for line in warm_lines])
    assert cold.signature() == warm.signature() == (
        'File "/job/train.py", line 88, in main\nValueError: loss is NaN at step 0x? (batch 17)')
    other, _ = read(RAISED[:-1] + [b"ValueError: loss is NaN at step 0x1 (batch 18)"])
    assert other.signature() != cold.signature()


def test_the_one_line_form_cuts_the_source_tag_and_the_advice():
    gloo = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
            "[10.0.0.2]:4312. This is typically caused by a remote worker crashing.")
    assert short(gloo) == "RuntimeError: Connection closed by peer [10.0.0.2]:4312"
    assert short("ValueError: x. y") == "ValueError: x. y"                  # a cut only past 20 characters
    long = "KeyError: " + "k" * 300
    assert len(short(long)) == 160 and short(long).endswith("...")
    assert short(long, limit=40) == long[:37] + "..."


def test_a_traceback_of_a_rank_restarted_in_place_stays_its_old_cycles():
    """agent.ranks.rank_output: a rank that raised in cycle 0 printed its traceback moments before
    it was adopted in place as cycle 1 (well inside QUIET). That traceback is cycle 0's error,
    never cycle 1's: a failure of cycle 1 must not carry it (issue 39). Real pipe, real reader."""
    import os
    import time

    from ft_launcher.agent.ranks.rank_output import RankOutput

    out = RankOutput()
    _, stderr, handle = out.plan(1, capture=0, tee=0, show=True, log_file=None, cycle=0)
    out.attach(handle)
    try:
        os.write(stderr, b"\n".join(RAISED) + b"\n")
        out.recycle(handle, 1, 1)            # at once, as an in-place restart does (0.1 s << QUIET)
        assert out.error(0, 1) is not None and out.error(0, 1)[1].startswith("ValueError: loss is NaN")
        time.sleep(QUIET + 0.2)
        assert out.error(1, 1) is None       # on the old code: cycle 0's exception, as cycle 1's
    finally:
        os.close(stderr)
        out.finish(handle)
