"""torchtitan's trainer under ft_launcher, from outside torchtitan (no edit of torchtitan's source).

    from ft_launcher.integrations import torchtitan as ft_titan
    ft_titan.install()                         # sections: hang detection, computed timeouts
    ft_titan.install(live=True, buddy_every=1) # and a LiveState over the checkpointer's states
    from torchtitan.train import main
    ft_titan.run(main)                         # main() inside ft.restartable (live: required)

`install()` wraps, on the classes (every Trainer and checkpoint manager built afterwards):
- `Trainer.__init__` in the section "setup" (process group, model, parallelism, optimizer,
  dataloader, checkpointer), `Trainer.train_step` in "step", and `BaseCheckpointManager.load` and
  `.save` in "checkpointing" (torchtitan opens no section of its own: without these a hang is never
  detected, and warm reserves wait for the first section). Under torchrun or plain python the
  sections are no-ops (one warning), so the same script runs anywhere.
- `live=True` (with any LiveState keyword, e.g. `buddy_every=1` for pure FSDP, which has no
  replica): at the end of `Trainer.__init__`, `ft.LiveState(name="torchtitan", **states)` over
  torchtitan's `CheckpointManager.states` as they are (train_state: the trainer's step and token
  count; model: torchtitan's model parts; optimizer, lr_scheduler, dataloader: its containers),
  i.e. what its DCP checkpoint saves (the model through `_ModelState`: its parts' own parameters,
  read in place, not the state dict their hooks build; the optimizer through `_OptimizerState`: its
  state dict read without torchtitan's side effect on a fresh optimizer). A commit copies no
  parameter or optimizer state: only the persistent buffers, positions and counters, and the RNG. The commit brackets the optimizer and LR steps of
  `train_step` (opened as `optimizers.step()` starts, closed when `lr_schedulers.step()` returns:
  torchtitan calls them back to back), at the trainer's step, with the step guard's `loss=` (the
  sum of what `forward_backward_step` returned over the step's microbatches) and `grad_norm=` (what
  torchtitan's `clip_grad_norm_` returned): a step whose loss or gradients are not finite is never
  committed and is re-run (torchtitan itself would raise "Loss is not finite" only after its
  optimizer step, so the live state would hold the bad step). `install(live=True, guard=False)`:
  the commit without the guard. `checkpointer.load()` first calls
  `live.restore()`: when it returns a step, the states hold it (the trainer's step included) and
  torchtitan's own load is skipped; else torchtitan loads its checkpoint as without LiveState.
  torchtitan's checkpointing off (`checkpoint.enable = False`): it has no states, and live
  recovery is off, said in one line.
- Two identities in one state: the model, optimizer, LR schedulers and train state have the shard
  identity their DTensors give (under HSDP a rank's FSDP shard, replicated across the replica
  groups), while the dataloader's state is its data-parallel rank's alone (its position in that
  rank's part of the data, under a key that names the rank; no DTensor says so): the LiveState gets
  `per_rank={"dataloader": <data-parallel rank>}`. A killed rank then heals its model and optimizer
  from its replica and its loader position from its own record in its node's host memory, written
  at every commit (rank_side.live.rank_record): never a replica's position (torchtitan's
  `load_state_dict` would ignore the other rank's key with a warning and start the loader over).
  No record of the resume step (its node lost, no buddy copy): the job loads the checkpoint,
  saying why. That position is kept as plain values (`_LoaderState`), not as the bytes torchtitan
  pickles it into: nothing a peer held is unpickled freely.

- HSDP with `--elastic` (data parallelism only: tensor, context and pipeline degrees 1): a lost node
  that held whole replica groups leaves the others training at once, in place, and its ranks heal
  from them when it comes back (TorchFT's promise, without its per-step quorum). torchtitan would
  fill dp_shard from the new world size (another sharding, or an error when both degrees are
  given): `Trainer.__init__` keeps dp_shard as configured (else as the process's first trainer
  resolved it) and sets dp_replicate = world // dp_shard, one line saying so; ParallelDims keeps the
  replicate dimension on the mesh at size 1, so every parameter keeps its placements and shard
  identity and the survivors keep their state. The loader keeps the first world's split (its
  `load_state_dict` asserts an unchanged dp_world_size): torchtitan's dataloader config `build` gets
  the logical dp world and this process's logical dp rank (the one it had, whatever global rank it
  now has; a joining process takes the lowest no present process holds: one all-gather per
  trainer). The parts of the groups away are skipped; the loss divides by the tokens of the ranks
  present (a smaller global batch, as TorchFT). A rank that joins has no record of its loader's
  position (it was lost with its node): under `--elastic` (FT_LAUNCHER_ELASTIC=1, from the
  launcher) the LiveState gets `per_rank_fresh=True`, so its loader starts its part of the data
  from the beginning, said in one line per rank, instead of every rank loading the checkpoint.

`run(main)` calls `main()` inside `ft.restartable` (torchtitan's `main` builds the trainer, which
builds the process group, on every call: what restartable asks). Imports stay lazy: nothing of
torchtitan or torch is imported by `import ft_launcher` or by this module until `install()`.
"""
from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable, Optional

