"""Python tracebacks in a rank's stderr, read line by line as agent.ranks.rank_output passes them on:
where one starts and ends, its exception line, whether it is only a collective's error from a
peer that went away (a victim's), and a signature that says when two are the same.

A block starts at `Traceback (most recent call last):` (torch's `[rankN]: ` prefix and our own
`[rank N] ` are ignored) and takes every line after it; it is complete once its exception line
(the first unindented line after the last `  File` frame) has come and QUIET seconds pass without
another line, when the stream ends, or at MAX_AGE / MAX_LINES. A chained exception (`During
handling of the above exception ...`) stays in the same block.
"""
from __future__ import annotations

import re
from typing import List

START = "Traceback (most recent call last):"
QUIET = 0.3        # seconds without a line after the exception line: the block is complete
MAX_AGE = 3.0      # seconds: a block is passed on by then whatever follows
MAX_LINES = 2000
_PREFIX = re.compile(r"^(?:\[rank ?\d+\]:? ?)+")
_CHAIN = ("During handling of the above exception", "The above exception was the direct cause", START)
# The exception of a rank that only lost its peers: the collective it waited in failed because
# another rank or node went away (gloo's closed or reset connection and timeouts, NCCL's abort and
# errors, torch's network and backend errors). Folded when the agent has named another culprit.
_VICTIM = re.compile(
    r"Connection (?:closed|reset) by peer|Broken pipe|DistNetworkError|DistBackendError|"
    r"NCCL communicator was aborted|ProcessGroupNCCL|NCCL error|Application timeout caused pair closure|"
    r"Timed out waiting \d+ms for recv operation|Socket Timeout", re.I)
_SOURCE_TAG = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|c|h|hpp|cu):\d+\]\s*")
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


def text_of(line: bytes) -> str:
    """A raw output line as text, without the rank prefixes torch or we put in front."""
    return _PREFIX.sub("", line.decode("utf-8", errors="replace").rstrip("\r"))


def starts(line: bytes) -> bool:
    return text_of(line).startswith(START)


class Block:
    """One traceback being read (the raw lines, with their line ends stripped)."""

    def __init__(self, first: bytes, now: float):
        self.lines: List[bytes] = [first]
        self.started = self.last = now
        self._framed = False     # a `  File ...` frame line has come
        self._ended = False      # the exception line after the last frame has come

    def add(self, line: bytes, now: float) -> None:
        self.lines.append(line)
        self.last = now
        text = text_of(line)
        if text.startswith("  File "):
            self._framed, self._ended = True, False
        elif self._framed and text and not text[0].isspace() and not text.startswith(_CHAIN):
            self._ended = True

    def complete(self, now: float) -> bool:
        return ((self._ended and now - self.last >= QUIET) or now - self.started >= MAX_AGE
                or len(self.lines) >= MAX_LINES)

    def texts(self) -> List[str]:
        return [text_of(line) for line in self.lines]

    def exception(self) -> str:
        """The exception line (of the last exception in a chain): `Type: message`."""
        texts = self.texts()
        last_frame = max((i for i, t in enumerate(texts) if t.startswith("  File ")), default=-1)
        return next((t for t in texts[last_frame + 1:] if t.strip() and not t[0].isspace()), texts[-1]).strip()

    def victim(self) -> bool:
        """Only a collective's error from peers that went away (see _VICTIM)."""
        return bool(_VICTIM.search(self.exception()))

    def signature(self) -> str:
        """What two identical failures share: the exception line and the frame that raised it
        (not the frames above it, which differ between a cold start and a warm reserve's runpy),
        memory addresses left out."""
        texts = self.texts()
        frames = [t.strip() for t in texts if t.startswith("  File ")]
        return _ADDRESS.sub("0x?", "\n".join(frames[-1:] + [self.exception()]))


def short(exception: str, limit: int = 160) -> str:
    """An exception line for one line of output: the C++ source tag and torch's advice cut off."""
    text = _SOURCE_TAG.sub("", exception)
    cut = text.find(". ", 20)
    if cut > 0:
        text = text[:cut]
    return text if len(text) <= limit else text[: limit - 3] + "..."

