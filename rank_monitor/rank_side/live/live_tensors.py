"""The tensors of an object that change only inside commit, read in place at each commit: its
modules' parameters and its optimizers' parameters and state (LiveTensors, by storage), and the
storage address and byte count of a tensor (a DTensor's: its local shard's)."""
from __future__ import annotations

from typing import Optional

from ft_launcher.rank_monitor.rank_side.live import live_wire as W


def storage(t) -> int:
    data = W.local(t)
    try:
        return data.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):   # e.g. a meta or fake tensor
        return -1



def nbytes(t) -> int:
    data = W.local(t)
    return data.numel() * data.element_size()



class LiveTensors:
    """The tensors that change only inside commit among those an object holds: its modules'
    parameters and its optimizers' parameters and state (found through its attributes, as the step
    guard finds them: guard_targets), by storage. `storages()` maps each one's storage address to the
    tensor itself (held: an address in the map is that storage's while the map lives); it is found
    again when the optimizers' state grows (a new parameter's state) and after a load (`refresh`)."""

    def __init__(self, modules: list, optimizers: list) -> None:
        self.modules, self.optimizers = modules, optimizers
        self._map: Optional[dict] = None
        self._sig: Optional[tuple] = None

    @classmethod
    def find(cls, obj) -> Optional["LiveTensors"]:
        from ft_launcher.rank_monitor.rank_side.live import guard_targets

        found = guard_targets.find({"obj": obj})
        if not found.modules and not found.optimizers:
            return None
        return cls(found.modules, found.optimizers)

    def _signature(self) -> tuple:
        return tuple(len(o.state) for o in self.optimizers)

    def refresh(self) -> None:
        self._map = None

    def storages(self) -> dict:
        import torch

        sig = self._signature()
        if self._map is not None and sig == self._sig:
            return self._map
        with torch.no_grad():
            self._map, self._sig = self._find(), sig
        return self._map

    def _find(self) -> dict:
        import torch

        out = {}
        for m in self.modules:
            for p in m.parameters():
                out[storage(p)] = p
        for o in self.optimizers:
            for g in o.param_groups:
                for p in g["params"]:
                    out[storage(p)] = p
            for state in o.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor):
                        out[storage(v)] = v
        out.pop(-1, None)
        out.pop(0, None)   # an empty tensor's storage has no address
        return out

    def buffer_storages(self) -> set:
        return {storage(b) for m in self.modules for b in m.buffers()}