LIVE_NAME = "torchtitan"
_SECTION_SETUP, _SECTION_STEP, _SECTION_CKPT = "setup", "step", "checkpointing"
_options: dict = {"live": False, "guard": True, "live_kwargs": {}}


def install(live: bool = False, guard: bool = True, **live_kwargs: Any) -> None:
    """Wrap torchtitan's Trainer and checkpoint manager (module docstring). Call it before the
    trainer is built; calling it again only changes the live options."""
    from torchtitan.components.checkpointer.base import BaseCheckpointManager
    from torchtitan.trainer import Trainer

    _options["live"], _options["guard"], _options["live_kwargs"] = bool(live), bool(guard), dict(live_kwargs)
    if live and guard:
        _wrap_clip()
    _wrap(Trainer, "__init__", _trainer_init)
    _wrap(Trainer, "train_step", _in_section(_SECTION_STEP))
    _wrap(BaseCheckpointManager, "load", _checkpoint_load)
    _wrap(BaseCheckpointManager, "save", _in_section(_SECTION_CKPT))


def run(main: Callable[[], Any]) -> Any:
    """`main()` inside `ft.restartable` (module docstring)."""
    import ft_launcher as ft

    return ft.restartable(main)()


def _wrap(cls, attr: str, make: Callable[[Callable], Callable]) -> None:
    original = cls.__dict__[attr]
    if getattr(original, "_ft_launcher_wrapped", False):
        return
    wrapped = functools.wraps(original)(make(original))
    wrapped._ft_launcher_wrapped = True
    setattr(cls, attr, wrapped)


def _in_section(name: str) -> Callable[[Callable], Callable]:
    def make(original):
        def wrapped(self, *args, **kwargs):
            import ft_launcher as ft

            with ft.section(name):
                return original(self, *args, **kwargs)
        return wrapped
    return make


def _trainer_init(original):
    def wrapped(self, *args, **kwargs):
        import ft_launcher as ft

        with ft.section(_SECTION_SETUP):
            config = args[0] if args else kwargs.get("config")
            if config is not None:
                _keep_data_parallel_shape(config)
            original(self, *args, **kwargs)
            if _options["live"]:
                _attach_live(self)
    return wrapped


def _checkpoint_load(original):
    def wrapped(self, *args, **kwargs):
        import ft_launcher as ft

        with ft.section(_SECTION_CKPT):
            live = getattr(self, "_ft_launcher_live", None)
            if live is not None and live.restore() is not None:
                return True   # the states hold the live step, the trainer's included
            return original(self, *args, **kwargs)
    return wrapped


