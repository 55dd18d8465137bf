"""Live state: after an in-place restart, healthy ranks keep their training state in memory and
replaced ranks heal from a data-parallel peer, so a failure costs the step in flight, not the work
since the last checkpoint. `ft_launcher.LiveState`; the user guide is docs/live-state.md.

    live = ft.LiveState(model=model, optimizer=opt, scheduler=sched, loader=loader)
    start = live.restore()      # after init_process_group, BEFORE DDP is constructed
    if start is None: start = load_checkpoint()                        # no live state: as today
    for step in range(start + 1, steps + 1):
        batch = next(batches)                                            # the loader moves here
        ... forward / backward ...
        with live.commit(step):
            opt.step(); sched.step()

The parts:
- live_objects: per object, its state as of the last commit at a small per-step cost (a module's
  buffers, an optimizer's hyperparameters, a snapshot of anything else: a loader's position, a
  scheduler, RNG), and what a new object reads once at restore (its own tensors, layout, shard
  identity). live_wire: what a state may hold, the wire, the digest. live_plan: who resumes where.
- `commit(step)`: a restart signal that lands inside waits for its end (rank_monitor.rank_side.inprocess);
  on a clean exit each object's outside-commit state is snapshotted (`_completed`: the hook where a
  commit counts its step), this process holds `step` for the LiveState's name (the registry), and
  one word of the rank's record (H_LIVE_STEP) says so. An exception out of the body leaves the
  state suspect. The first commit checks that every object's state can be sent and compared; one
  that cannot is refused there with one line (live recovery off for this LiveState), not at the
  first heal.
- The registry (this process, live_registry): per LiveState name, the LiveState whose committed
  state it holds, and at which step. Only a commit or a completed restore makes a LiveState held:
  one that was only constructed (a call that ended before its restore) never replaces the previous
  one, and a fault inside restore() leaves the previous one for the next attempt (a kept rank holds
  the new one once its state is in it). What ends first at a restart, the script's destroy and the
  rank's exit (the buddy exchange in flight): live_teardown.
- `restore()` (cycle > 0; a collective, every rank calls it, several LiveStates match by name):
  1. each object is read once (`state_dict()` once per object on every rank);
  2. the step exchange (one all_gather, step_exchange.Row): per rank, what it offers (its
     committed step, the shard identity and layout that state was made under, or why it holds
     nothing) and what it needs (its new objects' identity and layout);
  3. live_plan.plan_recovery (step_exchange.plan_from_rows): the resume step and each rank's
     source; none: every rank returns None (the script's checkpoint) and global rank 0 prints one
     line saying why;
  4. a kept rank moves its committed state into the new objects (copied into their own tensors,
     the rest handed over, nothing staged), then frees the previous objects (steps 4 and 5:
     restore_transfer, one transport per source: rank_side.live.transport);
  5. the transfers, in one global order: the skeleton and tensors of each object (live_wire; a
     sender's DTensors first bound to this call's meshes, live_objects.Tracked.bind, so that a kept
     rank's optimizer state from before an elastic resize names this call's rank grid; a DTensor
     arrives as a DTensor on this rank's mesh: live_objects.Tracked.place);
  6. each state is bound to this call's device meshes (live_objects.Tracked.bind); the check
     (`verify=True`, the default; restore_verify): the replicas of each shard that a rank healed in
     compare a digest of their restored state (one all_gather); a mismatch falls back with one line;
  7. every rank loads each object (`load_state_dict()` once per object, in name order, the RNG last)
     and takes that state as its committed state;
  8. a second all_gather collects bytes, transfer time and each rank's restore time; global rank 0
     writes the summary (JSON, restore_report) for the agent, which says it as one `live_recovery`
     event and console line (agent.observation.live_recovery).
- Never worse than without it: whatever fails on a rank while it restores (an object's
  state_dict() or load_state_dict() raising, a state that does not fit, a DTensor's mesh that this
  call lacks, a digest it cannot take) is a flag in the next of the collectives above (the step
  exchange, the check's all_gather, the last all_gather); a receiver that cannot take a state
  still reads all of it (live_wire), so the ranks stay in step. Once a flag is up, the lowest
  failing rank's words come in one broadcast, every rank returns None (the script's checkpoint,
  which overwrites what a load already changed), rank 0 prints one line naming the rank, the
  object and the error, and nothing is held until the next commit. A peer lost mid-transfer
  (live_wire.PeerLost) raises: its loss is a failure of its own, and the restart follows.
- `commit(step, loss=..., grad_norm=...)`: the step guard first (rank_side.live.step_guard): a step
  whose loss or gradient is not finite is not committed; every rank re-runs it from memory
  (inprocess.StepRerun: the function is called again in the same process and group) and
  `restore()` then moves every rank's committed state into the new objects with no exchange
  (`_rerun_restore`: one all_reduce of a failure flag).
- Outside ft_launcher, under torchrun or plain python, outside `ft.restartable`, or with
  `--restart-granularity job`: `restore()` returns None and `commit` only runs its body.
"""
from __future__ import annotations

import gc
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional

from ft_launcher.rank_monitor.rank_side import comm_backend, exit_settle, gpu_commit, inprocess
from ft_launcher.rank_monitor.rank_side.live import (buddy_copy, guard_targets, live_layout, live_rng, live_teardown,
                                                   rank_record, restore_report, restore_transfer, sdc_sim,
                                                   step_guard)
