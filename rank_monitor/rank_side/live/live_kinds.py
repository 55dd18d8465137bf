"""Live state, each kind of object behind one interface (`Form`): what its commit keeps, how its
committed state is read back, what a restore does with it. What changes outside `commit` must be
rolled back to the commit, so each kind keeps what it must:
- module (`ModuleForm`: a `torch.nn.Module` whose `state_dict()` returns views of its own
  parameters and buffers): parameters change only inside commit (the optimizer step), so they are
  read as they are (the state dict rebuilt from a key map made once, without calling state_dict()
  again; FSDP2's sharded DTensor parameters, also where a fault inside a forward or backward left
  the unsharded ones registered on the module); the persistent buffers (BatchNorm's running
  statistics, which every forward pass changes) and any `_extra_state` are copied at each commit
  into snapshots made once (`torch._foreach_copy_`). A module whose state_dict() returns copies
  (FSDP1's) becomes a snapshot at its setup.
- optimizer (`OptimizerForm`: a `torch.optim.Optimizer` that reads and loads its state as Optimizer
  does; a subclass with its own state_dict(), e.g. torchtitan's OptimizersContainer, is a
  snapshot): its state changes only in `step()`, inside commit; its param groups'
  hyperparameters (a scheduler may change the learning rate outside commit) are copied at each
  commit.
- anything else (`SnapshotForm`: a DCP `Stateful` such as PyTorch's recipe `AppState(model,
  optimizer)`, torchtitan's `ModelWrapper` and `OptimizersContainer`, a StatefulDataLoader, a
  sampler, a scheduler, a user's object, a module whose state_dict() returns copies such as
  FSDP1's): its `state_dict()` read at each commit, containers rebuilt; a tensor of it whose
  storage is one of the live tensors of the modules and optimizers the object holds
  (`LiveTensors`: parameters and optimizer state, found through its attributes as the step guard
  finds them) is kept as it is (read in place: it changes only inside commit), every other tensor
  is copied (buffers, a loader's or scheduler's tensors, copies its state_dict() makes) into the
  previous commit's copy where it fits.
- the RNG (`RngForm`, a snapshot: live_rng.Rng): its state_dict() is a new snapshot already, kept
  without a copy; Python's stream is left out of the comparison where nothing drew from it.
Each commit counts the bytes it copies and those it reads in place (`copied`, `in_place`); the
first commit's `note` says what is copied whole and why (LiveState says it in one line).
`form_for(name, obj)` picks an object's form; live_objects.Tracked holds it.
"""
from __future__ import annotations

import collections
from typing import Any, Callable, List, Optional, Tuple

from ft_launcher.rank_monitor.rank_side.live import live_wire as W
from ft_launcher.rank_monitor.rank_side.live.live_layout import distinct_meshes, identity_entries, layout_entries
from ft_launcher.rank_monitor.rank_side.live.live_rng import Rng
from ft_launcher.rank_monitor.rank_side.live.live_tensors import LiveTensors, nbytes, storage

MODULE, OPTIMIZER, SNAPSHOT = "module", "optimizer", "snapshot"

_NOTE_BYTES = 1 << 20   # a SNAPSHOT that copies less than this per commit is not said

_is_dtensor = W.is_dtensor


def form_for(name: str, obj: Any) -> "Form":
    """The form an object starts with (a module's may become a snapshot at its setup)."""
    import torch

    if isinstance(obj, torch.optim.Optimizer) and _own_state_dict(obj, torch.optim.Optimizer):
        return OptimizerForm(name, obj)
    if isinstance(obj, torch.nn.Module):
        return ModuleForm(name, obj)   # until setup finds that its state_dict returns copies
    if isinstance(obj, Rng):
        return RngForm(name, obj)
    return SnapshotForm(name, obj)