def _attach_live(trainer) -> None:
    """A LiveState over the checkpointer's states, and the commit around the optimizer and LR steps."""
    import ft_launcher as ft

    checkpointer = getattr(trainer, "checkpointer", None)
    states = getattr(checkpointer, "states", None) if getattr(checkpointer, "enable", False) else None
    if not states:
        if os.environ.get("RANK", "0") == "0":
            print("ft_launcher: torchtitan's checkpointing is off (checkpoint.enable = false), so it has no "
                  "states to keep: live recovery is off", file=sys.stderr, flush=True)
        return
    objects = {key: obj for key, obj in states.items() if obj is not None}
    parts = getattr(objects.get("model"), "model", None)
    if isinstance(parts, list) and parts and _ModelState.fits(parts):
        objects["model"] = _ModelState(parts)
    if objects.get("optimizer") is trainer.optimizers:
        objects["optimizer"] = _OptimizerState(trainer.optimizers)
    kwargs = dict(_options["live_kwargs"])
    loader = objects.get("dataloader")
    if "shard" not in kwargs and "per_rank" not in kwargs and getattr(loader, "dp_world_size", 1) > 1:
        # its position is this data-parallel rank's alone; the model and optimizer have the identity
        # their DTensors give (under HSDP: replicas across the replica groups)
        kwargs["per_rank"] = {"dataloader": int(loader.dp_rank)}
        if os.environ.get("FT_LAUNCHER_ELASTIC") == "1":   # a group that joins finds no record of its own
            kwargs.setdefault("per_rank_fresh", True)
    if loader is not None and hasattr(loader, "_rank_id"):
        objects["dataloader"] = _LoaderState(loader)
    live = ft.LiveState(name=LIVE_NAME, **objects, **kwargs)
    checkpointer._ft_launcher_live = trainer._ft_launcher_live = live
    _CommitBracket(trainer, live, _StepFigures(trainer) if _options["guard"] else None)


_FIRST: dict = {}   # this process's first trainer: its dp_shard, logical dp world, and its logical dp rank