from ft_launcher.rank_monitor.rank_side.live.backward_watch import BackwardWatch
from ft_launcher.rank_monitor.rank_side.live import live_objects as O
from ft_launcher.rank_monitor.rank_side.live import live_wire as W
from ft_launcher.rank_monitor.rank_side.live.live_plan import Plan
from ft_launcher.rank_monitor.rank_side.live.live_registry import REG, Held
from ft_launcher.rank_monitor.rank_side.live.restore_transfer import failure
from ft_launcher.rank_monitor.rank_side.live.restore_verify import all_gather, broadcast_text, verify
from ft_launcher.rank_monitor.rank_side.live.step_exchange import HOLDS, Row, no_plan, plan_from_rows, ranks_text
from ft_launcher.rank_monitor.rank_side.live.transport import Arrival
from ft_launcher.rank_monitor import buddy_store
from ft_launcher.rank_monitor import shm_layout as L

def _cycle() -> int:
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    except ValueError:
        return 0


def _say(line: str) -> None:
    """One line on global rank 0 (every rank decides the same)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"ft_launcher: {line}", file=sys.stderr, flush=True)


def _on_teardown() -> None:
    """At an in-place restart: the held modules' gradients go (the next call makes its own), so the
    new call builds its objects beside the held state, not beside it and its gradients too."""
    for held in REG.held.values():
        for t in held.live.tracked.values():
            if hasattr(t.obj, "parameters"):
                try:
                    for p in t.obj.parameters():
                        p.grad = None
                except Exception:  # noqa: BLE001 - best effort: only memory
                    pass


inprocess.on_teardown(_on_teardown)


class LiveState:
    """The training state that survives an in-place restart (see the module docstring).

    `LiveState(model=..., optimizer=..., scheduler=..., loader=..., ...)`: any number of named
    objects with `state_dict()` / `load_state_dict()`. Keywords:
    - `name`: matches this LiveState to the previous call's (several per function: a GAN's G and D);
      default: the objects' names joined by '+'.
    - `shard`: which part of the state this rank holds, when ranks do not all hold the same and the
      state has no DTensors that say so (their mesh coordinates are the shard identity anyway);
      ranks with the same `shard` are replicas. None (default): from the DTensors, else every rank
      holds the same state (DDP).
    - `per_rank` ({name: k}): objects whose state is this rank's alone although the rest of the state
      has replicas (a loader's position in data-parallel rank k's part of the data, under HSDP): left
      out of the shard identity and of the replicas' check, kept at each commit in this node's host
      memory (rank_side.live.rank_record), so a rank that heals the rest from a replica takes these
      from its record, never a replica's; no record of the resume step: the checkpoint, said.
    - `per_rank_fresh` (default False): a rank with no record of the resume step (a node that
      joined an elastic job: its records were lost with it) keeps its per-rank objects as it built
      them (a loader at the start of its part of the data), said in one line, instead of the
      checkpoint on every rank.
    - `rng` (default True): also keep the RNG state (torch CPU and CUDA, Python's `random`) as of
      each commit, so dropout and augmentation continue their stream.
    - `verify` (default True): after a live recovery in which a rank healed from a peer, the
      replicas of its shard compare a digest of their restored state; a mismatch falls back.
    - `buddy_every`: every that many steps, also copy the committed state into host memory, this
      node's and a buddy rank's on another node (rank_side.live.buddy_copy), so a rank without a live
      replica and a lost node resume from memory; 0 (default): off. One LiveState per process.
    - `buddy_memory_limit_mb`: the most host memory the buddy copies of one node may take
      (default: 80 % of what it has available); above it, buddy copies are off, said in one line.
    - `buddy_keep`: how many copies of each kind a rank keeps: 2 (default: its two newest
      snapshots and its source's two newest, 4 x its state in host memory, a lost node always
      finds a step every rank holds) or 1 (2 x its state: half; a failure that lands while a copy
      is being replaced finds no such step and falls back to the checkpoint, said in one line).
    - The step guard (`commit(step, loss=...)`, rank_side.live.step_guard): `spike_factor` (default
      10: a loss or gradient norm above that x the running maximum is a spike), `spike_fatal`
      (default False: a spike is said, not re-run), `skip_bad_batches` (default False: a batch found
      to be the data's fault stops the job; True: its update is dropped, said), `transient_window_s`
      (default 3600: a second transient on one device within it is persistent); the replica
      fingerprint (rank_side.live.replica_fingerprint): `fingerprint_every` (None, default: every K
      steps, K from `fingerprint_budget`, default 0.01 of a step; 0: off); `watch_every_step`
      (default False: each rank's own backward is watched from a hit's re-run on, for
      `transient_window_s`; True: every step, so a first transient is named too, at one pass over
      the gradients per step; rank_side.live.backward_watch).
    """

    def __init__(self, *, name: Optional[str] = None, shard: Optional[int] = None,
                 per_rank: Optional[Dict[str, int]] = None, per_rank_fresh: bool = False,
                 rng: bool = True, verify: bool = True,
                 buddy_every: int = 0, buddy_memory_limit_mb: Optional[float] = None, buddy_keep: int = 2,
                 spike_factor: float = 10.0, spike_fatal: bool = False, skip_bad_batches: bool = False,
                 transient_window_s: float = 3600.0, fingerprint_every: Optional[int] = None,
                 fingerprint_budget: float = 0.01, watch_every_step: bool = False, **objects: Any) -> None:
        for key, obj in objects.items():
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(f"LiveState({key}=...): a {type(obj).__name__} has no state_dict/load_state_dict")
        if not objects:
            raise TypeError("LiveState(): name at least one object, e.g. LiveState(model=model, optimizer=opt)")
        if live_rng.NAME in objects:
            raise TypeError(f"LiveState({live_rng.NAME}=...): that name is the RNG state's (rng=True)")
        self.name = name or "+".join(sorted(objects))
        self.objects: Dict[str, Any] = dict(objects)
        if rng:
            self.objects[live_rng.NAME] = live_rng.Rng()
        self.tracked: Dict[str, O.Tracked] = {k: O.Tracked(k, v) for k, v in self.objects.items()}
        self.shard = None if shard is None else int(shard)
        self.per_rank: Dict[str, int] = {k: int(v) for k, v in (per_rank or {}).items()}
        unknown = sorted(set(self.per_rank) - set(objects))
        if unknown:
            raise TypeError(f"LiveState(per_rank=...): {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} "
                            f"none of its objects ({', '.join(sorted(objects))})")
        self._record: Optional[rank_record.RankRecord] = None   # per-rank objects' host records (rank_record)
        self.per_rank_fresh = bool(per_rank_fresh)
        self.verify = verify
        if not float(spike_factor) > 1.0:
            raise ValueError(f"LiveState(spike_factor={spike_factor}): a factor above 1")
        if fingerprint_every is not None and int(fingerprint_every) < 0:
            raise ValueError(f"LiveState(fingerprint_every={fingerprint_every}): a number of steps, 0 for off")
        if not 0.0 < float(fingerprint_budget) <= 1.0:
            raise ValueError(f"LiveState(fingerprint_budget={fingerprint_budget}): a share of a step, in (0, 1]")
        self.guard = step_guard.GuardConfig(spike_factor=float(spike_factor), spike_fatal=bool(spike_fatal),
                                            skip_bad_batches=bool(skip_bad_batches),
                                            transient_window_s=float(transient_window_s),
                                            fingerprint_every=None if fingerprint_every is None
                                            else int(fingerprint_every),
                                            fingerprint_budget=float(fingerprint_budget),
                                            watch_every_step=bool(watch_every_step))
        self._checked = None   # (loss, grad_norm) of the commit being entered, for the guard
        self._run = None       # the commit's run= (its forward and backward), re-run in place
        self._guarded: Optional[bool] = None   # every rank runs the guard (agreed at the first commit)
        self._targets: Optional[guard_targets.Targets] = None
        self._watch: Optional[BackwardWatch] = None
        if int(buddy_every) < 0:
            raise ValueError(f"LiveState(buddy_every={buddy_every}): a number of steps, 0 for off")
        self._buddy_every = int(buddy_every)
        if buddy_keep not in (1, 2):
            raise ValueError(f"LiveState(buddy_keep={buddy_keep}): 1 or 2 copies of each kind")
        self._buddy_keep = int(buddy_keep)
        self._buddy_limit = None if buddy_memory_limit_mb is None else int(float(buddy_memory_limit_mb) * 1e6)
        self._buddy = None
        self.last_recovery: Optional[dict] = None   # restore()'s summary (rank 0's view), for tests and logs
        # commit_bytes: what the last commit copied (buffers, RNG, positions; whole states that cannot be read in
        # place); in_place_bytes: what the first commit read in place instead (parameters, optimizer state)
        self.stats = {"commits": 0, "snapshot_s": 0.0, "first_commit_s": 0.0, "guarded": 0, "guard_s": 0.0,
                      "commit_bytes": 0, "commit_bytes_total": 0, "in_place_bytes": 0,
                      "record_bytes": 0}
        self.refused: Optional[str] = None
        self._pending = 0
        self._described: Optional[dict] = None   # identity and layout of its objects (once read)
        self._words = None
        rec = None
        if os.environ.get(inprocess.ENV_GRANULARITY, "job") != "job" and inprocess._STATE.active:
            rec = inprocess._record()
        if rec is None:
            return
        self._mm, self._words = rec
        cycle = _cycle()
        if REG.call != inprocess._STATE.calls:   # the first LiveState of this call
            # suspect: the previous call raised by itself after a commit, or a committed step's GPU
            # work had not completed when the restart aborted the communicators (rank_side.gpu_commit)
            gpu_clean = gpu_commit.COMMITS.finish()
            REG.suspect = (inprocess._STATE.failed_last and REG.trained) or not gpu_clean
            REG.cycle, REG.call, REG.current, REG.trained = cycle, inprocess._STATE.calls, {}, False
            REG.calls += 1
        if self.name in REG.current:
            raise TypeError(f"two LiveStates named '{self.name}' in one call: give each its own name "
                            f"(LiveState(name='G', ...))")
        REG.current[self.name] = self

    @property
    def active(self) -> bool:
        """True under ft_launcher inside `ft.restartable` with in-place restarts on."""
        return self._words is not None

    # ---- commit ---------------------------------------------------------------------------------
    def commit(self, step: int, loss: Any = None, grad_norm: Any = None,
               run: Optional[Callable[[], Any]] = None) -> "LiveState":
        """`with live.commit(step): opt.step()`: the body runs whole even if a restart signal
        arrives meanwhile; once it ends without an exception, `step` counts as completed.
        Commits may nest (`with g.commit(s), d.commit(s):`): the signal waits for the outermost.
        With `loss=` (this rank's loss tensor) and/or `grad_norm=` (e.g. what clip_grad_norm_
        returned), the step guard checks the step first, on every rank together (a collective):
        a step that is not finite is re-run from memory and never committed
        (rank_side.live.step_guard). Outside ft_launcher's in-place restarts the guard is off.
        `run=`: the step's forward and backward as a function of no arguments that returns the
        loss, or (loss, grad_norm), or None (a stage without a loss), instead of `loss=`/`grad_norm=`:
        the commit calls it, and a step the guard re-runs is re-run in place by calling it again
        (the RNG and buffers put back to the commit), not by calling the training function again."""
        if run is not None and (loss is not None or grad_norm is not None):
            raise TypeError("live.commit(): give run= or loss=/grad_norm=, not both (run returns them)")
        self._pending = step
        self._checked = (loss, grad_norm) if loss is not None or grad_norm is not None else None
        self._run = run
        return self

    def __enter__(self) -> "LiveState":
        checked, self._checked = self._checked, None
        run, self._run = self._run, None
        if run is not None:
            checked = _returned(run())
        if self._words is not None and self._guarded is None:
            self._guarded = self._agree_guarded(checked is not None)
        if self._words is not None and self._guarded and self.refused is None:
            loss, grad_norm = checked or (None, None)
            t0 = time.perf_counter()
            step_guard._POSITION[0] = self._loader_position
            while True:
                try:
                    decision = step_guard.check(self, self._pending, loss, grad_norm)
                    break
                except inprocess.StepRerun:
                    if not self._rewound(self._pending, run is not None):   # (a collective: every rank asks)
                        raise
                    loss, grad_norm = _returned(run()) or (None, None)
            if decision == step_guard.Decision.SKIP:
                self._drop_gradients()
            self.stats["guard_s"] += time.perf_counter() - t0   # the guard's per-step cost (bench/step_guard.py)
            self.stats["guarded"] += 1
        if self._words is not None:
            REG.depth += 1
            inprocess._STATE.in_commit = True
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._words is None:
            return False
        try:
            if exc_type is None:
                spec = sdc_sim.spec()
                if spec is not None and spec.due(self._pending, "memory") and self.guard_targets().params:
                    sdc_sim.corrupt(self.guard_targets().params[0].detach(), spec.kind)   # rank_sdc's memory place
                self._completed(self._pending)
            else:
                held = REG.held.get(self.name)
                if held is not None and held.live is self:
                    held.dirty = True
                gpu_commit.COMMITS.discard()
        finally:
            REG.depth -= 1
            if REG.depth <= 0:
                REG.depth = 0
                inprocess.commit_done()   # a restart signal that arrived inside: RestartInPlace now
        if exc_type is None and self._buddy is not None and self.refused is None:
            self._buddy.after_commit(self, self._pending)   # every K steps: the copy (it may wait for the last)
        return False

    def _loader_position(self) -> str:
        """The committed position of this LiveState's loaders (the step guard's words)."""
        loaders = {n: t.state for n, t in self.tracked.items()   # a module's or optimizer's: None, no words
                   if "loader" in n.lower() or "Loader" in type(t.obj).__name__}
        return step_guard.describe_position(loaders)

    def _drop_gradients(self) -> None:
        """The guard skips this step's batch: every gradient the optimizers would apply goes, so the
        optimizer step in the commit's body changes no parameter."""
        for p in self.guard_targets().params:
            p.grad = None

    # ---- the step guard's view of the objects (rank_side.live.step_guard) ---------------------------
    def _agree_guarded(self, mine: bool) -> bool:
        """Whether the guard runs at every commit of this LiveState, on every rank: some rank gave a
        loss or a norm at its first commit (one all_reduce, once), so a rank without one (a pipeline
        stage with no loss) still joins every guard collective."""
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return False
        flag = torch.tensor([int(mine)], dtype=torch.int64, device=comm_backend.transfer_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        guarded = bool(flag.item())
        if guarded:
            step_guard.MEM.guarded = True
            live_teardown.drain_before_destroy()
            if not self.guard_targets().found:
                _say(f"LiveState '{self.name}': the step guard finds no module or optimizer among its objects "
                     f"({', '.join(sorted(self.objects))}): it checks only the loss= and grad_norm= given, sees "
                     f"no gradient of its own, cannot drop a skipped batch's update and compares no replicas; "
                     f"pass model=/optimizer=, or a Stateful that holds them as attributes")
        return guarded

    def guard_targets(self) -> guard_targets.Targets:
        """The parameters, optimizer state and GradScaler among this LiveState's objects (found once)."""
        if self._targets is None:
            self._targets = guard_targets.find(self.objects)
        return self._targets

    def _rewound(self, step: int, run: bool) -> bool:
        """A step the guard re-runs, in place (commit's `run=`): every rank puts back what the forward
        and backward changed since the commit (the RNG, buffers) and turns its backward watch on
        for the re-run. One all_reduce, which every rank joins (`run`: this rank's commit has a
        `run=`): where any rank cannot (no `run=`, a heal from a replica, a state with buffers
        LiveState does not keep, nothing committed in this process), every rank re-runs through the
        restart instead, as without `run=`."""
        import torch
        import torch.distributed as dist

        held = REG.held.get(self.name)
        can = (run and step_guard.MEM.heal is None and held is not None and held.live is self and not held.dirty
               and not REG.suspect and held.step == step - 1
               and all(t.rewind(dry=True) for t in self.tracked.values()))
        flag = torch.tensor([int(can)], dtype=torch.int64, device=comm_backend.transfer_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if not flag.item():
            return False
        with torch.no_grad():
            for tracked in self.tracked.values():
                tracked.rewind()
        self.backward_watch(step - 1)
        return True

    def backward_watch(self, step: int, on: bool = True) -> Optional[BackwardWatch]:
        """The hooks on this call's parameters that see each rank's own gradients from `step`'s
        successor on (`on`; installed at restore() when this process ran the guard before: a re-run's
        own backward is watched), or none (`on` False: the hooks removed). -> the watch, or None."""
        if self._watch is not None and self._watch.measure != on:
            self._watch.remove()
            self._watch = None
        # (off, the hooks stay only to land a simulated fault's `backward` place: rank_side.live.sdc_sim)
        wanted = on or (sdc_sim.spec() is not None and sdc_sim.spec().place == "backward")
        if self._watch is None and wanted and self.guard_targets().found:
            targets = self.guard_targets()
            self._watch = BackwardWatch(targets.params, step + 1, measure=on, modules=targets.modules)
        elif self._watch is not None:
            self._watch.next(step + 1)
        return self._watch if self._watch is not None and self._watch.measure else None

    def watching(self, step: int, every_step: bool) -> Optional[BackwardWatch]:
        """The watch that saw `step`'s backward (its norms taken), or None (the guard's read)."""
        if every_step:
            return self.backward_watch(step)
        return self._watch if self._watch is not None and self._watch.measure else None

    def shard_identity(self) -> Optional[int]:
        """The identity that this rank's replicas share (known once the first commit described the
        objects; None before: the fingerprint waits for it)."""
        return None if self._described is None else self._described["identity"]

    def state_suspect(self) -> None:
        """This rank's committed state is not to be trusted: the next restore() heals it from a peer."""
        held = REG.held.get(self.name)
        if held is not None and held.live is self:
            held.dirty = True

    # ---- buddy copies (rank_side.live.buddy_copy) ----------------------------------------------------------
    def committed_states(self) -> Dict[str, dict]:
        """Every object's state dict as of the last commit (what a buddy copy holds)."""
        return {name: t.committed() for name, t in self.tracked.items()}

    def described(self) -> dict:
        """The identity and layout digests of this LiveState's objects (as the step exchange has them)."""
        return self._describe()

    def buddy_stats(self) -> Optional[dict]:
        """This cycle's buddy-copy figures (snapshots, bytes, seconds copying, waiting, exchanging),
        or None when buddy copies are off."""
        return self._buddy.stats() if self._buddy is not None else None

    def _start_buddy(self, cycle: int):
        """This cycle's buddy copies (a collective: a new gloo group and the placement), when asked
        for, under ft_launcher, with a state that can be sent; the previous cycle's are closed."""
        if REG.buddy is not None:
            REG.buddy.close()
            REG.buddy = None
        prefix = os.environ.get(buddy_store.ENV_PREFIX)
        if not self._buddy_every or not prefix or self.refused is not None:
            return None
        self._buddy = REG.buddy = buddy_copy.BuddyCopy(self._buddy_every, self._buddy_limit, prefix,
                                                       self._buddy_keep)
        self._buddy.setup(cycle)
        live_teardown.drain_before_destroy()
        exit_settle.before_exit(live_teardown.drain_at_exit)
        return self._buddy

    def _completed(self, step: int) -> None:
        """A commit's body ended: `step` is completed. What changed outside commit is snapshotted,
        and this process holds the state at `step`. (Where a GPU step must have finished before its
        step counts, the wait goes first here.)"""
        t0 = time.perf_counter()
        REG.trained = True
        if self.refused is not None:
            return
        first = self.stats["commits"] == 0
        try:
            if first:
                self._describe()
            for tracked in self.tracked.values():
                tracked.snapshot()
        except W.Refused as exc:
            self._refuse(exc)
            return
        copied = sum(t.copied for t in self.tracked.values())
        self.stats["commit_bytes"] = copied
        self.stats["commit_bytes_total"] += copied
        if first:
            self.stats["in_place_bytes"] = sum(t.in_place for t in self.tracked.values())
            self.stats["commit_bytes_by"] = {n: t.copied for n, t in self.tracked.items()}
            paths = sorted(((b, f"{n}{p}") for n, t in self.tracked.items() for p, b in t.copied_paths.items()),
                           reverse=True)
            self.stats["copied_paths"] = {p: b for b, p in paths[:12]}
            notes = [t.note for t in self.tracked.values() if t.note]
            if notes:   # what is still copied whole, and why: one line
                _say(f"LiveState '{self.name}': " + "; ".join(notes))
        held = REG.held.get(self.name)
        if held is None or held.live is not self:
            held = REG.held[self.name] = Held(self, step)
        if self.per_rank:
            self._write_record(step)
        # the step counts once its GPU work is done (at once without CUDA): rank_side.gpu_commit
        gpu_commit.COMMITS.committed(step, self._counted)
        self.stats["first_commit_s" if first else "snapshot_s"] += time.perf_counter() - t0
        self.stats["commits"] += 1

    def _counted(self, step: int) -> None:
        """`step` is completed, its GPU work included: this process holds the state at `step`."""
        held = REG.held.get(self.name)
        if held is None or held.live is not self:
            return   # released meanwhile (a restore moved the state to the next call's LiveState)
        held.step, held.dirty, held.ready = step, False, None
        self._words[L.H_LIVE_STEP] = step + 1

    def _refuse(self, exc: W.Refused) -> None:
        self.refused = (f"'{exc.name}' holds {exc.what} at {W.path_text(exc.path)}, which a peer could not receive "
                        f"(a state dict may hold only None, numbers, strings, bytes, dtypes, devices, tensors and "
                        f"dicts, lists, tuples and sets of those)")
        said = REG.refused.get(self.name) == self.refused
        REG.refused[self.name] = self.refused
        held = REG.held.get(self.name)
        if held is not None and held.live is self:
            del REG.held[self.name]
        if not said:
            _say(f"LiveState '{self.name}' refused: {self.refused}: live recovery is off for it, every restart "
                 f"loads the checkpoint")

    def _describe(self, fresh: Optional[dict] = None) -> dict:
        """Identity and layout digests of this LiveState's objects (read once: `fresh` if given)."""
        if fresh is None and self._described is not None:
            return self._described
        if fresh is None:
            fresh = {name: t.fresh() for name, t in sorted(self.tracked.items())}
        world = _world()
        per_object = {name: W.digest64(name, self.tracked[name].kind, layout)
                      for name, (_, layout, _) in sorted(fresh.items())}
        idents = [(name, ident) for name, (_, _, ident) in sorted(fresh.items()) if ident and name not in self.per_rank]
        self._described = {
            "world": world,
            # replicated state (no `shard=`; DTensors name only their sharded dimensions) is the same
            # state under any number of replicas: an elastic job that lost or gained replicas keeps it;
            # a `shard=` number means something only under the world size it was given in
            "identity": W.digest64(world if self.shard is not None else None, self.shard, idents),
            "identity_text": live_layout.describe_identity([e for _, ident in idents for e in ident], self.shard),
            "layout": W.digest64(sorted((n, d) for n, d in per_object.items() if n not in self.per_rank)),
            # the per-rank objects (`per_rank`): their own identity and layout, those of their host records
            "own_identity": W.digest64(world, sorted(self.per_rank.items())),
            "own_layout": W.digest64(sorted((n, d) for n, d in per_object.items() if n in self.per_rank)),
            "objects": per_object,
            "names": W.digest64(sorted(self.tracked)),
            # plain BatchNorm statistics are per rank; DDP makes rank 0's everyone's at the next forward
            "rank0_buffers": sorted(n for n, t in self.tracked.items() if t.per_rank) if world > 1 else [],
        }
        return self._described

    # ---- restore --------------------------------------------------------------------------------
    def restore(self) -> Optional[int]:
        """Load the state the job resumes at into this call's objects: the last completed step
        this rank now holds, or None when there is no live state (first start, a cold or job-level
        restart, no healthy copy of some shard): then load the checkpoint as without live state.
        Call it after init_process_group and before DDP is constructed (DDP broadcasts rank 0's
        parameters: they must already be the resumed ones). A collective: every rank calls it.
        Whatever fails on some rank while it restores (an object's state_dict() or load_state_dict()
        raising, a state that does not fit, a mesh this call lacks) is None on every rank, with one
        line naming the rank, the object and the error; a peer lost on the wire raises (the restart
        that its loss brings follows)."""
        if self._words is None:
            return self._without_live_words()
        heal = inprocess._STATE.rerun and step_guard.MEM.heal == "peer"   # replicas disagreed (step_guard)
        if inprocess._STATE.rerun and not heal:   # a step re-run from memory (step_guard): every rank holds its state
            return self._watched(self._rerun_restore())
        cycle = _cycle()
        self._words[L.H_LIVE_STEP] = 0
        if cycle == 0 and not heal:
            return self._first_start()
        import torch

        fresh, mine, failed = self._read_fresh()   # 1
        rank, world, device = _group()
        buddy = self._buddy = REG.buddy if heal else self._start_buddy(cycle)   # a heal keeps the cycle's copies
        held = REG.held.get(self.name)
        rows, copies = self._exchange(held, mine, failed, buddy, world, device)   # 2
        started = time.perf_counter()   # every rank is here: what follows is the recovery's own time
        plan, reason = self._planned(rows, copies, failed, world, device)   # 3
        got, check = Arrival(), None
        with torch.no_grad():
            if plan.resume is not None:   # 4, 5: kept state moved, buddy copies read, peers' sent and received
                got = restore_transfer.arrive(self, plan, held, rows[rank].status == HOLDS, fresh, buddy, copies,
                                              device)
                held = None
                plan, reason, check, failed = self._settle(plan, rows, got, fresh, device, world)   # 6, 7
            else:
                REG.held.pop(self.name, None)   # the checkpoint: the previous objects are not needed
            del held, fresh
            gc.collect()   # the previous objects' cycles, if any, now
        plan, reason, stats = self._gather_stats(plan, reason, got, started, failed, device, world)   # 8
        self._report(cycle, plan, rows, stats, check, reason, rank)
        if plan.resume is None:
            self._abandon_timeline(buddy, cycle)
            return None
        self._words[L.H_LIVE_STEP] = plan.resume + 1
        return self._watched(plan.resume)

    def _without_live_words(self) -> None:
        """restore() outside ft_launcher's in-place restarts: None; at a restart under
        --restart-granularity job, global rank 0 says once why every rank loads its checkpoint."""
        if (_cycle() > 0 and os.environ.get("RANK") == "0" and os.environ.get(L.ENV_SHM)
                and os.environ.get(inprocess.ENV_GRANULARITY, "job") == "job" and not REG.said_job):
            REG.said_job = True
            print("ft_launcher: no live state with --restart-granularity job (every rank restarts as a new "
                  "process): every rank loads its checkpoint", file=sys.stderr, flush=True)
        return None

    def _first_start(self) -> None:
        """restore() at a first start (cycle 0): nothing to exchange, and nothing read: a fresh
        optimizer's state_dict() through DCP's get_state_dict would make its state by a step at lr 0
        (AdamW's step count 1), so a job with a LiveState would train differently from one without.
        Its state is checked at the first commit instead. This cycle's buddy copies start."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            self._start_buddy(0)
        return None

    def _read_fresh(self):
        """Step 1: each new object is read once (`state_dict()`), and described (identity and layout).
        -> (the objects' fresh reads, their description, what failed or ""); a state that cannot be
        sent is refused (said; no description)."""
        fresh = mine = None
        failed = ""
        if self.refused is None:
            name = None
            try:
                fresh = {}
                for name, t in sorted(self.tracked.items()):   # each object read once
                    fresh[name] = t.fresh()
                mine = self._describe(fresh)
            except W.Refused as exc:
                self._refuse(exc)
            except Exception as exc:  # noqa: BLE001 - any error of the user's object: the checkpoint, said
                failed, fresh = failure(name, "state_dict()", exc), None
        return fresh, mine, failed

    def _exchange(self, held: Optional[Held], mine: Optional[dict], failed: str, buddy, world: int, device):
        """Step 2, the step exchange (one all_gather): every rank's row (Row) and, with buddy copies,
        the copies each rank holds. -> (rows, the copies' columns or None)."""
        import torch

        row = Row.mine(self, held, mine, failed=bool(failed))
        values = row.values + (buddy_copy.holdings(buddy.slots, world) if buddy is not None else [])
        table = all_gather(torch.tensor(values, dtype=torch.int64, device=device), world)
        rows = [Row(r[:Row.SIZE]) for r in table]
        return rows, ([r[Row.SIZE:] for r in table] if buddy is not None else None)

    def _planned(self, rows: List["Row"], copies: Optional[list], failed: str, world: int, device):
        """Step 3: the plan from the rows (and the buddy copies' offers); where reading the new objects
        failed on some rank, none, with the lowest failing rank's words. -> (plan, reason)."""
        plan, reason = plan_from_rows(self, rows, world, buddy_copy.offers(copies) if copies else [])
        if plan.resume is None and copies and self._buddy is not None:
            reason += self._buddy.window_words()
        failing = [r for r, row in enumerate(rows) if row.failed]
        if failing:
            plan, reason = no_plan(world), self._failed_reason(failing, failed, device)
        return plan, reason

    def _settle(self, plan: Plan, rows: List["Row"], got: Arrival, fresh: dict, device,
                world: int):
        """Steps 6 and 7 on the state that arrived (`got`): bound to this call's device meshes; the
        replicas' check (`verify`) or a failure flag (one all_gather either way); then every object
        loads its state, or, where it failed on some rank or the replicas differ, none does (the
        plan becomes none, nothing held). -> (plan, reason, the check's figures, what failed)."""
        import torch

        names = sorted(self.tracked)
        reason, check = "", None
        failed = got.failed or self._bind(got.ready, names)   # every DTensor on this call's mesh
        if self.verify:   # 6
            check, reason, failing, failed = verify(self, plan, rows, got.ready, names, device, world, failed)
        else:
            flags = all_gather(torch.tensor([int(bool(failed))], device=device), world)
            failing = [r for r, f in enumerate(flags) if f[0]]
        if failing:
            reason = self._failed_reason(failing, failed, device)
        if reason:
            REG.held.pop(self.name, None)
            return no_plan(world, reason), reason, check, failed
        return plan, reason, check, self._load(got.ready, fresh)   # 7

    def _gather_stats(self, plan: Plan, reason: str, got: Arrival, started: float, failed: str,
                      device, world: int):
        """Step 8 (one all_gather): every rank's bytes received, transfer and restore time, and whether
        a load failed on it: then the checkpoint everywhere (it overwrites what was loaded).
        -> (plan, reason, the gathered rows)."""
        import torch

        own = int((time.perf_counter() - started) * 1e9)
        stats = all_gather(torch.tensor([got.received, int(got.seconds * 1e9), own, int(bool(failed))],
                                         dtype=torch.int64, device=device), world)
        failing = [r for r, s in enumerate(stats) if s[3]]
        if failing:
            reason = self._failed_reason(failing, failed, device)
            plan = no_plan(world, reason)
            REG.held.pop(self.name, None)
        return plan, reason, stats

    def _report(self, cycle: int, plan: Plan, rows: List["Row"], stats: list, check: Optional[dict], reason: str,
                rank: int) -> None:
        """The restore said (restore_report): the job's summary, kept as `last_recovery`; rank 0 writes it."""
        self.last_recovery = restore_report.summary(self.name, cycle, plan, rows, stats, check, reason)
        restore_report.say(self._mm, self._words, cycle, plan, self.last_recovery, reason, rank)

    def _abandon_timeline(self, buddy, cycle: int) -> None:
        """A fallback to the checkpoint: its timeline from here on, so no buddy copy of the old one is
        offered again, nor a per-rank record of it."""
        if buddy is not None:
            buddy.abandon()
        if self._record is not None:
            self._record.abandon(cycle)

    def _records(self) -> Optional[rank_record.RankRecord]:
        """This local rank slot's per-rank records (under ft_launcher: beside its buddy slots)."""
        if self._record is None and self.per_rank:
            prefix = os.environ.get(buddy_store.ENV_PREFIX)
            if prefix:
                self._record = rank_record.RankRecord(prefix)
        return self._record

    def _write_record(self, step: int) -> None:
        """The per-rank objects' committed state into this node's host memory (rank_record), at the
        end of each commit. A record that cannot be written is said once; a heal that needs it then
        falls back to the checkpoint, saying why."""
        record = self._records()
        if record is None or record.refused is not None:
            return
        made = self._describe()
        try:
            self.stats["record_bytes"] = record.write({n: self.tracked[n].committed() for n in sorted(self.per_rank)},
                                                      step, made["own_identity"], made["own_layout"], made["world"],
                                                      int(os.environ.get("RANK", 0)), _cycle())
        except Exception as exc:  # noqa: BLE001 - said once; the next heal of this rank falls back
            if not getattr(self, "_record_said", False):
                self._record_said = True
                print(f"ft_launcher: LiveState '{self.name}': rank {os.environ.get('RANK', '?')} cannot keep its "
                      f"per-rank state ({', '.join(sorted(self.per_rank))}) in host memory: "
                      f"{type(exc).__name__}: {exc}; a heal of this rank from a replica falls back to the checkpoint",
                      file=sys.stderr, flush=True)

    def _watched(self, step: Optional[int]) -> Optional[int]:
        """restore()'s result; where this process ran the guard before, its backward watch is on from
        the first step after `step` (a re-run's own backward is watched too)."""
        if step is not None and step_guard.MEM.guarded:
            self.backward_watch(step)
        return step

    def _rerun_restore(self) -> Optional[int]:
        """restore() in a re-run from memory (rank_side.live.step_guard): every rank raised StepRerun
        at the same step, so every rank holds its committed state and nothing is exchanged: it
        moves into the new objects as a kept rank's does. One all_reduce of a failure flag: a
        failure on any rank is the checkpoint on every rank, with one line."""
        import torch
        import torch.distributed as dist

        held = REG.held.get(self.name)
        names = sorted(self.tracked)
        failed = (step_guard.MEM.heal or "" if held is not None and not held.dirty and not REG.suspect
                  else f"LiveState '{self.name}' held no clean state for the re-run"
                  + (" (no step committed yet in this process)" if held is None else ""))
        step = held.step if held is not None else None
        if not failed:
            name = None
            try:
                with torch.no_grad():
                    fresh = {}
                    for name in names:
                        fresh[name] = self.tracked[name].fresh()
                    self._describe(fresh)
                    committed = held.committed()
                    ready = {}
                    for name in names:
                        ready[name] = W.move_state(committed[name], fresh[name][0])
                self._hold(step, ready, previous=held)
                failed = self._bind(ready, names) or self._load(ready, fresh)
            except Exception as exc:  # noqa: BLE001 - the checkpoint, said
                failed = failure(name, "moving its kept state for the re-run", exc)
        del held
        flag = torch.tensor([int(bool(failed))], dtype=torch.int64, device=comm_backend.transfer_device())
        dist.all_reduce(flag)
        if flag.item():
            REG.held.pop(self.name, None)   # (a pending verdict stays: the checkpoint trains up to its step)
            self._abandon_timeline(REG.buddy, _cycle())   # as at restore's fallback
            if dist.get_rank() == 0:
                print(f"ft_launcher: the re-run from memory could not restore its state ({failed or 'on another rank'})"
                      f": every rank loads its checkpoint", file=sys.stderr, flush=True)
            return None
        self._words[L.H_LIVE_STEP] = step + 1
        self._buddy = REG.buddy   # the cycle's buddy copies go on
        return step

    def _places(self) -> Dict[str, Any]:
        """Per object, how a received DTensor is placed on this call's mesh (live_objects.Tracked.place)."""
        return {name: t.place for name, t in self.tracked.items()}

    def _failed_reason(self, failing: List[int], mine: str, device) -> str:
        """The fallback's words when a restore failed on `failing` ranks: the first one's own words
        (one broadcast from it: a collective, every rank calls it)."""
        text = broadcast_text(mine, min(failing), device)
        others = [r for r in failing if r != min(failing)]
        return (f"LiveState '{self.name}': on rank {min(failing)}, {text}"
                + (f" (and on {ranks_text(others)})" if others else ""))

    def _hold(self, step: int, ready: Dict[str, Any], previous: Optional[Held]) -> None:
        """This LiveState now holds the state at `step` (`ready`, not yet loaded); the previous
        LiveState of this name is freed."""
        REG.held[self.name] = Held(self, step, ready=ready)
        if previous is not None and previous.live is not self:
            previous.live._release()

    def _release(self) -> None:
        self.tracked.clear()
        self.objects.clear()

    def _meshes(self) -> list:
        """This call's device meshes: those of this LiveState's new objects' DTensors, each once."""
        meshes: list = []
        for m in (m for t in self.tracked.values() for m in t.meshes):
            if not any(m is seen for seen in meshes):
                meshes.append(m)
        return meshes

    def _sendable(self, name: str, state: Any) -> Any:
        """A state about to be sent, its DTensors on this call's device meshes (live_objects.Tracked.bind):
        a kept rank's optimizer state was handed over still on the previous call's mesh (after an
        elastic resize, one of another number of replicas, which a receiver of this call cannot place:
        it places a DTensor on its mesh of the sender's rank grid). Where one cannot be bound, as it is
        (the receiver says why it cannot place it; the job falls back)."""
        try:
            return self.tracked[name].bind(state, self._meshes())
        except Exception:  # noqa: BLE001 - sent as it is: the receiver's place() decides and says
            return state

    def _bind(self, ready: Dict[str, Any], names: List[str]) -> str:
        """Each state to load bound to this call's device meshes (live_objects.Tracked.bind: a kept
        rank's DTensors are on the previous call's mesh), in place in `ready`. -> "" or, where a
        DTensor's mesh has no equal in this call's objects, what (the job then falls back)."""
        meshes = self._meshes()
        for n in names:
            try:
                ready[n] = self.tracked[n].bind(ready[n], meshes)
            except Exception as exc:  # noqa: BLE001 - O.Unbound, or whatever the state holds: the checkpoint
                return failure(n, "binding its state to this call's device meshes", exc)
        return ""

    def _load(self, ready: Dict[str, Any], fresh: dict) -> str:
        """Every object loads its state (the same order on every rank, the RNG last) and takes it
        as its committed state. A module whose every tensor arrived in its own tensors (kept or
        received in place) has nothing left to load. -> "" or what failed (the first object whose
        load raised; the objects after it are not loaded: the job falls back to the checkpoint)."""
        for name in O.load_order(ready):
            tracked = self.tracked[name]
            state = ready[name]
            try:
                loaded = tracked.before_load(state)
                if not tracked.loaded_in_place(state, fresh[name][0]):
                    tracked.obj.load_state_dict(state)
                tracked.adopt(loaded)
            except Exception as exc:  # noqa: BLE001 - the user's load_state_dict: the checkpoint, said
                return failure(name, "load_state_dict()", exc)
        held = REG.held.get(self.name)
        if held is not None and held.live is self:
            held.ready = None
        return ""


def _returned(value) -> Optional[tuple]:
    """commit's `run=` result as (loss, grad_norm), or None (no loss: a stage that only joins)."""
    if value is None:
        return None
    if isinstance(value, tuple):
        loss, grad_norm = (tuple(value) + (None, None))[:2]
        return None if loss is None and grad_norm is None else (loss, grad_norm)
    return value, None


def _world() -> int:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    try:
        return int(os.environ.get("WORLD_SIZE", 1))
    except ValueError:
        return 1


def _group():
    """(rank, world size, transfer device) of the process group restore() exchanges state over;
    a RuntimeError where there is none yet."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("LiveState.restore() exchanges state over the process group: call it after "
                           "init_process_group (and before DDP is constructed)")
    return dist.get_rank(), dist.get_world_size(), comm_backend.transfer_device()   # the group's real backend