class Form:
    """One kind of object (module docstring): the interface every kind implements."""

    kind = ""
    state: Optional[dict] = None       # the committed state dict, where the form keeps it (a snapshot's)
    per_rank: frozenset = frozenset()  # keys of per-rank state that replicas do not compare

    def __init__(self, name: str, obj: Any, note: Optional[str] = None) -> None:
        self.name, self.obj = name, obj
        self.note = note             # a line to say once (a module kept by copies)
        self.copied = 0              # bytes the last commit copied (snapshot())
        self.in_place = 0            # bytes of tensors the last commit read in place (parameters, optimizer state)
        self.copied_paths: dict = {}  # the first commit's copied bytes by state-dict path (what each commit copies)

    def setup(self, sd) -> "Form":
        """Settle the form once, from `sd` (the state_dict() just read and checked): self, or the
        form that keeps this object instead."""
        return self

    def snapshot(self, first: bool) -> None:
        """What changes outside commit, as of now (the end of a commit; `first`: the first one)."""
        raise NotImplementedError

    def committed(self) -> dict:
        """The object's state dict as of the last commit (or the last restore)."""
        raise NotImplementedError

    def fresh(self, sd) -> Tuple[dict, list, list, list]:
        """A new object read once (`sd`: its state_dict()): (its own tensors by path, where a kept
        or received state lands in place; its layout; its shard identity; its DTensors' device
        meshes). Only modules and optimizers have destinations (anything else is received into new
        tensors and loaded)."""
        return {}, layout_entries(sd), identity_entries(sd), distinct_meshes(W.flat(sd).values())

    def loaded_in_place(self, state: dict, own: dict) -> bool:
        """Every tensor of `state` is already one of the object's own (`own`: fresh()'s): nothing
        left to load."""
        return False

    def before_load(self, state: dict) -> Optional[dict]:
        """What `adopt` takes after `state` is loaded."""
        return None

    def adopt(self, loaded: Optional[dict], commit: Callable[[], None]) -> None:
        """The state just loaded into the object is now its committed state (`loaded`:
        before_load's; `commit`: the holder's snapshot(), for a form that reads the object)."""
        commit()

    def comparable(self, state: dict) -> dict:
        """The part of a restored state that replicas must agree on."""
        return state

    def rewind(self, dry: bool = False) -> bool:
        """Put back what a forward and backward changed since the commit, for a step re-run in place
        (LiveState.commit's `run=`): the optimizer step has not run, so parameters and optimizer
        state are still the committed ones. -> False where this kind cannot (the re-run then goes
        through the restart); `dry`: only say whether it can."""
        return True


