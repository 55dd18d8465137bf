"""Live state, one object: its state as of the last commit, kept at a small per-step cost.

`Tracked(name, obj)` holds one object of a LiveState and the form that keeps its state
(live_kinds: a module, an optimizer, anything else with state_dict() / load_state_dict() as a
snapshot, the RNG); a module's form becomes a snapshot at setup where its state_dict() returns
copies (FSDP1). Each commit counts the bytes it copies and those it reads in place (`copied`,
`in_place`); the first commit's `note` says what is copied whole and why (LiveState says it in one
line).

`committed()` is the state dict as of the last commit (a module's and an optimizer's read from
the object, without a collective); `fresh()` reads a new object once (its own tensors, where a
received or kept state lands in place, and its layout and shard identity: the step exchange
compares those); `bind(state, meshes)` puts a kept or received state's DTensors on this call's
device meshes (a kept rank's are on the previous call's, whose process groups are gone);
`place(path, data, spec)` makes a received tensor that the sender held as a DTensor this rank's
DTensor (on its own mesh: where the sender's spec says, live_wire.dtensor_spec); `adopt(state)`
makes a state just loaded into the object its committed state; `comparable(state)` is the part of
a restored state that replicas must agree on.
`setup()` checks, once (at the first restore() or commit), that the state can be sent and compared
(live_wire.check) and settles the kind; a state that cannot be sent raises live_wire.Refused there,
not at the first heal.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

from ft_launcher.rank_monitor.rank_side.live import live_kinds
from ft_launcher.rank_monitor.rank_side.live import live_wire as W

_is_dtensor = W.is_dtensor


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
    """One object of a LiveState, and the form that keeps its state as of the last commit (module
    docstring)."""

    def __init__(self, name: str, obj: Any) -> None:
        self.name, self.obj = name, obj
        self.form: live_kinds.Form = live_kinds.form_for(name, obj)
        self.ready = False           # setup ran: the state was checked, the kind settled
        self.meshes: list = []       # the device meshes of the new object's DTensors (read by fresh())
        self.placed: dict = {}       # path -> (mesh, placements) of the new object's state's DTensors (fresh())
        self.snapped = False         # snapshot() ran (a commit or an adopt)

    @property
    def kind(self) -> str:
        """live_kinds.MODULE, OPTIMIZER or SNAPSHOT (part of the object's layout digest)."""
        return self.form.kind

    @property
    def note(self) -> Optional[str]:
        """A line to say once (a module kept by copies; a snapshot that copies much)."""
        return self.form.note

    @property
    def copied(self) -> int:
        """Bytes the last commit copied."""
        return self.form.copied

    @property
    def in_place(self) -> int:
        """Bytes of tensors the last commit read in place (parameters, optimizer state)."""
        return self.form.in_place

    @property
    def copied_paths(self) -> dict:
        """The first commit's copied bytes by state-dict path (what each commit copies)."""
        return self.form.copied_paths

    @property
    def per_rank(self):
        """Keys of per-rank state that replicas do not compare (a module's plain BatchNorm statistics)."""
        return self.form.per_rank

    @property
    def state(self) -> Optional[dict]:
        """The committed state dict where the form keeps it itself (a snapshot's), else None."""
        return self.form.state

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
        self.form = self.form.setup(sd)
        self.ready = True

    # ---- every commit ---------------------------------------------------------------------------
    def snapshot(self) -> None:
        """What changes outside commit, as of now (the end of a commit)."""
        if not self.ready:
            self.setup()
        first, self.snapped = not self.snapped, True   # (setup may have run at fresh(): the first describe)
        self.form.snapshot(first)

    def committed(self) -> dict:
        """The object's state dict as of the last commit (or the last restore)."""
        return self.form.committed()

    def rewind(self, dry: bool = False) -> bool:
        """What a forward and backward changed, back to the last commit (a step re-run in place):
        False where this kind cannot (live_kinds.Form.rewind)."""
        return self.snapped and self.form.rewind(dry)

    # ---- restore --------------------------------------------------------------------------------
    def fresh(self) -> Tuple[dict, list, list]:
        """A new object, read once: (its own tensors by path: where a kept or received state lands
        in place; its layout; its shard identity). Only modules and optimizers have destinations
        (anything else is received into new tensors and loaded)."""
        sd = self.obj.state_dict()
        if not self.ready:
            self.setup(sd)
        self.placed = {path: (t.device_mesh, t.placements) for path, t in W.flat(sd).items() if _is_dtensor(t)}
        dests, layout, ident, self.meshes = self.form.fresh(sd)
        return dests, layout, ident

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

    def before_load(self, state: dict) -> Optional[dict]:
        """What `adopt` takes after `state` is loaded (a snapshot's: a copy made before
        load_state_dict, which may change the dict or the tensors it is handed; one that holds
        live tensors: its containers only, its tensors copied at adopt where the loaded object does
        not hold them in place)."""
        return self.form.before_load(state)

    def loaded_in_place(self, state: dict, own: dict) -> bool:
        """Every tensor of `state` arrived in the object's own tensors (`own`: fresh()'s; a module's
        kept or received in place): nothing left to load."""
        return self.form.loaded_in_place(state, own)

    def adopt(self, loaded: Optional[dict]) -> None:
        """The state just loaded into the object is now its committed state. `loaded`: a copy
        of it made before load_state_dict (a snapshot's: a loader reports its new position only
        once it iterates, so its committed state is what was loaded, not what it says now); a
        module and an optimizer take a snapshot now."""
        self.form.adopt(loaded, self.snapshot)

    def comparable(self, state: dict) -> dict:
        """The part of a restored state that replicas must agree on (a module's per-rank BatchNorm
        statistics left out: DDP overwrites them from rank 0 at the next forward; Python's `random`
        left out where nothing drew from it: Rng.unused)."""
        return self.form.comparable(state)


def load_order(names) -> List[str]:
    """Objects load in name order, the RNG state last (loading a loader may draw from it)."""
    return sorted(names, key=lambda n: (n == "_rng", n))
