"""Each rank's own gradients as its backward produces them, before any all-reduce: the step guard
names the rank whose device made a NaN, an Inf or a flipped top exponent bit, even where DDP then
spreads it to every replica (the usual silent data corruption: all norms NaN, every loss finite).

On from a hit's re-run, for the transient window after one, or every step (LiveState's
`watch_every_step`): the guard turns it on and off (LiveState.backward_watch); off, its hooks stay
only where a simulated fault's `backward` place must land (`measure` False: no norm).
One tensor hook per parameter the optimizers update (guard_targets.Targets.params). A hook runs on
the gradient before it is accumulated into `.grad`, so before DDP's reducer copies it into a
bucket: the value is this rank's own. Each hook takes one norm of its gradient (fp32, a device
tensor: no host sync) and keeps it; the guard reads the largest once per step (`local()`), at its
table's one host read. A norm at or above LIMIT (2**60: a squared element past fp32's range, a
flipped top exponent bit of any value not tiny) or not finite is this rank's corruption.
The simulated fault's `backward` place (rank_side.live.sdc_sim) lands here too, on the hit rank:
a once-only fault in the first gradient of its step's backward, a persistent one in every gradient
of every backward from its step on (a re-run's too, whatever else runs a backward first): the
check then sees what a bad device would have made.

FSDP: a parameter sharded by fully_shard is not the tensor its backward fills (FSDP2 computes into
an unsharded copy and reduce-scatters it), so no hook fires there and the guard falls back to the
reduced gradients (said in docs/sdc-and-nan.md). Gradient accumulation: every micro-batch's
backward is watched; the window ends at the guard's read.
"""
from __future__ import annotations

from typing import Any, List, Optional

from ft_launcher.rank_monitor.rank_side.live import sdc_sim

LIMIT = float(2 ** 60)


class BackwardWatch:
    def __init__(self, params: List[Any], next_step: int, measure: bool = True) -> None:
        self.step = next_step            # the step whose backward runs next (the guard moves it on)
        self.measure = measure           # take the norms (False: the hooks only land a simulated fault)
        self.norms: List[Any] = []       # this window's per-gradient norms (device tensors)
        self.injected: Optional[str] = None
        self.handles = [p.register_hook(self._hook) for p in params if p.requires_grad]

    def _hook(self, grad):
        import torch

        spec = sdc_sim.spec()
        if spec is not None and spec.due(self.step, "backward"):   # (a once-only fault: its first gradient)
            grad = grad.clone()
            sdc_sim.corrupt(grad, spec.kind)
            self.injected = spec.text(self.step)
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        if self.measure and local.numel():
            self.norms.append(torch.linalg.vector_norm(local, 2, dtype=torch.float32))
        return grad

    def local(self, device):
        """This window's largest gradient norm on this rank (a float64 device tensor, 0 when no
        gradient came), and a new window for `step`'s successor."""
        import torch

        norms, self.norms = self.norms, []
        if not norms:
            return torch.zeros((), dtype=torch.float64, device=device)
        return torch.stack([n.to(device) for n in norms]).max().to(torch.float64)

    def next(self, step: int) -> None:
        self.step = step

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def bad(norm: float) -> bool:
    """A gradient norm that no healthy backward makes (NaN, Inf, or past LIMIT)."""
    return not (norm < LIMIT)