class ModuleForm(Form):
    """A module whose state_dict() returns views of its own parameters and buffers."""

    kind = MODULE

    def __init__(self, name: str, obj: Any) -> None:
        super().__init__(name, obj)
        self.buffers: List[Tuple[str, Any, str]] = []   # (state-dict key, owner module, buffer name)
        self.buffer_snaps: list = []
        self.extra: List[Tuple[str, Any]] = []          # (state-dict key, submodule) with _extra_state
        self.extra_snaps: list = []
        self.per_rank: set = set()   # keys of plain BatchNorm running statistics (per rank under DDP)
        self.entries: list = []      # (state-dict key, owner module, attribute, param|buffer|extra)
        self.sharded: dict = {}      # state-dict key -> its DTensor parameter (FSDP2's sharded one)
        self.metadata = None

    def setup(self, sd) -> Form:
        """Map each state-dict key to the parameter or buffer it is a view of (then its committed
        state is rebuilt from them without calling state_dict(): no hook, no collective), else (its
        state_dict() makes new tensors) keep it as a snapshot."""
        module = self.obj
        params, buffers = {}, {}
        for _, mod in module.named_modules():
            for pname, p in mod._parameters.items():
                if p is not None:
                    params[(W.local(p).data_ptr(), tuple(p.shape))] = (mod, pname)
            for bname, buf in mod._buffers.items():
                if buf is not None and bname not in mod._non_persistent_buffers_set:
                    buffers[(buf.data_ptr(), tuple(buf.shape))] = (mod, bname)
        entries = []
        for key, value in sd.items():
            if isinstance(key, str) and key.endswith("_extra_state"):
                prefix = key[:-len("_extra_state")].rstrip(".")
                self.extra.append((key, module.get_submodule(prefix) if prefix else module))
                entries.append((key, None, None, "extra"))
                continue
            where = (W.local(value).data_ptr(), tuple(value.shape)) if hasattr(value, "shape") else None
            if where in params:
                entries.append((key, *params[where], "param"))
                mod, pname = params[where]
                if _is_dtensor(mod._parameters[pname]):
                    self.sharded[key] = mod._parameters[pname]
            elif where in buffers:
                mod, bname = buffers[where]
                self.buffers.append((key, mod, bname))
                if _plain_batchnorm(mod):
                    self.per_rank.add(key)
                entries.append((key, mod, bname, "buffer"))
            else:   # its state_dict() builds new tensors (FSDP1): copy it at every commit
                note = (f"'{self.name}': its state_dict() returns copies, not its own tensors (FSDP1?): it is "
                        f"copied at every commit")
                return SnapshotForm(self.name, self.obj, note).setup(sd)
        self.entries, self.metadata = entries, getattr(sd, "_metadata", None)
        return self

    def snapshot(self, first: bool) -> None:
        import torch

        if self.buffers:
            now = [mod._buffers[b] for _, mod, b in self.buffers]
            snaps = self.buffer_snaps
            if len(snaps) != len(now) or any(s.shape != t.shape or s.dtype != t.dtype or s.device != t.device
                                             for s, t in zip(snaps, now)):
                self.buffer_snaps = [t.detach().clone() for t in now]
            else:
                torch._foreach_copy_(snaps, [t.detach() for t in now])
        if self.extra:
            self.extra_snaps = [W.copy(mod.get_extra_state()) for _, mod in self.extra]
        self.copied = (sum(nbytes(t) for t in self.buffer_snaps)
                       + sum(nbytes(t) for t in W.flat(self.extra_snaps).values()))
        if first:
            self.in_place = sum(nbytes(mod._parameters[a]) for _, mod, a, k in self.entries
                                if k == "param" and mod._parameters.get(a) is not None)

    def committed(self) -> dict:
        sd = collections.OrderedDict()
        buffers, extras = iter(self.buffer_snaps), iter(self.extra_snaps)
        for key, mod, attr, kind in self.entries:
            if kind == "param":
                p = mod._parameters.get(attr)
                own = self.sharded.get(key)
                if own is not None and p is not own and not _same_sharding(p, own):
                    # FSDP2 registers its unsharded parameters during a module's forward and backward: a
                    # fault there leaves them on the module; the state is the sharded parameter's
                    p = own
                if p is None:   # the module changed since: read it as it is
                    return self.obj.state_dict()
                sd[key] = p.detach()
            else:
                sd[key] = next(buffers) if kind == "buffer" else next(extras)
        if self.metadata is not None:
            sd._metadata = self.metadata
        return sd

    def fresh(self, sd) -> Tuple[dict, list, list, list]:
        _, layout, ident, meshes = super().fresh(sd)
        return W.flat(sd), layout, ident, meshes

    def loaded_in_place(self, state: dict, own: dict) -> bool:
        """A module whose every tensor arrived in its own tensors (kept or received in place)."""
        return not self.extra and len(own) == len(W.flat(state)) and all(own.get(p) is t
                                                                         for p, t in W.flat(state).items())

    def rewind(self, dry: bool = False) -> bool:
        """The buffers (BatchNorm's statistics, which the forward moved) and extra states back to the
        commit's snapshots."""
        import torch

        if dry or not self.buffer_snaps and not self.extra_snaps:
            return True
        if self.buffer_snaps:
            torch._foreach_copy_([mod._buffers[b] for _, mod, b in self.buffers], self.buffer_snaps)
        for (_, mod), snap in zip(self.extra, self.extra_snaps):
            mod.set_extra_state(W.copy(snap))
        return True

    def comparable(self, state: dict) -> dict:
        """Its per-rank BatchNorm statistics left out: DDP overwrites them from rank 0 at the next forward."""
        if not self.per_rank:
            return state
        return {k: v for k, v in state.items() if k not in self.per_rank}


