"""The simulated silent data corruption (`rank_sdc`): what goes wrong, when, and where it lands.

The agent (agent.recovery.fault_injection) hands the hit node's ranks ENV_SDC =
"KIND:STEP:PERSIST:LOCAL:PLACE", set only on the hardware it hits:
- KIND: `nan`, `inf`, `bitflip` (the top exponent bit: a huge value, or 0 -> 2), or a finite flip
  that leaves the value in range: `expflip` (the lowest exponent bit: x2 or /2) or `mantflip` (the
  top mantissa bit);
- STEP: the training step (commit number) it first hits; PERSIST: `once` (the first time a
  process of the job runs STEP on that hardware: marked in the agent's directory), `device` or
  `node` (every step from STEP on, on that hardware);
- LOCAL: the local slot it hits (`*`: every slot of the node);
- PLACE, where the corruption lands:
  `backward` (default): one element of this rank's gradient as its backward produces it, before
  the all-reduce (rank_side.live.backward_watch's hook): DDP spreads it to every replica;
  `reduced`: this rank's gradient after the all-reduce, just before the guard (the optimizer's
  input on one device, after the loop's own clip_grad_norm_);
  `memory`: this rank's first parameter after the optimizer step, once the step is committed
  (a flip in memory or in the optimizer's arithmetic): the replicas now differ.
A 4-part value (no PLACE) is `backward`.
"""
from __future__ import annotations

import os
from typing import Optional

ENV_SDC = "FT_LAUNCHER_SIM_SDC"
KINDS = ("nan", "inf", "bitflip", "expflip", "mantflip")
PERSISTS = ("once", "device", "node")
PLACES = ("backward", "reduced", "memory")


class Spec:
    """One parsed ENV_SDC value; `fired` is this process's once-only mark."""

    def __init__(self, kind: str, step: int, persist: str, local: str, place: str) -> None:
        self.kind, self.step, self.persist, self.local, self.place = kind, step, persist, local, place
        self.fired = False

    def due(self, step: int, place: str) -> bool:
        """Whether the fault hits `place` at `step` on this rank (marks a once-only fault fired)."""
        if place != self.place or step < self.step:
            return False
        if self.local != "*" and self.local != os.environ.get("LOCAL_RANK", "0"):
            return False
        if self.persist == "once" and (step != self.step or self.fired or not _first_on_node()):
            return False
        self.fired = True
        return True

    def text(self, step: int) -> str:
        return (f"simulated {self.kind} in rank {os.environ.get('RANK', '0')}'s "
                f"{'parameter' if self.place == 'memory' else 'gradient'} at step {step} "
                f"({self.place}, {self.persist})")


ONCE_MARK = "sdc_once_fired"   # in the agent's directory: a `once` fault fired on this node


def _first_on_node() -> bool:
    """A `once` fault fires once per job, not once per process: the first process to fire it on
    this node marks the agent's directory (O_EXCL), so the processes an exit 16 or a fallback starts
    afterwards on the same hardware do not fire it again. Outside ft_launcher (no agent directory):
    once per process."""
    from ft_launcher.rank_monitor import buddy_store

    prefix = os.environ.get(buddy_store.ENV_PREFIX)
    if not prefix:
        return True
    try:
        os.close(os.open(os.path.join(os.path.dirname(prefix), ONCE_MARK),
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600))
    except FileExistsError:
        return False
    except OSError:
        pass
    return True


def parse(text: Optional[str]) -> Optional[Spec]:
    """ENV_SDC -> Spec, or None (unset or malformed: no fault)."""
    if not text:
        return None
    parts = text.split(":")
    if len(parts) == 4:
        parts.append("backward")
    if (len(parts) != 5 or parts[0] not in KINDS or parts[2] not in PERSISTS or parts[4] not in PLACES
            or not parts[1].isdigit()):
        return None
    return Spec(parts[0], int(parts[1]), parts[2], parts[3], parts[4])


_SPEC = [None, None]   # (the ENV_SDC text it was parsed from, the Spec): parsed once per process


def spec() -> Optional[Spec]:
    text = os.environ.get(ENV_SDC)
    if _SPEC[0] != text:
        _SPEC[0], _SPEC[1] = text, parse(text)
    return _SPEC[1]


_INT = {1: None, 2: "int16", 4: "int32", 8: "int64"}
_TOP_EXP = {"float32": 30, "float64": 62, "float16": 14, "bfloat16": 14}
_LOW_EXP = {"float32": 23, "float64": 52, "float16": 10, "bfloat16": 7}


def corrupt(t, kind: str) -> None:
    """Corrupt the first element of tensor `t` in place (a DTensor's local shard)."""
    import torch

    t = t.to_local() if hasattr(t, "to_local") else t
    if t.numel() == 0:
        return
    flat = t.view(-1)[:1]
    name = str(t.dtype).replace("torch.", "")
    with torch.no_grad():
        if kind in ("nan", "inf") or name not in _TOP_EXP:
            flat.fill_(float("nan") if kind != "inf" else float("inf"))
            return
        bit = {"bitflip": _TOP_EXP[name], "expflip": _LOW_EXP[name], "mantflip": _LOW_EXP[name] - 1}[kind]
        flat.view(getattr(torch, _INT[t.element_size()])).bitwise_xor_(1 << bit)
