"""What the step guard checks, found in a LiveState's objects whatever their form: the parameters
the optimizers will update (their gradients), the optimizer state, and a GradScaler.

Objects are searched as users hand them (docs/live-state.md): a module and an optimizer directly
(`model=`, `optimizer=`), or inside a `Stateful` that holds them as attributes (PyTorch's DCP
recipe `AppState(model, optimizer)`; torchtitan's `ModelWrapper.model` list of model parts and
`OptimizersContainer.optimizers`), at most three attributes deep. A DDP or FSDP wrapper's
parameters are the module's own. A DTensor counts by its local shard (this rank's part).
`Targets.params` are what the optimizers update (else the modules' trainable parameters):
their `.grad` is what the guard checks and what a skipped batch drops; `Targets.state` adds the
optimizers' tensors (exp_avg, exp_avg_sq, step, ...): what the replica fingerprint digests.
"""
from __future__ import annotations

from typing import Any, List


class Targets:
    def __init__(self) -> None:
        self.modules: List[Any] = []
        self.optimizers: List[Any] = []
        self.scalers: List[Any] = []
        self.params: List[Any] = []

    @property
    def found(self) -> bool:
        return bool(self.params)

    def grads(self) -> list:
        return [_local(p.grad) for p in self.params if p.grad is not None]

    def state(self) -> list:
        """The committed state's tensors that replicas must hold bit-equal: parameters and the
        optimizers' per-parameter state (local shards)."""
        out = [_local(p.detach()) for p in self.params]
        for opt in self.optimizers:
            for p in _opt_params(opt):
                for value in opt.state.get(p, {}).values():
                    if hasattr(value, "dtype"):
                        out.append(_local(value))
        return out

    def scaler_enabled(self) -> bool:
        return any(getattr(s, "is_enabled", lambda: False)() for s in self.scalers)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _opt_params(opt) -> list:
    return [p for g in getattr(opt, "param_groups", []) for p in g["params"]]


def find(objects: dict) -> Targets:
    """The guard's targets among a LiveState's objects (see the module docstring)."""
    import torch

    out, seen = Targets(), set()

    def visit(obj: Any, depth: int) -> None:
        if obj is None or id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, torch.Tensor)):
            return
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            out.modules.append(obj)
            return
        inner = getattr(obj, "optimizers", None)   # a container of optimizers (torchtitan's)
        if isinstance(inner, (list, tuple)) and inner and all(isinstance(o, torch.optim.Optimizer) for o in inner):
            for o in inner:
                visit(o, depth)
            return
        if isinstance(obj, torch.optim.Optimizer):
            out.optimizers.append(obj)
            return
        if type(obj).__name__ == "GradScaler" and callable(getattr(obj, "unscale_", None)):
            out.scalers.append(obj)
            return
        if depth >= 3:
            return
        if isinstance(obj, (list, tuple)):
            for x in obj:
                visit(x, depth + 1)
        elif isinstance(obj, dict):
            for x in obj.values():
                visit(x, depth + 1)
        elif hasattr(obj, "__dict__"):
            for x in vars(obj).values():
                visit(x, depth + 1)

    for obj in objects.values():
        visit(obj, 0)
    params, ids = [], set()
    sources = [_opt_params(o) for o in out.optimizers] or [
        [p for p in m.parameters() if p.requires_grad] for m in out.modules]
    for group in sources:
        for p in group:
            if id(p) not in ids:
                ids.add(id(p))
                params.append(p)
    out.params = params
    return out
