"""Live state, one object: its state as of the last commit, kept at a small per-step cost.

`Tracked(name, obj)` wraps one object of a LiveState. What changes outside `commit` must be rolled
back to the commit, so each kind keeps what it must:
- module (`torch.nn.Module` whose `state_dict()` returns views of its own parameters and buffers):
  parameters change only inside commit (the optimizer step), so they are read as they are (the
  state dict rebuilt from a key map made once, without calling state_dict() again; FSDP2's sharded
  DTensor parameters, also where a fault inside a forward or backward left the unsharded ones
  registered on the module); the
  persistent buffers (BatchNorm's running statistics, which every forward pass changes) and any
  `_extra_state` are copied at each commit into snapshots made once (`torch._foreach_copy_`).
- optimizer (`torch.optim.Optimizer` that reads and loads its state as Optimizer does; a subclass
  with its own state_dict(), e.g. torchtitan's OptimizersContainer, is a snapshot): its state
  changes only in `step()`, inside commit; its
  param groups' hyperparameters (a scheduler may change the learning rate outside commit) are
  copied at each commit.
- anything else (a DCP `Stateful` such as PyTorch's recipe `AppState(model, optimizer)`, torchtitan's
  `ModelWrapper` and `OptimizersContainer`, a StatefulDataLoader, a sampler, a scheduler, RNG, a
  user's object, a module whose state_dict() returns copies such as FSDP1's): its `state_dict()`
  read at each commit, containers rebuilt; a tensor of it whose storage is one of the live tensors
  of the modules and optimizers the object holds (`LiveTensors`: parameters and optimizer state,
  found through its attributes as the step guard finds them) is kept as it is (read in place:
  it changes only inside commit), every other tensor is copied (buffers, a loader's or scheduler's
  tensors, copies its state_dict() makes) into the previous commit's copy where it fits.
Each commit counts the bytes it copies and those it reads in place (`copied`, `in_place`); the
first commit's `note` says what is copied whole and why (LiveState says it in one line).

`committed()` is the state dict as of the last commit (a module's and an optimizer's read from
the object, without a collective); `fresh()` reads a new object once (its own tensors, where a
received or kept state lands in place, and its layout and shard identity: the step exchange
compares those); `bind(state, meshes)` puts a kept or received state's DTensors on this call's
device meshes (a kept rank's are on the previous call's, whose process groups are gone);
`place(path, data, spec)` makes a received tensor that the sender held as a DTensor this rank's
DTensor (on its own mesh: where the sender's spec says, live_wire.dtensor_spec); `adopt(state)`
makes a state just loaded into the object its committed state.
`setup()` checks, once (at the first restore() or commit), that the state can be sent and compared
(live_wire.check) and settles the kind; a state that cannot be sent raises live_wire.Refused there,
not at the first heal.
"""
from __future__ import annotations

import collections
from typing import Any, List, Optional, Tuple

from ft_launcher.rank_monitor.rank_side.live import live_wire as W
from ft_launcher.rank_monitor.rank_side.live.live_layout import distinct_meshes, identity_entries, layout_entries
from ft_launcher.rank_monitor.rank_side.live.live_rng import Rng
from ft_launcher.rank_monitor.rank_side.live.live_tensors import LiveTensors, nbytes, storage

MODULE, OPTIMIZER, SNAPSHOT = "module", "optimizer", "snapshot"


_is_dtensor = W.is_dtensor


def _same_sharding(a, b) -> bool:
    """Two DTensors on equal meshes with the same placements."""
    return _is_dtensor(a) and _is_dtensor(b) and a.device_mesh == b.device_mesh and a.placements == b.placements