def _keep_data_parallel_shape(config) -> None:
    """Under HSDP (data_parallel_replicate_degree > 1) with only data parallelism: keep dp_shard as
    configured (else as the process's first trainer resolved it) and, in a world that shrank or
    grew (`--elastic`), make dp_replicate = world // dp_shard, the replicate dimension kept on the
    mesh even at 1 (_replicate_kept: the shards keep their DTensor identity); the loader keeps the
    logical split (_logical_loader). Elsewhere (pure FSDP or DDP, tensor/context/pipeline degrees
    above 1): nothing changes."""
    _FIRST["loader_config"] = _FIRST["keep_replicate"] = None
    par = getattr(config, "parallelism", None)
    if par is None or getattr(config, "dataloader", None) is None:
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    other = max(1, par.context_parallel_degree) * max(1, par.tensor_parallel_degree) * max(
        1, par.pipeline_parallel_degree)
    rep, shard = int(par.data_parallel_replicate_degree), int(par.data_parallel_shard_degree)
    if "dp_shard" not in _FIRST:
        first_shard = shard if shard > 0 else max(1, world // (max(1, rep) * other))
        _FIRST.update(dp_shard=first_shard, dp_world=max(1, rep) * first_shard,
                      hsdp=rep > 1 and first_shard > 1 and other == 1)
    if not _FIRST["hsdp"] or other != 1:
        return
    _wrap_for_elastic(config)
    _FIRST["loader_config"], _FIRST["keep_replicate"] = config.dataloader, True
    dp_shard = _FIRST["dp_shard"]
    if world % dp_shard == 0 and world // dp_shard != rep:   # (else the configured shape, or torchtitan says why)
        par.data_parallel_shard_degree, par.data_parallel_replicate_degree = dp_shard, world // dp_shard
        if os.environ.get("RANK", "0") == "0":
            print(f"ft_launcher: torchtitan on {world} ranks: {world // dp_shard} replica group(s) of {dp_shard} "
                  f"(configured {rep} x {shard}); the loader keeps its split over {_FIRST['dp_world']} "
                  f"data-parallel ranks: the data of the groups away is skipped", file=sys.stderr, flush=True)


def _wrap_for_elastic(config) -> None:
    """Once per class: the dataloader config's `build` (_logical_loader) and ParallelDims' replicate
    dimension (_replicate_kept); both act only on the trainer being built (`_FIRST`)."""
    from torchtitan.distributed.parallel_dims import ParallelDims

    owner = next(k for k in type(config.dataloader).__mro__ if "build" in k.__dict__)
    _wrap(owner, "build", _logical_loader)
    _wrap(ParallelDims, "_mesh_exist", _replicate_kept)
    enabled = ParallelDims.__dict__["dp_replicate_enabled"].fget
    if not getattr(enabled, "_ft_launcher_wrapped", False):
        def dp_replicate_enabled(self):   # (llama3's parallelize then shards over ["dp_replicate", "fsdp"])
            return enabled(self) or bool(_FIRST.get("keep_replicate"))
        dp_replicate_enabled._ft_launcher_wrapped = True
        ParallelDims.dp_replicate_enabled = property(dp_replicate_enabled)


def _replicate_kept(original):
    """ParallelDims' mesh dimensions: under HSDP the replicate dimension stays on the mesh at size 1
    (one replica group left): fully_shard then gets the same (replicate, shard) mesh, and every
    parameter the same placements and shard identity, as before the shrink."""
    def _mesh_exist(self, name, degree):
        return original(self, name, degree) or (name == "dp_replicate" and bool(_FIRST.get("keep_replicate")))
    return _mesh_exist


def _logical_loader(build):
    """torchtitan's dataloader config's `build` with the first world's split: dp_world_size the
    logical data-parallel world, dp_rank this process's logical rank (_logical_dp_rank)."""
    def logical(self, *args, **kwargs):
        if self is _FIRST.get("loader_config") and "dp_world_size" in kwargs:
            kwargs["dp_world_size"] = _FIRST["dp_world"]
            kwargs["dp_rank"] = _logical_dp_rank(_FIRST["dp_world"])
        return build(self, *args, **kwargs)
    return logical


def _logical_dp_rank(dp_world: int) -> int:
    """This process's logical data-parallel rank: the one it had (a survivor keeps its part of the
    data, whatever global rank it now has), else the lowest no present process claims (a rank that
    joined takes a part of a group away). A collective over the world (every rank builds its loader)."""
    import torch
    import torch.distributed as dist

    from ft_launcher.rank_monitor.rank_side import comm_backend

    # each rank's claim + 1 in its own entry (0: none yet), summed: plain integers, never a peer's
    # pickle (all_gather_object would unpickle what peers send)
    mine = _FIRST.get("dp_rank")
    table = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=comm_backend.transfer_device())
    table[dist.get_rank()] = 0 if mine is None else int(mine) + 1
    dist.all_reduce(table)
    claims = [None if c == 0 else c - 1 for c in table.tolist()]
    taken = set()
    for r, claim in enumerate(claims):
        if claim is not None and claim not in taken and claim < dp_world:
            taken.add(claim)
        else:
            claims[r] = None
    free = iter(k for k in range(dp_world) if k not in taken)
    claims = [next(free) if c is None else c for c in claims]
    _FIRST["dp_rank"] = claims[dist.get_rank()]
    return _FIRST["dp_rank"]


_GRAD_NORM: list = [None]   # what torchtitan's clip_grad_norm_ returned last (the guard's grad_norm=)


def _wrap_clip() -> None:
    """torchtitan's train_step calls `dist_utils.clip_grad_norm_` through its module at each step:
    wrapped once, it also keeps what it returned, for the guard."""
    from torchtitan.distributed import utils as dist_utils

    original = dist_utils.clip_grad_norm_
    if getattr(original, "_ft_launcher_wrapped", False):
        return

    @functools.wraps(original)
    def clip_grad_norm_(*args, **kwargs):
        _GRAD_NORM[0] = norm = original(*args, **kwargs)
        return norm
    clip_grad_norm_._ft_launcher_wrapped = True
    dist_utils.clip_grad_norm_ = clip_grad_norm_


