"""Each rank's own gradients as its backward produces them, before any all-reduce or reduce-scatter:
the step guard names the rank whose device made a NaN, an Inf or a flipped top exponent bit, even
where DDP or FSDP then spreads it to every replica (the usual silent data corruption: all norms
NaN, every loss finite).

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

FSDP2 and HSDP (fully_shard, a 1-D or 2-D mesh): the backward fills each sharded parameter's
unsharded copy, which FSDP then reduce-scatters (and all-reduces across HSDP's replicas), so the
hook goes on that copy (FSDPParam's `unsharded_param`, kept from the module's first all-gather on;
a watch that starts before it is hooked by a forward hook on the FSDPModule). These are torch's
private parts (read in torch 2.13): where they differ, one line says so and the hooks stay on the
sharded parameters, where none fires (the guard falls back to the reduced gradients, unnamed).
Gradient accumulation: every micro-batch's backward is watched; the window ends at the guard's read.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, List, Optional

from ft_launcher.rank_monitor.rank_side.live import sdc_sim

LIMIT = float(2 ** 60)


class BackwardWatch:
    def __init__(self, params: List[Any], next_step: int, measure: bool = True, modules: List[Any] = ()) -> None:
        self.step = next_step            # the step whose backward runs next (the guard moves it on)
        self.measure = measure           # take the norms (False: the hooks only land a simulated fault)
        self.norms: List[Any] = []       # this window's per-gradient norms (device tensors)
        self.injected: Optional[str] = None
        self.handles: List[Any] = []
        sharded = fsdp_params(modules)   # id(sharded parameter) -> (its FSDPModule, its FSDPParam)
        waiting: Dict[int, tuple] = {}   # FSDPModule id -> (module, FSDPParams not yet unsharded)
        for p in params:
            if not p.requires_grad:
                continue
            if id(p) not in sharded:
                self.handles.append(p.register_hook(self._hook))
                continue
            module, fp = sharded[id(p)]
            unsharded = getattr(fp, "unsharded_param", None)   # (its requires_grad is set at each unshard)
            if unsharded is not None and unsharded.requires_grad:
                self.handles.append(unsharded.register_hook(self._hook))
            else:
                waiting.setdefault(id(module), (module, []))[1].append(fp)
        for module, fps in waiting.values():
            self._at_first_forward(module, fps)

    def _at_first_forward(self, module, fps) -> None:
        """Hooks `fps`' unsharded parameters once `module`'s forward made them (its all-gather; a
        frozen one is left)."""
        def hook(*_):
            handle.remove()
            self.handles.remove(handle)
            for fp in fps:
                unsharded = getattr(fp, "unsharded_param", None)
                if unsharded is None:   # another torch: no unsharded parameter where this one keeps it
                    _fallback("no unsharded parameter after the forward")
                elif unsharded.requires_grad:
                    self.handles.append(unsharded.register_hook(self._hook))

        handle = module.register_forward_hook(hook, always_call=True)
        self.handles.append(handle)

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


_SAID = [False]


def fsdp_params(modules) -> dict:
    """id(sharded parameter) -> (FSDPModule, FSDPParam) for every fully_shard module under
    `modules` ({} without FSDP2; {} and one line where torch's private parts are not as read)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return {}
    out: dict = {}
    for top in modules:
        for m in top.modules():
            if not isinstance(m, FSDPModule):
                continue
            try:
                state = m._get_fsdp_state()
                groups = getattr(state, "_fsdp_param_groups", None)
                if groups is None:
                    group = state._fsdp_param_group
                    groups = [group] if group is not None else []
                for group in groups:
                    for fp in group.fsdp_params:
                        out[id(fp.sharded_param)] = (m, fp)
            except Exception as exc:   # another torch: its FSDP2 internals differ
                _fallback(repr(exc))
                return {}
    return out


def _fallback(why: str) -> None:
    """One line (once a process, on rank 0): the watch does not see FSDP2's own gradients."""
    if not _SAID[0] and os.environ.get("RANK", "0") == "0":
        print(f"ft_launcher: the step guard's backward watch cannot reach FSDP2's unsharded gradients in "
              f"this torch ({why}): the guard checks the reduced gradients, a bad rank is not named",
              file=sys.stderr, flush=True)
    _SAID[0] = True


def bad(norm: float) -> bool:
    """A gradient norm that no healthy backward makes (NaN, Inf, or past LIMIT)."""
    return not (norm < LIMIT)
