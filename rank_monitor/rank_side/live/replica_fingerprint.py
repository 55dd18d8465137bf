"""Replicas stay bit-equal, checked: a digest of a rank's committed state (parameters and
optimizer state, guard_targets.Targets.state) that its replicas compare, so a flip anywhere in
it (a finite one too: a low exponent or mantissa bit), made in the optimizer step or in memory,
is found whatever the bit.

The digest: each tensor's bytes viewed as int64 words (the few elements past the last whole word,
or a tensor not contiguous, as integers of its element size), summed into an int64 (wrapping); the
tensors' sums added. A flipped bit changes one word by 2**b (b < 64), and so the sum by 2**b mod
2**64, never 0: one flip is always seen (several could cancel: not a cryptographic hash).
It runs on the tensors' device (one pass over them, no host sync: the guard reads it with its
table), as two exact 32-bit halves in the table's float64 row.

How often: every K steps, K from a cost budget: the first digest's time measured against the
step time, K = the smallest that keeps it within `budget` (default 1 %) of a step, agreed by
every rank (the table's largest proposal), and the step after any guard hit. With K = 1 (a
digest every step; small models) a divergence is found before any replica's next update, so the
heal is exact; with K > 1 the odd replica's gradients went into its peers' updates for up to K
steps: the heal makes them equal again, said in its line.
"""
from __future__ import annotations

import math
import time
from typing import Any, List, Optional

MASK = (1 << 32) - 1


def digest(tensors: List[Any], device) -> Any:
    """The int64 digest of `tensors` (a device tensor)."""
    import torch

    total = torch.zeros((), dtype=torch.int64, device=device)
    seen = set()
    for t in tensors:
        key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
        if t.numel() == 0 or key in seen:   # a tensor twice (tied weights) would count a top bit 2 x 2**63 = 0
            continue
        seen.add(key)
        if t.dtype == torch.bool:
            total = total + t.to(torch.int64).sum().to(device)
            continue
        words, tail = _as_words(t)
        if words is not None:
            total = total + words.sum().to(device)
        if tail is not None:
            ints = tail.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tail.element_size()])
            total = total + ints.sum(dtype=torch.int64).to(device)
    return total


def _as_words(t):
    """`t`'s bytes as int64 words where they are contiguous and aligned (one vectorized pass: a sum
    of int32s widened to int64 runs some 40x slower on a CPU), and the elements left over: -> (words
    or None, tail or None). A flipped bit changes one word by 2**b, b < 64: the sum still sees it."""
    import torch

    size = t.element_size()
    if size > 8 or not t.is_contiguous():
        return None, t
    flat = t.reshape(-1)
    per = 8 // size
    whole = (flat.numel() // per) * per
    if whole == 0 or (flat.storage_offset() * size) % 8:
        return None, flat
    try:
        words = flat[:whole].view(torch.int64)
    except RuntimeError:   # a layout view() refuses: the elements' own width
        return None, flat
    return words, (flat[whole:] if whole < flat.numel() else None)


def halves(d) -> tuple:
    """The digest as two float64 device tensors (high and low 32 bits), exact."""
    import torch

    hi = torch.bitwise_right_shift(d, 32).bitwise_and(MASK).to(torch.float64)
    return hi, d.bitwise_and(MASK).to(torch.float64)


def finite(tensors: List[Any]) -> bool:
    """Whether every floating tensor is finite (only when replicas disagree: which one is bad)."""
    import torch

    for t in tensors:
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            return False
    return True


class Schedule:
    """When the fingerprint runs (every K steps and the step after a hit), K from the budget."""

    def __init__(self, every: Optional[int], budget: float) -> None:
        self.fixed = every                # a user's K (0: off), or None: from the budget
        self.budget = budget
        self.k = every or 1
        self.cost: Optional[float] = None  # seconds of one digest (measured once)
        self.step_s: Optional[float] = None
        self._last_t: Optional[float] = None
        self.forced: Optional[int] = None  # a step that runs it whatever K (after a hit)
        self.agreed: Optional[int] = None  # the last step whose digests agreed

    @property
    def on(self) -> bool:
        return self.fixed != 0

    def due(self, step: int) -> bool:
        return self.on and (step % self.k == 0 or self.forced == step)

    def tick(self) -> None:
        """Once per guarded step: the step time (the gap between two guards)."""
        now = time.perf_counter()
        if self._last_t is not None:
            gap = now - self._last_t
            self.step_s = gap if self.step_s is None else 0.9 * self.step_s + 0.1 * gap
        self._last_t = now

    def measured(self, seconds: float) -> None:
        """One digest's time (the first with its device work; later ones on a CPU only)."""
        self.cost = seconds if self.cost is None else 0.8 * self.cost + 0.2 * seconds

    def agree(self, k: int, step: int, compared: bool) -> None:
        """Every rank's agreed K (the table's largest proposal; kept unless it moved by 2x or more,
        so the schedule does not jitter), and the last step whose digests agreed."""
        if self.fixed is None and (k >= 2 * self.k or 2 * k <= self.k):
            self.k = max(1, k)
        if compared:
            self.agreed = step

    def exact(self, step: int) -> bool:
        """A divergence found at `step`: whether no committed update can have carried it into the
        other replicas (the digests agreed at the step before)."""
        return self.agreed == step - 1

    def proposal(self) -> int:
        """This rank's K: the user's, or the budget's once a digest and a step were measured."""
        if self.fixed is not None:
            return self.fixed
        if self.cost is None or not self.step_s:
            return self.k
        return max(1, min(1000, math.ceil(self.cost / (self.budget * self.step_s))))