class _StepFigures:
    """The step's loss and gradient norm as torchtitan computes them, for the guard: the sum of
    what `forward_backward_step` returns over the step's microbatches (patched on this trainer), and
    what its `clip_grad_norm_` returned (_wrap_clip)."""

    def __init__(self, trainer) -> None:
        self.trainer, self.step, self.loss = trainer, None, None
        original = trainer.forward_backward_step

        def forward_backward_step(*args, **kwargs):
            loss = original(*args, **kwargs)
            if self.step != trainer.step:
                self.step, self.loss = trainer.step, None
            part = loss.detach()
            self.loss = part.clone() if self.loss is None else self.loss + part
            return loss
        trainer.forward_backward_step = forward_backward_step

    def take(self) -> dict:
        """loss= and grad_norm= for this step's commit (what was seen in it), then forgotten."""
        loss = self.loss if self.step == self.trainer.step else None
        norm, _GRAD_NORM[0] = _GRAD_NORM[0], None
        self.step, self.loss = None, None
        figures = {"loss": loss, "grad_norm": norm}
        return {k: v for k, v in figures.items() if v is not None}


class _ModelState:
    """torchtitan's model parts as the LiveState sees them: each part's own parameters and persistent
    buffers by name, as the modules hold them (FSDP2's sharded DTensor parameters), not its
    `state_dict()`.

    torchtitan's `ModelWrapper.state_dict()` is the parts' `state_dict()`, through their hooks: the
    fused attention projection (`FusedQKVLinear`, the debugmodel's) gathers its sharded `wqkv` to
    every rank and splits it into new `wq`/`wk`/`wv` tensors (the checkpoint's layout). Those are
    not the parameters, so every commit copied them (4.7 MB per rank on the debugmodel, the whole
    projection, after an all-gather), and they could not be read in place. The live state is only
    ever loaded into this same trainer, so it keeps the parameters themselves (read in place: they
    change only inside commit) and the persistent buffers (copied at each commit: a forward pass
    may change them); loading copies each tensor into the part's own one (a DTensor's local shard,
    same placements and shape, else it raises and the job loads its checkpoint). Parts with
    `_extra_state` keep torchtitan's `ModelWrapper` (`fits`)."""

    def __init__(self, parts) -> None:
        self.model = parts   # the attribute name LiveState's search for live tensors reads (as ModelWrapper's)

    @staticmethod
    def fits(parts) -> bool:
        import torch

        base = torch.nn.Module.get_extra_state
        return all(isinstance(part, torch.nn.Module) for part in parts) and not any(
            getattr(type(mod), "get_extra_state", base) is not base for part in parts for mod in part.modules())

    def state_dict(self):
        out = {}
        for part in self.model:
            for prefix, mod in part.named_modules():
                dot = prefix + "." if prefix else ""
                for name, p in mod._parameters.items():
                    if p is not None:
                        out.setdefault(dot + name, p)
                for name, buf in mod._buffers.items():
                    if buf is not None and name not in mod._non_persistent_buffers_set:
                        out.setdefault(dot + name, buf)
        return out

    def load_state_dict(self, state_dict) -> None:
        import torch

        own = self.state_dict()
        if set(own) != set(state_dict):
            raise ValueError(f"the model's state has {sorted(set(own) ^ set(state_dict))[:4]} on one side only")
        with torch.no_grad():
            for key, dst in own.items():
                src = state_dict[key]
                if hasattr(dst, "placements") != hasattr(src, "placements") or (
                        hasattr(dst, "placements") and tuple(dst.placements) != tuple(src.placements)):
                    raise ValueError(f"the model's {key} is not sharded as the state to load")
                dst, src = _local(dst), _local(src)
                if dst.shape != src.shape or dst.dtype != src.dtype:
                    raise ValueError(f"the model's {key} is {tuple(dst.shape)} {dst.dtype}, the state's "
                                     f"{tuple(src.shape)} {src.dtype}")
                if dst.data_ptr() != src.data_ptr():   # (a kept rank's own parameter: nothing to copy)
                    dst.copy_(src)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