class OptimizerForm(Form):
    """An optimizer that reads and loads its state as torch.optim.Optimizer does."""

    kind = OPTIMIZER

    def __init__(self, name: str, obj: Any) -> None:
        super().__init__(name, obj)
        self.groups: Optional[list] = None   # param groups' hyperparameters

    def snapshot(self, first: bool) -> None:
        import torch

        self.groups = [{k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                        for k, v in g.items() if k != "params"} for g in self.obj.param_groups]
        self.copied = sum(nbytes(v) for g in self.groups for v in g.values() if isinstance(v, torch.Tensor))
        if first:
            self.in_place = sum(nbytes(v) for s in self.obj.state.values() for v in s.values()
                                if isinstance(v, torch.Tensor))

    def committed(self) -> dict:
        sd = self.obj.state_dict()
        for group, saved in zip(sd["param_groups"], self.groups or []):
            group.update(saved)
        return sd

    def fresh(self, sd) -> Tuple[dict, list, list, list]:
        """Its layout and identity are its parameters' (a fresh optimizer has no state yet)."""
        params = [[p for p in g["params"]] for g in self.obj.param_groups]
        meshes = distinct_meshes([p for group in params for p in group])
        layout = [[(tuple(W.local(p).shape), str(p.dtype)) for p in group] for group in params]
        ident = identity_entries({i: {j: p for j, p in enumerate(group)} for i, group in enumerate(params)})
        return W.flat(sd), layout, ident, meshes


class SnapshotForm(Form):
    """Anything else with state_dict() / load_state_dict(): its state dict kept at each commit."""

    kind = SNAPSHOT

    def __init__(self, name: str, obj: Any, note: Optional[str] = None) -> None:
        super().__init__(name, obj, note)
        self.live: Optional[LiveTensors] = None   # the live tensors it holds (read in place)
        self._copies: dict = {}      # path -> the copy the last commit made (reused when it fits)

    def setup(self, sd) -> Form:
        self.live = LiveTensors.find(self.obj)
        return self

    def rewind(self, dry: bool = False) -> bool:
        """Nothing to put back where it holds no module's buffers (a loader, a sampler, a scheduler:
        the forward and backward do not move them; an AppState whose modules have none); one that
        holds persistent buffers (copies of them at each commit) is not rewound here. A GradScaler
        forgets this step's unscale_ (the re-run unscales again)."""
        steps = getattr(self.obj, "_per_optimizer_states", None)   # torch.amp.GradScaler's, per step
        if not dry and isinstance(steps, dict):
            steps.clear()
        if self.live is None:
            return True
        return not any(b is not None and name not in sub._non_persistent_buffers_set
                       for m in self.live.modules for sub in m.modules() for name, b in sub._buffers.items())

    def snapshot(self, first: bool) -> None:
        import torch

        try:
            with torch.no_grad():
                self._keep(self.obj.state_dict(), first)
        except W.Refused as exc:
            exc.name = self.name
            raise

    def _keep(self, sd, first: bool) -> None:
        """A commit's state: `sd` (its state_dict() just read) with each tensor that is one of its
        live tensors kept as it is and every other one copied (into the previous commit's copy of
        that path where shape, dtype and device fit: no new allocation per step)."""
        live = self.live.storages() if self.live is not None else {}
        previous, copies = self._copies, {}
        counts = [0, 0]   # copied, read in place

        def keep(path, t):
            data = W.local(t)
            size = nbytes(data)
            if live and storage(t) in live:
                counts[1] += size
                return t
            counts[0] += size
            if first:
                self.copied_paths[W.path_text(path)] = size
            old = previous.get(path)
            if (old is not None and not _is_dtensor(t) and not _is_dtensor(old) and old.shape == t.shape
                    and old.dtype == t.dtype and old.device == t.device):
                old.copy_(t.detach())
                copy = old
            else:
                copy = t.detach().clone()
            copies[path] = copy
            return copy

        self.state = W.walk(sd, keep)
        self._copies = copies
        self.copied, self.in_place = counts
        if first and not self.note:
            self.note = self._copied_note(sd)

    def _copied_note(self, sd) -> Optional[str]:
        """What a commit copies whole and why (None when that is only small state: a loader's or
        scheduler's position, buffers)."""
        if self.copied < _NOTE_BYTES:
            return None
        if self.live is None:
            return (f"'{self.name}': its state dict ({_mb(self.copied)}) is copied at every commit: it holds no "
                    f"module or optimizer whose tensors could be read in place")
        buffers = self.live.buffer_storages()
        live = self.live.storages()
        made = sum(nbytes(W.local(t)) for t in W.flat(sd).values()
                   if storage(t) not in live and storage(t) not in buffers)
        if made < _NOTE_BYTES:
            return None
        return (f"'{self.name}': {_mb(made)} of its state dict are copies that its state_dict() makes, not the "
                f"parameters' or optimizer's own tensors (full_state_dict or cpu_offload options? FSDP1? a state_dict "
                f"hook that builds new tensors?): they are "
                f"copied at every commit")

    def committed(self) -> dict:
        return self.state

    def before_load(self, state: dict) -> Optional[dict]:
        """A copy made before load_state_dict, which may change the dict or the tensors it is
        handed; one that holds live tensors: its containers only, its tensors copied at adopt where
        the loaded object does not hold them in place."""
        if self.live is not None:
            return W.walk(state, lambda path, t: t)
        return W.copy(state)

    def adopt(self, loaded: Optional[dict], commit: Callable[[], None]) -> None:
        """`loaded` is its committed state (a loader reports its new position only once it iterates,
        so its committed state is what was loaded, not what it says now)."""
        import torch

        self.state = loaded
        if self.live is not None:   # what was loaded, read in place where the object's live tensors hold it
            with torch.no_grad():
                self.live.refresh()
                self.state = self._in_place(loaded)
        if isinstance(self.obj, torch.utils.data.DataLoader) and hasattr(self.obj, "load_state_dict"):
            # A StatefulDataLoader makes its iterator now, from the loaded state (state_dict()
            # does; the script's iter() then continues it): making one draws a seed from torch's
            # generator, which must happen before the RNG state is loaded, as in a run without
            # the restart (there the iterator was made at the top of its epoch).
            self.obj.state_dict()

    def _in_place(self, loaded: dict) -> dict:
        """The committed state of an object just loaded with `loaded`: the object's own tensor at
        each path where its state dict holds one of its live tensors (read once more: the loaded
        object's parameters and optimizer state), a copy of the loaded tensor elsewhere."""
        live = self.live.storages()
        now = W.flat(self.obj.state_dict())
        copies = {}

        def keep(path, t):
            own = now.get(path)
            if own is not None and storage(own) in live and tuple(own.shape) == tuple(t.shape):
                return own
            copies[path] = t.detach().clone()
            return copies[path]

        state = W.walk(loaded, keep)
        self._copies = copies
        return state