def _fewer_replicas(old, new, placements) -> bool:
    """`new` is `old` with other sizes only on the dimensions the placements replicate (an elastic
    job that lost or gained whole replicas): the same device type, dimension names and number, and
    the same size on every sharded dimension, so a local shard means the same part on both."""
    if (str(old.device_type) != str(new.device_type) or old.mesh_dim_names != new.mesh_dim_names
            or len(old.shape) != len(new.shape) or len(placements) != len(old.shape)):
        return False
    return all(p.is_replicate() or old.shape[d] == new.shape[d] for d, p in enumerate(placements))


class Unbound(W.LayoutMismatch):
    """A kept or received DTensor whose device mesh has no equal among this call's objects' meshes."""


class Tracked:
    """One object of a LiveState and its state as of the last commit (module docstring)."""

    def __init__(self, name: str, obj: Any) -> None:
        import torch

        self.name, self.obj = name, obj
        if isinstance(obj, torch.optim.Optimizer) and _own_state_dict(obj, torch.optim.Optimizer):
            self.kind = OPTIMIZER
        elif isinstance(obj, torch.nn.Module):
            self.kind = MODULE   # until first_commit finds that its state_dict returns copies
        else:
            self.kind = SNAPSHOT
        self.ready = False             # setup ran: the state was checked, the kind settled
        self.note: Optional[str] = None   # a line to say once (a module kept by copies)
        self.state: Optional[dict] = None   # SNAPSHOT: the committed state dict
        self.buffers: List[Tuple[str, Any, str]] = []   # MODULE: (state-dict key, owner module, buffer name)
        self.buffer_snaps: list = []
        self.extra: List[Tuple[str, Any]] = []          # MODULE: (state-dict key, submodule) with _extra_state
        self.extra_snaps: list = []
        self.per_rank: set = set()   # MODULE: keys of plain BatchNorm running statistics (per rank under DDP)
        self.entries: list = []      # MODULE: (state-dict key, owner module, attribute, param|buffer|extra)
        self.sharded: dict = {}      # MODULE: state-dict key -> its DTensor parameter (FSDP2's sharded one)
        self.metadata = None
        self.groups: Optional[list] = None              # OPTIMIZER: param groups' hyperparameters
        self.meshes: list = []       # the device meshes of the new object's DTensors (read by fresh())
        self.placed: dict = {}       # path -> (mesh, placements) of the new object's state's DTensors (fresh())
        self.live: Optional[LiveTensors] = None   # SNAPSHOT: the live tensors it holds (read in place)
        self.copied = 0              # bytes the last commit copied (snapshot())
        self.in_place = 0            # bytes of tensors the last commit read in place (parameters, optimizer state)
        self._copies: dict = {}      # SNAPSHOT: path -> the copy the last commit made (reused when it fits)
        self.copied_paths: dict = {}  # the first commit's copied bytes by state-dict path (what each commit copies)
        self.snapped = False         # snapshot() ran (a commit or an adopt)

    # ---- set up once: check the state and settle the kind -------------------------------------
    def setup(self, sd=None) -> None:
        """Check the state once (Refused, with this object's name, if a peer could not receive it)
        and settle the kind; `sd`: its state_dict() if just read."""
        sd = self.obj.state_dict() if sd is None else sd
        try:
            W.check(sd)
        except W.Refused as exc:
            exc.name = self.name
            raise
        if self.kind == MODULE:
            self._find_buffers(sd)
        if self.kind == SNAPSHOT and not isinstance(self.obj, Rng):
            self.live = LiveTensors.find(self.obj)
        self.ready = True

    def _find_buffers(self, sd) -> None:
        """A module: map each state-dict key to the parameter or buffer it is a view of (then its
        committed state is rebuilt from them without calling state_dict(): no hook, no collective),
        else (its state_dict() makes new tensors) keep it as a snapshot."""
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
                self.kind, self.buffers, self.extra, self.per_rank, self.sharded = SNAPSHOT, [], [], set(), {}
                self.note = (f"'{self.name}': its state_dict() returns copies, not its own tensors (FSDP1?): it is "
                             f"copied at every commit")
                return
        self.entries, self.metadata = entries, getattr(sd, "_metadata", None)

    # ---- every commit ---------------------------------------------------------------------------
    def snapshot(self) -> None:
        """What changes outside commit, as of now (the end of a commit)."""
        import torch

        if not self.ready:
            self.setup()
        first, self.snapped = not self.snapped, True   # (setup may have run at fresh(): the first describe)
        if self.kind == SNAPSHOT:
            try:
                with torch.no_grad():
                    self._snapshot_state(self.obj.state_dict(), first)
            except W.Refused as exc:
                exc.name = self.name
                raise
        elif self.kind == OPTIMIZER:
            self.groups = [{k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                            for k, v in g.items() if k != "params"} for g in self.obj.param_groups]
            self.copied = sum(nbytes(v) for g in self.groups for v in g.values() if isinstance(v, torch.Tensor))
            if first:
                self.in_place = sum(nbytes(v) for s in self.obj.state.values() for v in s.values()
                                    if isinstance(v, torch.Tensor))
        else:
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

    def _snapshot_state(self, sd, first: bool) -> None:
        """A SNAPSHOT's commit: `sd` (its state_dict() just read) with each tensor that is one of its
        live tensors kept as it is and every other one copied (into the previous commit's copy of
        that path where shape, dtype and device fit: no new allocation per step)."""
        import torch

        if isinstance(self.obj, Rng):   # its state_dict() is a new snapshot already
            # (its generators' tensors, top-level: no walk of Python's 625-int state, 0.4 ms a commit)
            self.state, self.in_place = sd, 0
            self.copied = sum(nbytes(t) for t in sd.values() if isinstance(t, torch.Tensor))
            return
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
        """What a SNAPSHOT's commit copies whole and why (None when that is only small state: a
        loader's or scheduler's position, buffers)."""
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
        """The object's state dict as of the last commit (or the last restore)."""
        if self.kind == SNAPSHOT:
            return self.state
        if self.kind == OPTIMIZER:
            sd = self.obj.state_dict()
            for group, saved in zip(sd["param_groups"], self.groups or []):
                group.update(saved)
            return sd
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

    # ---- restore --------------------------------------------------------------------------------
    def fresh(self) -> Tuple[dict, list, list]:
        """A new object, read once: (its own tensors by path: where a kept or received state lands
        in place; its layout; its shard identity). Only modules and optimizers have destinations
        (anything else is received into new tensors and loaded)."""
        sd = self.obj.state_dict()
        if not self.ready:
            self.setup(sd)
        self.placed = {path: (t.device_mesh, t.placements) for path, t in W.flat(sd).items() if _is_dtensor(t)}
        if self.kind == OPTIMIZER:
            params = [[p for p in g["params"]] for g in self.obj.param_groups]
            self.meshes = distinct_meshes([p for group in params for p in group])
            layout = [[(tuple(W.local(p).shape), str(p.dtype)) for p in group] for group in params]
            ident = identity_entries({i: {j: p for j, p in enumerate(group)} for i, group in enumerate(params)})
            return W.flat(sd), layout, ident
        dests = W.flat(sd) if self.kind == MODULE else {}
        self.meshes = distinct_meshes(W.flat(sd).values())
        return dests, layout_entries(sd), identity_entries(sd)

    def bind(self, state: dict, meshes: list) -> dict:
        """A state about to be loaded, bound to this call's device meshes (`meshes`: those of this
        LiveState's new objects). A kept rank's previous objects' DTensors (an optimizer's state is
        handed over, not copied) are on the previous call's mesh, whose process groups are gone:
        each is rebuilt on the equal mesh of this call (its local data, placements and shape; no
        copy). Raises Unbound where a DTensor's mesh has no equal among `meshes` (it cannot be
        bound exactly)."""
        from torch.distributed.tensor import DTensor

        def bound(path, t):
            if not _is_dtensor(t):
                return t
            mesh = t.device_mesh
            if any(mesh is m for m in meshes):
                return t
            for m in sorted(meshes, key=lambda m: m != mesh):   # an equal mesh first, else one of fewer replicas
                if m == mesh or _fewer_replicas(mesh, m, t.placements):
                    return DTensor.from_local(t.to_local(), m, t.placements, run_check=False, shape=t.shape,
                                              stride=t.stride())
            raise Unbound(f"'{self.name}' holds a DTensor at {W.path_text(path)} on {mesh}, a device mesh "
                          f"that this call's objects do not have")

        return W.walk(state, bound)

    def place(self, path: tuple, data, spec: tuple):
        """A received tensor that the sender held as a DTensor (`spec`: live_wire.dtensor_spec), as
        this rank's DTensor: `data` (its local shard) on the mesh of this object's own DTensor at
        that path where it has one with those placements (a module's, an optimizer's, any state
        dict's), else on this call's mesh with the sender's rank grid, else on its only mesh of
        that shape and dimension names (a fresh optimizer has no state yet: its parameters' mesh).
        Raises Unbound where none fits."""
        from torch.distributed.tensor import DTensor

        placements = W.placements(spec)
        own = self.placed.get(path)
        mesh = own[0] if own is not None and tuple(own[1]) == placements else None
        names = spec[W.MESH_NAMES]

        def alike(m):
            return (str(m.device_type) == spec[W.MESH_TYPE] and (tuple(m.mesh_dim_names) if m.mesh_dim_names
                                                                  else None) == names)
        if mesh is None:
            same = [m for m in self.meshes if alike(m) and W.mesh_grid(m.mesh.tolist()) == spec[W.MESH_GRID]]
            shape = tuple(W.grid_shape(spec[W.MESH_GRID]))
            shaped = [m for m in self.meshes if alike(m) and tuple(m.mesh.shape) == shape]
            mesh = same[0] if same else shaped[0] if len(shaped) == 1 else None
        if mesh is None:
            raise Unbound(f"'{self.name}' received {W.spec_text(spec)} at {W.path_text(path)}, and this call's "
                          f"objects have no such device mesh")
        return DTensor.from_local(data, mesh, placements, run_check=False, shape=spec[W.SHAPE],
                                  stride=spec[W.STRIDE])

    def adopt(self, loaded: Optional[dict]) -> None:
        """The state just loaded into the object is now its committed state. `loaded`: a copy
        of it made before load_state_dict (SNAPSHOT: a loader reports its new position only once
        it iterates, so its committed state is what was loaded, not what it says now)."""
        import torch

        if self.kind == SNAPSHOT:
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
        else:
            self.snapshot()

    def before_load(self, state: dict) -> Optional[dict]:
        """What `adopt` takes after `state` is loaded (a SNAPSHOT's: a copy made before
        load_state_dict, which may change the dict or the tensors it is handed; one that holds
        live tensors: its containers only, its tensors copied at adopt where the loaded object does
        not hold them in place)."""
        if self.kind != SNAPSHOT:
            return None
        if self.live is not None:
            return W.walk(state, lambda path, t: t)
        return W.copy(state)

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


_NOTE_BYTES = 1 << 20   # a SNAPSHOT that copies less than this per commit is not said


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


def comparable(tracked: "Tracked", state: dict) -> dict:
    """The part of a restored state that replicas must agree on (a module's per-rank BatchNorm
    statistics left out: DDP overwrites them from rank 0 at the next forward; Python's `random`
    left out where nothing drew from it: Rng.unused)."""
    if isinstance(tracked.obj, Rng):
        return Rng.unused(state)
    if tracked.kind != MODULE or not tracked.per_rank:
        return state
    return {k: v for k, v in state.items() if k not in tracked.per_rank}


def load_order(names) -> List[str]:
    """Objects load in name order, the RNG state last (loading a loader may draw from it)."""
    return sorted(names, key=lambda n: (n == "_rng", n))