class _OptimizerState:
    """torchtitan's OptimizersContainer as the LiveState sees it: its own flat, FQN-keyed state dict
    (what its DCP checkpoint saves), read without a side effect on the training.

    torchtitan's `state_dict()` materializes a fresh optimizer's state with a zero-gradient, zero-lr
    step (so that DCP has tensors to read). The parameters stay as they were, but AdamW's step count
    does not: read before the first step (LiveState reads every object at `restore()`, also on the
    first start), the first real step would see step 2, and its bias correction would change the
    whole run (seen: the loss differed from step 2 on). So a read of a fresh optimizer clears the
    state it materialized: the optimizer is fresh again, exactly. It is not a torch Optimizer to the
    LiveState (its state dict has not torch's shape: no `param_groups` list): it is read as any
    Stateful is, at each commit, its tensors being the inner optimizers' own state (found through
    `self.optimizers`), held in place, not copied; loading goes through torchtitan's own
    `load_state_dict`."""

    def __init__(self, optimizers) -> None:
        self.optimizers = optimizers

    def state_dict(self):
        fresh = [optim for optim in self.optimizers.optimizers if not optim.state]
        state = self.optimizers.state_dict()
        for optim in fresh:
            optim.state.clear()
        return state

    def load_state_dict(self, state_dict) -> None:
        self.optimizers.load_state_dict(state_dict)


class _LoaderState:
    """torchtitan's dataloader as the LiveState sees it: its position as plain values, never the
    bytes torchtitan pickles it into.

    torchtitan's `state_dict()` is `{"dp_rank_<r>": pickle.dumps(<the StatefulDataLoader's state>),
    "world_size": ...}`, and its `load_state_dict` unpickles those bytes. Kept as they are, a heal
    from a buddy copy would hand torchtitan bytes that lay in a peer's memory to unpickle: code from
    a peer. So the state kept and sent is the loader's own state dict (what live_wire admits and
    reads with its restricted unpickler; anything else is refused at the first commit, with one
    line), and a load pickles those plain values here, in this process, for torchtitan's own
    `load_state_dict` (its checks kept)."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def state_dict(self):
        from torchdata.stateful_dataloader import StatefulDataLoader

        return {"rank_id": self.loader._rank_id, "world_size": self.loader.dp_world_size,
                "state": StatefulDataLoader.state_dict(self.loader)}

    def load_state_dict(self, state_dict) -> None:
        import pickle

        self.loader.load_state_dict({state_dict["rank_id"]: pickle.dumps(state_dict["state"]),
                                     "world_size": state_dict["world_size"]})


class _CommitBracket:
    """`live.commit(trainer.step)` from the start of `optimizers.step()` to the end of
    `lr_schedulers.step()` (torchtitan's train_step calls them back to back), patched on the
    trainer's two containers (this trainer only). An exception in either ends the commit with it
    (the state is suspect); an LR step outside a bracket (none in torchtitan) runs as it is."""

    def __init__(self, trainer, live, figures: Optional[_StepFigures] = None) -> None:
        self.trainer, self.live, self.open, self.figures = trainer, live, False, figures
        optimizers, schedulers = trainer.optimizers, trainer.lr_schedulers
        self.optimizer_step, self.scheduler_step = optimizers.step, schedulers.step
        optimizers.step = self.begin
        schedulers.step = self.end

    def begin(self, *args, **kwargs):
        if self.open:   # a second optimizer step without an LR step: the first commit ends here
            self._close(None)
        checked = self.figures.take() if self.figures is not None else {}
        self.live.commit(self.trainer.step, **checked).__enter__()
        self.open = True
        try:
            return self.optimizer_step(*args, **kwargs)
        except BaseException as exc:
            self._close(exc)
            raise

    def end(self, *args, **kwargs):
        if not self.open:
            return self.scheduler_step(*args, **kwargs)
        try:
            result = self.scheduler_step(*args, **kwargs)
        except BaseException as exc:
            self._close(exc)
            raise
        self._close(None)   # may raise RestartInPlace: a restart signal that came during the commit
        return result

    def _close(self, exc: Optional[BaseException]) -> None:
        self.open = False
        self.live.__exit__(type(exc) if exc is not None else None, exc, exc.__traceback__ if exc else None)