class RngForm(SnapshotForm):
    """The RNG (live_rng.Rng): its state_dict() is a new snapshot already (its generators' tensors,
    top-level), kept without a copy or a walk of Python's 625-int state (0.4 ms a commit)."""

    def setup(self, sd) -> Form:
        return self

    def _keep(self, sd, first: bool) -> None:
        import torch

        self.state, self.in_place = sd, 0
        self.copied = sum(nbytes(t) for t in sd.values() if isinstance(t, torch.Tensor))

    def rewind(self, dry: bool = False) -> bool:
        """The generators back to the commit (the re-run draws the same dropout masks)."""
        if not dry and self.state is not None:
            self.obj.load_state_dict(self.state)
        return True

    def comparable(self, state: dict) -> dict:
        """Python's `random` left out where nothing drew from it (Rng.unused)."""
        return Rng.unused(state)


def _same_sharding(a, b) -> bool:
    """Two DTensors on equal meshes with the same placements."""
    return _is_dtensor(a) and _is_dtensor(b) and a.device_mesh == b.device_mesh and a.placements == b.placements


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} KB"


def _own_state_dict(obj, base) -> bool:
    """`obj` reads and loads its state as `base` does (an optimizer subclass such as torchtitan's
    OptimizersContainer, whose state_dict() is DCP's flattened one, does not: it is a snapshot)."""
    return all(getattr(type(obj), fn, None) is getattr(base, fn) for fn in ("state_dict", "load_state_dict"))


def _plain_batchnorm(mod) -> bool:
    """BatchNorm whose running statistics each rank updates from its own batch (not SyncBatchNorm):
    under DDP they are per rank, and DDP broadcasts rank 0's at the start of every forward."""
    import torch

    return (isinstance(mod, torch.nn.modules.batchnorm._NormBase) and not isinstance(mod, torch.nn.SyncBatchNorm)
            and getattr(mod, "track_running_stats", False))
