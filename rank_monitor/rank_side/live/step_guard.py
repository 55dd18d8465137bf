"""The guard before commit (silent data corruption and NaN): a step whose loss or gradients are not
finite, or whose replicas no longer hold the same state, never becomes the live state; it is re-run
from memory to tell a transient fault, a bad device and bad data apart. Used by
`LiveState.commit(step, loss=..., grad_norm=...)`; the user guide is docs/sdc-and-nan.md.

    loss.backward()
    with live.commit(step, loss=loss):                  # and/or grad_norm=clip_grad_norm_(...)'s value
        opt.step(); sched.step()

Whether a LiveState is guarded is agreed at its first commit (LiveState._agree_guarded: some rank
gave a loss or a norm); from then on every rank runs `check` at every commit, values or not, so
every rank joins every collective below. What is checked, in the commit's `__enter__`, before its
body (so before the optimizer step):
- this rank's own backward, before the all-reduce (backward_watch: the largest norm of a gradient
  as the backward produced it), when it was watched: from a hit's re-run on, for
  `transient_window_s` after a transient, or every step with `watch_every_step` (the norms are one
  more pass over the gradients: no hook runs otherwise): not finite or past 2**60 names this rank
  even where DDP then spreads the NaN to every replica (unwatched, such a hit is every rank's alike,
  and its watched re-run names the rank);
- this rank's own loss (its micro-batch's, not all-reduced) and the norm of the gradients the
  optimizer will apply on this rank (`grad_norm=` given: that value, no second pass; else the norm
  of the optimizers' parameters' `.grad` found by guard_targets, in any state form);
- NaN or Inf: fatal, except where an enabled GradScaler will skip the step (Inf/NaN gradients with
  a finite loss: its routine overflow). Above `spike_factor` x the running maximum of committed steps
  (from the `spike_after`-th committed step on): a spike, said in one line, not fatal unless
  `spike_fatal`;
- every K steps (and at the re-run after any hit), a digest of the state committed at the step
  before (replica_fingerprint): replicas of a shard that disagree come before any other verdict.

Every rank learns every rank's values through ONE all_reduce (SUM) of a (world x COLS) float64
tensor in which each rank fills its own row: its loss, its gradient norms, its node, its running
maxima, its digest and the pending verdict it holds (below). All ranks read the same table, so all
decide the same. The row is built on the device the group communicates on, from device tensors;
the table is read back once (`tolist`). That read is the only host sync the guard adds: on a CPU
group it is free; on a GPU it is one sync per step, at the point where the optimizer's inputs are
ready anyway. A loop that already reads the loss or the norm on the host each step (logging,
GradScaler's inf check, `clip_grad_norm_(error_if_nonfinite=True)`) has that sync already.

The decisions (one line each, on global rank 0's stderr and as a `step_guard` event through the
agent; a stop is the agent's `workload_request` line):
1. A fatal hit at step S (nothing pending): the step is not committed. The pending record
   (`Pending`: plain numbers, never pickled) is held in this process's memory, and every rank
   raises `StepRerun` out of the training function; `ft.restartable` calls it again in the same
   process with the same process group (rank_side.inprocess), `LiveState.restore()` gives every
   rank back its state as of step S-1's commit (loader position and RNG included), and the loop
   runs step S again. The suspect: the rank whose own loss is not finite, else the one whose own
   backward made it, else the one whose gradient alone is not finite (after the all-reduce).
2. The re-run of S on the same device is clean: **transient**. Training goes on with the re-run's
   result; it counts against the suspect's device. A second transient on the same device within
   `transient_window_s`: **persistent** (rule 4's exit 17).
3. The re-run hits again on the same device: reproducible. With a known suspect, the suspect exits
   16 (EXIT_OTHER_HARDWARE: the agent restarts it on other hardware) and its peers wait for the
   in-place restart that its exit brings; they keep the pending record in memory. The new process
   heals from the live state, learns the record from its peers through the guard's table (or, where
   every rank is new, from the agent's re-run environment), and the job re-runs S.
4. On the other hardware (another node, or at least another device of its node: under in-place
   restarts the agent swaps the suspect with a sibling slot, which then runs on the suspect device):
   the suspect is clean, or it hits again together with another rank on the node it was on (the
   fault follows the node, not the batch): **persistent hardware fault**: every rank still on that
   node exits 17 (EXIT_NODE_SUSPECT: the node leaves the job, a spare takes its place, --elastic
   drops it, or the job stops; the agent takes a 17 that follows a 16 as the 16's node); a suspect
   that moved to another node stays. The suspect alone hits again: **the data or the model**: the
   job stops with one line naming the step, the rank and the loader position (a ShutdownWorkload
   request), or, with `skip_bad_batches`, the batch's update is dropped (every gradient set to None
   before the optimizer step) and the line says which batch. No suspect (every rank saw the NaN
   and nothing says where it arose) is treated as the data too, said so.
5. The state the step starts from, as committed, is not finite on some rank (checked at a fatal
   hit and before the data's verdict; a guarded step is never committed with a NaN loss or norm, so
   the fault came after the guard's figures: after the loop's own norm, in the optimizer step or in
   memory; with no replica to compare, pure FSDP, nothing saw it at its step): not the data: the live
   state is abandoned and every rank loads its checkpoint (as torchrun's restart would), with one
   line naming the rank; its device counts it, a second within the window: its node leaves.
6. Replicas disagree (`_diverged`): the odd ones (a minority; of two, the one whose state is not
   finite) heal from a good replica through restore()'s exchange and S is re-run; none known good:
   every rank loads its checkpoint; a device's second divergence within the window: its node leaves.
Bounded: a step hit more than MAX_HITS times in one process is the data's (or, for replicas that
keep disagreeing, a stop with one line); a pending record outlives a checkpoint fallback.

What survives where: the pending record, the device's transient count, the running maxima and the
fingerprint's schedule live in this module (one process): peers that stay keep them across
in-place restarts; a new process learns the record and the maxima from its peers' rows, never the
transient count (said in the docs).

A simulated fault (`rank_sdc`) is rank_side.live.sdc_sim's: this module injects its `reduced`
place (in local_row), backward_watch its `backward` place, LiveState its `memory` place.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time
import zlib
from typing import Any, Dict, List, Optional

from ft_launcher.rank_monitor import rerun_env
from ft_launcher.rank_monitor.rank_side.live import replica_fingerprint, sdc_sim
from ft_launcher.rank_monitor.workload_requests import STEP_GUARD_PREFIX

EXIT_OTHER_HARDWARE = 16   # Megatron's "re-run on a different GPU to disambiguate"
EXIT_NODE_SUSPECT = 17     # Megatron's "validation failed": the node is suspect, no restart in place on it
PEER_WAIT_S = 120.0        # seconds the suspect's peers wait for the restart its exit brings

# The table's columns (one row per rank, float64; node keys and digest halves stay below 2**53, exact).
(LOSS, NORM, NODE, LOSS_MAX, NORM_MAX, SEEN, P_STEP, P_STAGE, P_SUSPECT, P_NODE, P_LOSS, P_NORM, GROUP,
 LOCAL, P_GROUP, P_DEVICE, LOCAL_NORM, SCALER, FP_ON, FP_ID, FP_HI, FP_LO, FP_K) = range(23)
COLS = 23
MAX_HITS = 3               # fresh hits of one step in one process before the data verdict (never a loop)
NONE, SAME_DEVICE, OTHER_HARDWARE = 0, 1, 2   # the pending record's stages


@dataclasses.dataclass
class GuardConfig:
    """LiveState's guard keywords."""
    spike_factor: float = 10.0        # a loss or norm above this x the running maximum is a spike
    spike_fatal: bool = False         # a spike is fatal (re-run) instead of only said
    spike_after: int = 10             # committed steps before spikes count (the running maximum settles)
    skip_bad_batches: bool = False    # the data's fault: drop that batch's update instead of stopping
    transient_window_s: float = 3600.0   # a second transient on a device within this: persistent
    fingerprint_every: Optional[int] = None   # replicas compare digests every K steps (0: off; None: budget)
    fingerprint_budget: float = 0.01  # the share of a step the fingerprint may cost (K from it)
    watch_every_step: bool = False    # the backward watch on at every step (else from a hit on, for the window)


@dataclasses.dataclass
class Pending:
    """A verdict in progress (plain values: what a peer's row carries)."""
    step: int
    stage: int
    suspect: int                      # global rank, -1: unknown (every rank saw it)
    node: int                         # the suspect's node key when it was hit
    group: int                        # its node's place (GROUP_RANK) and device (LOCAL_RANK) then
    device: int
    loss: float                       # the suspect's first result
    norm: float


class _Memory:
    """What this process keeps across in-place restarts and re-runs."""

    def __init__(self) -> None:
        self.pending: Optional[Pending] = None
        self.transients: Dict[str, List[float]] = {}   # device -> monotonic times of its transients
        self.loss_max = 0.0
        self.norm_max = 0.0
        self.seen = 0                  # committed steps the maxima cover
        self.hits: Dict[int, int] = {}  # fresh hits per step (a step re-run MAX_HITS times is the data's)
        self.env_used = False          # the agent's re-run environment (after a 16) was taken as the record
        self.guarded = False           # some LiveState of this process runs the guard (its watch goes on)
        self.fp = replica_fingerprint.Schedule(None, 0.01)   # the fingerprint's K (agreed through the table)
        self.heal: Optional[str] = None   # the re-run's restore: "peer" (odd replicas heal), or the
        #                                   words of a checkpoint fallback
        self.spikes_said = set()       # steps whose spike was said
        self.reruns = 0                # re-runs from memory in this process
        self.hit_at = 0.0              # perf_counter of the last fatal hit (the re-run's cost is said from it)
        self.last: Optional[dict] = None   # the last verdict, for tests and the bench
        self.watch_until = 0.0         # monotonic time until which each rank's own backward stays watched
        self.reduce_s = 0.0            # seconds in the table's all_reduce (waiting for peers included),
        self.reduce_min = float("inf")  # and its fastest (the collective's own latency): bench/step_guard.py


MEM = _Memory()


_HOST = zlib.crc32(socket.gethostname().encode()) & 0xFFFFFFFF


def node_key() -> int:
    """This rank's hardware's node: its host and its agent (the parent process), as an exact float."""
    return float(_HOST * (1 << 20) + (os.getppid() & 0xFFFFF))


def device_name() -> str:
    return f"node {os.environ.get('GROUP_RANK', '?')} device {os.environ.get('LOCAL_RANK', '?')}"


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def say(line: str, event: bool = True, by: int = 0) -> None:
    """One line, said by global rank `by` (every rank decides the same; a rank that is about to exit
    says it itself: its record outlives it, and its agent reads the request before its exit); as a
    `step_guard` event through the agent when under ft_launcher, else on stderr."""
    if _rank() != by:
        return
    if not (event and _request("Continue", STEP_GUARD_PREFIX + line)):
        print(f"ft_launcher: {line}", file=sys.stderr, flush=True)


def _request(action: str, text: str) -> bool:
    """A workload request to this rank's agent (a Continue: the agent says it); False without one."""
    try:
        from ft_launcher.rank_monitor import shm_layout as L
        from ft_launcher.rank_monitor.rank_side.shm_attachment import _ATT
        from ft_launcher.rank_monitor.workload_requests import WorkloadAction

        if _ATT.ensure():
            L.await_request_read(_ATT.words)   # a burst of lines (a hit, then its verdict): none overwritten
            L.write_request(_ATT.mm, _ATT.words, WorkloadAction[action].value, text[:L.REQUEST_BYTES - 1])
            return True
    except Exception as exc:  # noqa: BLE001 - the line is said on stderr instead
        print(f"ft_launcher: the step guard's event was not sent: {exc!r}", file=sys.stderr, flush=True)
    return False


# ---- the check ------------------------------------------------------------------------------------
def local_row(loss, grad_norm, targets, watch, step: int, device, fp_identity: Optional[int]) -> Any:
    """This rank's row (a device tensor), after the simulated fault if due (`reduced` place: in this
    rank's first gradient, after the all-reduce and the loop's own norm). `fp_identity`: this
    step's fingerprint is due (the shard identity replicas share), or None."""
    import torch

    grads = targets.grads()
    spec = sdc_sim.spec()
    if spec is not None and grads and spec.due(step, "reduced"):
        sdc_sim.corrupt(grads[0], spec.kind)
    if grad_norm is None:
        grad_norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    loss, grad_norm = (x.full_tensor() if hasattr(x, "full_tensor") else x for x in (loss, grad_norm))   # DTensors
    # the host's values in one tensor (the step's hot path: one copy, not a write per column), then
    # the device's own values in place (no host sync)
    values = [0.0] * COLS
    values[NODE] = node_key()
    values[GROUP], values[LOCAL] = int(os.environ.get("GROUP_RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    values[LOSS_MAX], values[NORM_MAX], values[SEEN] = MEM.loss_max, MEM.norm_max, MEM.seen
    values[SCALER] = float(targets.scaler_enabled())
    values[FP_K] = MEM.fp.proposal()
    if fp_identity is not None:
        values[FP_ON], values[FP_ID] = 1.0, float(fp_identity & replica_fingerprint.MASK)
    p = MEM.pending
    if p is not None:
        values[P_STEP], values[P_STAGE], values[P_SUSPECT], values[P_NODE] = p.step, p.stage, p.suspect, p.node
        values[P_LOSS], values[P_NORM], values[P_GROUP], values[P_DEVICE] = p.loss, p.norm, p.group, p.device
    else:
        values[P_STEP] = -1
    for col, x in ((LOSS, loss), (NORM, grad_norm)):
        if not isinstance(x, torch.Tensor):
            values[col] = float(0.0 if x is None else x)
    if device.type == "cpu":
        row = torch.tensor(values, dtype=torch.float64)
    else:   # from pinned memory, queued behind the step's work: no host sync before the table's one read
        row = torch.tensor(values, dtype=torch.float64, pin_memory=True).to(device, non_blocking=True)
    for col, x in ((LOSS, loss), (NORM, grad_norm)):
        if isinstance(x, torch.Tensor):
            row[col] = x.detach().to(device, torch.float64).reshape(())
    if watch is not None:
        row[LOCAL_NORM] = watch.local(device)
    if fp_identity is not None:
        timed = MEM.fp.cost is None or device.type == "cpu"
        t0 = time.perf_counter()
        d = replica_fingerprint.digest(targets.state(), device)
        if timed:   # its cost, its device work included (K comes from it): on a GPU the first one only
            d.item()
            MEM.fp.measured(time.perf_counter() - t0)
        row[FP_HI], row[FP_LO] = replica_fingerprint.halves(d)
    return row


def exchange(row, world: int, rank: int, all_reduce=None) -> List[List[float]]:
    """Every rank's row on every rank: one all_reduce (SUM) of a (world x COLS) float64 tensor
    (`all_reduce`: torch.distributed's over the default group unless given)."""
    import torch

    if all_reduce is None:
        import torch.distributed as dist

        all_reduce = dist.all_reduce
    table = torch.zeros(world, COLS, dtype=torch.float64, device=row.device)
    table[rank] = row
    all_reduce(table)
    return table.tolist()


def _finite(x: float) -> bool:
    return x == x and x not in (float("inf"), float("-inf"))


def _pending_of(table: List[List[float]]) -> Optional[Pending]:
    """The pending record some rank holds (the furthest along), or None."""
    best = None
    for row in table:
        if row[P_STEP] >= 0 and (best is None or row[P_STAGE] > best[P_STAGE]):
            best = row
    if best is None:
        return None
    return Pending(int(best[P_STEP]), int(best[P_STAGE]), int(best[P_SUSPECT]), int(best[P_NODE]),
                   int(best[P_GROUP]), int(best[P_DEVICE]), best[P_LOSS], best[P_NORM])


def judge(table: List[List[float]], cfg: GuardConfig) -> dict:
    """The verdict of one step's table (pure): fatal ranks, spikes, the suspect, diverged replicas."""
    from ft_launcher.rank_monitor.rank_side.live.backward_watch import bad as bad_norm

    nonfinite = [r for r, row in enumerate(table) if not (_finite(row[LOSS]) and _finite(row[NORM]))]
    # an Inf or NaN gradient that a GradScaler will skip (its loss finite) is its routine overflow
    scaled = [r for r in nonfinite if table[r][SCALER] and _finite(table[r][LOSS])]
    bad = [r for r in nonfinite if r not in scaled]
    # each rank's own backward, before any all-reduce (backward_watch): where it arose
    own = [] if scaled else [r for r, row in enumerate(table) if bad_norm(row[LOCAL_NORM])]
    seen = max(row[SEEN] for row in table)
    loss_max = max(row[LOSS_MAX] for row in table)
    norm_max = max(row[NORM_MAX] for row in table)
    spikes = []
    if seen >= cfg.spike_after:
        for r, row in enumerate(table):
            if r in nonfinite or r in own:
                continue
            what = []
            if loss_max > 0 and abs(row[LOSS]) > cfg.spike_factor * loss_max:
                what.append(f"loss {row[LOSS]:.4g} > {cfg.spike_factor:g} x the running maximum {loss_max:.4g}")
            if norm_max > 0 and row[NORM] > cfg.spike_factor * norm_max:
                what.append(f"gradient norm {row[NORM]:.4g} > {cfg.spike_factor:g} x the running maximum "
                            f"{norm_max:.4g}")
            if what:
                spikes.append((r, "; ".join(what)))
    fatal = sorted(set(bad) | set(own))
    if cfg.spike_fatal:
        fatal += [r for r, _ in spikes if r not in fatal]
    # the ranks where it arose: one whose own loss is not finite (the loss is not all-reduced), else one
    # whose own backward made it (before the all-reduce spread it), else one whose gradient alone is not
    # finite (it came after the all-reduce, on that rank); none when every rank is alike
    by_loss = [r for r in fatal if not _finite(table[r][LOSS])]
    n = len(table)
    local = (by_loss if 0 < len(by_loss) < n else own if 0 < len(own) < n
             else fatal if len(fatal) < n else [])
    suspect = local[0] if local else -1
    return {"fatal": fatal, "local": local, "spikes": spikes, "suspect": suspect, "loss_max": loss_max,
            "norm_max": norm_max, "seen": seen, "pending": _pending_of(table), "scaled": scaled,
            "diverged": diverged(table), "k": int(max(row[FP_K] for row in table))}


def diverged(table: List[List[float]]) -> List[dict]:
    """Replica groups (ranks with the same shard identity that digested this step) whose digests
    differ: [{"ranks", "odd" (the minority; None without a majority), "good"}]."""
    groups: Dict[float, List[int]] = {}
    for r, row in enumerate(table):
        if row[FP_ON]:
            groups.setdefault(row[FP_ID], []).append(r)
    out = []
    for ranks in groups.values():
        by_digest: Dict[tuple, List[int]] = {}
        for r in ranks:
            by_digest.setdefault((table[r][FP_HI], table[r][FP_LO]), []).append(r)
        if len(by_digest) < 2:
            continue
        top = max(by_digest.values(), key=len)
        major = len(top) * 2 > len(ranks)
        out.append({"ranks": ranks, "good": top if major else [],
                    "odd": sorted(r for r in ranks if r not in top) if major else None})
    return out


def _what(table, r: int) -> str:
    loss, norm = table[r][LOSS], table[r][NORM]
    parts = [f"loss {loss:g}" if not _finite(loss) else "", f"gradient norm {norm:g}" if not _finite(norm) else ""]
    parts = [p for p in parts if p] or [f"loss {loss:.4g}, gradient norm {norm:.4g}"]
    return " and ".join(parts)


def _ranks_text(ranks) -> str:
    ranks = list(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class Decision:
    """What the commit does after the guard: GO (commit the step), SKIP (drop the batch's update, commit)."""
    GO, SKIP = "go", "skip"


def check(live, step: int, loss, grad_norm) -> str:
    """The guard of `live`'s commit of `step` (a collective: every rank calls it, with or without a
    loss or norm of its own). -> Decision.GO or Decision.SKIP; raises StepRerun (every rank
    together) to re-run the step from memory; exits 16 or 17, or waits for the restart a peer's exit
    brings, as the module docstring says."""
    import torch.distributed as dist

    from ft_launcher.rank_monitor.rank_side import comm_backend

    cfg: GuardConfig = live.guard
    rank, world = dist.get_rank(), dist.get_world_size()
    device = comm_backend.transfer_device()
    targets = live.guard_targets()
    watch = live.watching(step, cfg.watch_every_step)   # this step's backward, if it was watched
    MEM.fp.fixed, MEM.fp.budget = cfg.fingerprint_every, cfg.fingerprint_budget
    if MEM.fp.fixed:
        MEM.fp.k = MEM.fp.fixed
    MEM.fp.tick()
    identity = live.shard_identity() if MEM.fp.due(step) and targets.found and world > 1 else None
    row = local_row(loss, grad_norm, targets, watch, step, device, identity)
    t0 = time.perf_counter()
    table = exchange(row, world, rank)
    took = time.perf_counter() - t0   # the collective, waiting for the slowest rank included
    MEM.reduce_s, MEM.reduce_min = MEM.reduce_s + took, min(MEM.reduce_min, took)
    v = judge(table, cfg)
    # the next step's backward: watched from a hit on (its re-run's restore puts the hooks on), for the
    # transient window after one, or at every step (watch_every_step); else no hook costs a pass
    live.backward_watch(step, on=bool(cfg.watch_every_step or v["fatal"] or v["pending"] is not None
                                      or v["diverged"] or time.monotonic() < MEM.watch_until))
    MEM.fp.agree(v["k"], step, identity is not None and not v["diverged"])
    MEM.heal = None
    MEM.last = dict(v, step=step, pending=None if v["pending"] is None else dataclasses.asdict(v["pending"]))
    MEM.loss_max, MEM.norm_max, MEM.seen = v["loss_max"], v["norm_max"], int(v["seen"])
    if v["diverged"]:   # the state committed at step-1 differs between replicas: before anything else
        return _diverged(live, step, table, v, targets, cfg, rank, world, device)
    held = v["pending"]
    if held is None and v["fatal"] and not MEM.env_used and os.environ.get(rerun_env.ENV_RERUN_RANK):
        # this cycle follows a 16 but no rank kept the record (every rank is a new process: nothing
        # was committed, the checkpoint): the agent's environment says who moved, so its first hit here
        # is the re-run on other hardware, not a fresh one (never a second round of 16s)
        MEM.env_used = True
        held = Pending(step, OTHER_HARDWARE, int(os.environ[rerun_env.ENV_RERUN_RANK]), -1, -1, -1, 0.0, 0.0)
    pending = held if held is not None and held.step == step else None
    if held is not None and held.step < step:   # a record for a step passed: stale
        MEM.pending = None
    # (a record for a later step stays: a checkpoint fallback trains up to it, and its step is then judged
    # as the re-run's result)
    fatal = v["fatal"]
    if pending is None:
        if not fatal:
            _count(table, cfg, v)
            return Decision.GO
        suspect = v["suspect"]
        _committed_not_finite(step, table, max(suspect, fatal[0]), "", targets, cfg, rank, at_hit=True,
                              identity=live.shard_identity())
        MEM.hits[step] = MEM.hits.get(step, 0) + 1
        if MEM.hits[step] > MAX_HITS:   # never a loop: the step came back too often
            hit = Pending(step, SAME_DEVICE, suspect, -1, -1, -1, table[fatal[0]][LOSS], table[fatal[0]][NORM])
            return _data(step, table, hit, v, cfg, rank, f"hit {MEM.hits[step]} times in this process", targets)
        who = _ranks_text(fatal) if suspect < 0 else f"rank {suspect}"
        MEM.pending = Pending(step, SAME_DEVICE, suspect, int(table[suspect][NODE]) if suspect >= 0 else -1,
                              int(table[suspect][GROUP]) if suspect >= 0 else -1,
                              int(table[suspect][LOCAL]) if suspect >= 0 else -1,
                              table[fatal[0]][LOSS], table[fatal[0]][NORM])
        MEM.reruns += 1
        MEM.hit_at = time.perf_counter()
        arose = (f" (made in rank {suspect}'s own backward, before the all-reduce)"
                 if suspect >= 0 and _finite(table[suspect][LOSS]) and suspect in _own(table) else
                 " (each rank's own backward is watched in the re-run, to name the rank)"
                 if suspect < 0 and watch is None else "")
        say(f"step {step}: {_what(table, max(suspect, fatal[0]))} on {who}{arose}: not committed; re-running it from memory "
            f"on the same devices")
        _rerun(step)
    MEM.pending = pending
    if pending.stage == SAME_DEVICE:
        if fatal and pending.suspect < 0 and v["suspect"] >= 0:   # the re-run's watch names the rank
            s = v["suspect"]
            pending.suspect, pending.node = s, int(table[s][NODE])
            pending.group, pending.device = int(table[s][GROUP]), int(table[s][LOCAL])
        if not fatal:
            MEM.pending = None
            MEM.watch_until = time.monotonic() + cfg.transient_window_s   # the next one is named
            dev = device_name() if rank == pending.suspect else None
            line = (f"step {step}: the re-run on the same devices is clean: a transient fault"
                    + (f" on rank {pending.suspect}" if pending.suspect >= 0 else "")
                    + f"; training goes on with the re-run's result (the re-run from memory took "
                      f"{time.perf_counter() - MEM.hit_at:.3f} s)")
            persistent = _transient(pending, rank, cfg)
            say(line + _device_words(table, pending.suspect)
                + (": its second within the window: persistent, its node leaves" if persistent else ""),
                by=pending.suspect if persistent else 0)
            if persistent and rank == pending.suspect:
                _leave_node(step, f"a second transient fault on {dev} within {cfg.transient_window_s:g} s: "
                                  f"persistent")
            if persistent:
                _await_restart(f"rank {pending.suspect}'s node leaves")
            _count(table, cfg, v)
            return Decision.GO
        if pending.suspect < 0:
            return _data(step, table, pending, v, cfg, rank, "reproducible on every rank (it came before the "
                                                              "all-reduce: no single rank to move)", targets)
        pending.stage = OTHER_HARDWARE
        MEM.pending = pending
        say(f"step {step}: the re-run on the same devices hits again ({_what(table, pending.suspect)} on rank "
            f"{pending.suspect}): reproducible; rank {pending.suspect} moves to other hardware (exit "
            f"{EXIT_OTHER_HARDWARE}) and re-runs the step there", by=pending.suspect)
        if rank == pending.suspect:
            _exit(EXIT_OTHER_HARDWARE)
        _await_restart(f"rank {pending.suspect} moves to other hardware")
    # OTHER_HARDWARE: the suspect's rank re-ran the step elsewhere (another node, or at least another
    # device of its node: the agent may swap it with a sibling slot, which then runs on the suspect device)
    local = v["local"]
    node = pending.node
    if node == -1 and any(r != pending.suspect for r in local):   # the record came from the agent's environment
        # (every rank new, the old node unknown): the node the fault now shows on is the one it follows
        node = int(table[next(r for r in local if r != pending.suspect)][NODE])
    group, device = ((pending.group, pending.device) if pending.node != -1 or node == -1 else
                     next((int(row[GROUP]), int(row[LOCAL])) for row in table if int(row[NODE]) == node))
    moved_node = int(table[pending.suspect][NODE]) != node
    old_node = [r for r, row in enumerate(table) if int(row[NODE]) == node]
    hardware = ""
    if pending.suspect not in local and not (fatal and not local):
        hardware = f"on other hardware rank {pending.suspect} is clean"
    elif any(r != pending.suspect and r in old_node for r in local):
        hardware = (f"on other hardware rank {pending.suspect} hits again and so does "
                    f"{_ranks_text([r for r in local if r != pending.suspect and r in old_node])} on the node it "
                    f"was on: it follows that node, not the batch")
    if hardware:
        MEM.pending = None
        # the ranks still on that node leave with it; a suspect that moved to another node (a spare) stays
        leaving = sorted(set(old_node) | (set() if moved_node else {pending.suspect}))
        if not leaving:   # the node left already (the 16 sent the suspect to a spare): nothing more leaves
            say(f"step {step}: {hardware}: a persistent hardware fault on node {group} (device "
                f"{device} first), which has left the job; training goes on")
            _count(table, cfg, v)
            return Decision.GO
        say(f"step {step}: {hardware}: a persistent hardware fault on node {group} (device "
            f"{device} first): it leaves the job ({_ranks_text(leaving)} exit {EXIT_NODE_SUSPECT})",
            by=leaving[0])
        if rank in leaving:
            _exit(EXIT_NODE_SUSPECT)
        _await_restart(f"node {group} leaves")
    return _data(step, table, pending, v, cfg, rank, "reproducible on other hardware" +
                 ("" if moved_node else " (another device of the same node)"), targets)


def _own(table) -> List[int]:
    from ft_launcher.rank_monitor.rank_side.live.backward_watch import bad as bad_norm

    return [r for r, row in enumerate(table) if bad_norm(row[LOCAL_NORM])]


def _rerun(step: int, why: str = "the step guard"):
    """Every rank re-runs `step` from memory (rank_side.inprocess.StepRerun); the replicas compare
    their digests at the re-run."""
    from ft_launcher.rank_monitor.rank_side.inprocess import StepRerun
    from ft_launcher.rank_monitor.rank_side import gpu_commit

    gpu_commit.COMMITS.settle()   # step S-1 counts (the table's read waited for its GPU work)
    MEM.fp.forced = step
    raise StepRerun(f"step {step} is re-run from memory ({why})")


def _diverged(live, step: int, table, v: dict, targets, cfg: GuardConfig, rank: int, world: int, device) -> str:
    """Replicas of a shard hold different committed states (found by the fingerprint): the odd ones
    heal from a good replica and the step is re-run; with no majority (two replicas), a replica
    whose state is not finite is the odd one; else every rank loads its checkpoint. One collective
    first: each rank's state finite, and whether this is its device's second divergence within
    `transient_window_s` (then its node leaves, exit 17)."""
    groups = v["diverged"]
    MEM.hits[step] = MEM.hits.get(step, 0) + 1
    if MEM.hits[step] > MAX_HITS:   # it comes back after every heal or fallback: persistent, and no majority places it
        MEM.pending = None
        _stop_job(f"step {step}: the replicas' state as of step {step - 1} disagrees again "
                  f"({'; '.join(_ranks_text(g['ranks']) for g in groups)}), hit {MEM.hits[step]} times in this "
                  f"process: a persistent fault that no majority of replicas places", rank)
    nonfinite = set(_not_finite_state(targets)[0])
    for g in groups:
        if g["odd"] is None:
            odd = [r for r in g["ranks"] if r in nonfinite]
            if 0 < len(odd) < len(g["ranks"]):
                g["odd"], g["good"] = odd, [r for r in g["ranks"] if r not in odd]
    where = "; ".join(f"{_ranks_text(g['ranks'])} disagree" + (
        f" ({_ranks_text(g['odd'])} against {_ranks_text(g['good'])})" if g["odd"] is not None else
        " and no majority names the odd one") for g in groups)
    head = (f"step {step}: the replicas' parameters and optimizer state as of step {step - 1} differ ({where}): "
            f"silent data corruption in memory or in an optimizer step")
    if any(g["odd"] is None for g in groups):
        MEM.pending, MEM.heal = None, f"{head}; none is known good"
        say(f"{head}: none is known good: every rank loads its checkpoint")
        _rerun(step, "replicas disagree")
    odd = sorted(r for g in groups for r in g["odd"])
    _second_leaves(odd, head, "divergence of this device's state", step, cfg, rank, world, device)
    late = "" if MEM.fp.exact(step) else (
        f"; the digests last agreed at step {MEM.fp.agreed}, so the odd replica's gradients may have gone into its "
        f"peers' updates since: the replicas are equal again, but may differ from a run without the fault "
        f"(fingerprint_every=1 makes every heal exact)")
    MEM.pending, MEM.heal = None, "peer"
    if rank in odd:
        live.state_suspect()
    say(f"{head}: not committed; {_ranks_text(odd)} heal{'s' if len(odd) == 1 else ''} from a good replica "
        f"and the step is re-run{late}")
    _rerun(step, "replicas disagree")
    return Decision.GO   # not reached


def _count_transient(cfg: GuardConfig) -> bool:
    """One transient fault against this rank's device -> whether it is its second within the window."""
    now = time.monotonic()
    times = [t for t in MEM.transients.get(device_name(), []) if now - t <= cfg.transient_window_s]
    times.append(now)
    MEM.transients[device_name()] = times
    return len(times) >= 2


def _second_leaves(ranks: List[int], head: str, what: str, step: int, cfg: GuardConfig, rank: int, world: int,
                   device) -> None:
    """One fault counted against each of `ranks`' devices (one all_reduce): where it is that device's
    second within `transient_window_s`, its node leaves (exit 17) and the others wait for the restart."""
    import torch
    import torch.distributed as dist

    second = torch.zeros(world, dtype=torch.int64, device=device)
    second[rank] = int(rank in ranks and _count_transient(cfg))
    dist.all_reduce(second)
    leaving = [r for r, x in enumerate(second.tolist()) if x]
    if leaving:
        say(f"{head}: the second on {_ranks_text(leaving)}'s device within {cfg.transient_window_s:g} s: "
            f"persistent, its node leaves", by=leaving[0])
        if rank in leaving:
            _leave_node(step, f"a second {what} within {cfg.transient_window_s:g} s")
        _await_restart(f"{_ranks_text(leaving)}'s node leaves")


def _not_finite_state(targets, identity: Optional[int] = None):
    """-> (the ranks whose state, as committed: the parameters and optimizer state the step starts
    from, holds a NaN or Inf; those of them with a finite replica: a rank of the same shard
    `identity` whose state is finite). One all_reduce: every rank calls it."""
    import torch
    import torch.distributed as dist

    from ft_launcher.rank_monitor.rank_side import comm_backend

    rank, world = dist.get_rank(), dist.get_world_size()
    flags = torch.zeros(world, 2, dtype=torch.float64, device=comm_backend.transfer_device())
    flags[rank, 0] = float(not replica_fingerprint.finite(targets.state()))
    flags[rank, 1] = 0.0 if identity is None else float((identity & replica_fingerprint.MASK) + 1)
    dist.all_reduce(flags)
    rows = flags.tolist()
    bad = [r for r, row in enumerate(rows) if row[0]]
    return bad, [r for r in bad if rows[r][1] and any(not row[0] and row[1] == rows[r][1] for row in rows)]


def _committed_not_finite(step: int, table, suspect: int, why: str, targets, cfg: GuardConfig, rank: int,
                          at_hit: bool = False, identity: Optional[int] = None) -> None:
    """At a fatal hit (`identity`: this rank's shard identity) and again before the data's verdict:
    whether the state the step starts from, as committed, is finite on every rank (one all_reduce;
    a pass over the state, on a hit only). Where it is not, the fault came after the guard's figures
    (after the loop's own norm, in the optimizer step or in memory: a guarded step is never committed
    with a NaN loss or norm), was committed, and follows the live state, not the batch: a re-run from
    it cannot be clean and the data is not to blame. At a hit where every such rank has a finite
    replica, the re-run's digest heals it from that replica (_diverged); else the live state is
    abandoned and every rank loads its checkpoint, with one line (as without a LiveState:
    torchrun's restart); the fault counts against that rank's device, and a second within the
    window makes its node leave (never a loop)."""
    import torch.distributed as dist

    from ft_launcher.rank_monitor.rank_side import comm_backend

    poisoned, healable = _not_finite_state(targets, identity)
    if not poisoned or (at_hit and healable == poisoned):
        return
    MEM.pending = None
    head = (f"step {step}: {_what(table, suspect)}{f' ({why})' if why else ''}; the state committed at step "
            f"{step - 1} is not finite on {_ranks_text(poisoned)}: a fault after the guard's figures (after the "
            f"loop's own norm, in the optimizer step or in memory) was committed")
    _second_leaves(poisoned, head, "committed state that is not finite", step, cfg, rank, dist.get_world_size(),
                   comm_backend.transfer_device())
    MEM.heal = f"the state committed at step {step - 1} is not finite on {_ranks_text(poisoned)}"
    say(f"{head}: not the data; the live state is abandoned: every rank loads its checkpoint")
    _rerun(step, "the committed state is not finite")


def _data(step, table, pending: Pending, v, cfg: GuardConfig, rank: int, why: str, targets) -> str:
    """The data or the model: skip the batch (skip_bad_batches) or stop the job with one line;
    unless the committed state is not finite (_committed_not_finite: the checkpoint)."""
    MEM.pending = None
    suspect = pending.suspect if pending.suspect >= 0 else v["fatal"][0]
    _committed_not_finite(step, table, suspect, why, targets, cfg, rank)
    where = loader_position()
    text = (f"step {step}: {_what(table, suspect)} on rank {suspect}, {why}: the data or the model (rank "
            f"{suspect}'s batch at loader position {where})")
    if cfg.skip_bad_batches:
        say(text + "; skipping that batch (skip_bad_batches): its update is dropped on every rank")
        return Decision.SKIP
    _stop_job(text, rank)
    return Decision.GO   # not reached


def _stop_job(text: str, rank: int) -> None:
    """Stop the job with one line (global rank 0's ShutdownWorkload: the agent's line says it)."""
    if rank == 0 and not _request("ShutdownWorkload", text):
        print(f"ft_launcher: {text}: stopping the job", file=sys.stderr, flush=True)
        _exit(1)
    _await_restart("the job stops")


_POSITION = [lambda: "?"]   # how to read the loader position of the step being checked (LiveState sets it;
#                             read only when a decision names it, never on the step's path)


def loader_position() -> str:
    return _POSITION[0]()


def describe_position(states: Dict[str, Any]) -> str:
    """A loader's committed state dict(s) as a short `key=value` text (the integers near the top)."""
    parts = []

    def walk(prefix, value, depth):
        if len(parts) >= 16:
            return
        if isinstance(value, bool):
            return
        if isinstance(value, int):
            parts.append(f"{prefix}={value}")
        elif isinstance(value, dict) and depth < 3:
            for k, x in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x, depth + 1)

    for name, state in states.items():
        walk(name, state, 0)
    short, seen = [], set()
    for part in sorted(parts, key=lambda p: not any(w in p.split("=")[0].lower() for w in ("yield", "epoch"))):
        key, value = part.split("=")
        key = key.split(".")[-1].lstrip("_")
        if key not in seen:
            seen.add(key)
            short.append(f"{key}={value}")
    return ", ".join(short[:4]) or "unknown (no loader in the LiveState)"


def _transient(pending: Pending, rank: int, cfg: GuardConfig) -> bool:
    """Count the transient against the suspect's device (on the suspect's rank; the verdict is
    shared through the table's node column only as far as the suspect's own count goes). -> whether
    it is that device's second within the window (every rank learns it by one all_reduce)."""
    import torch
    import torch.distributed as dist

    second = int(rank == pending.suspect and _count_transient(cfg))
    from ft_launcher.rank_monitor.rank_side import comm_backend

    flag = torch.tensor([second], dtype=torch.int64, device=comm_backend.transfer_device())
    dist.all_reduce(flag)
    return bool(flag.item())


def _device_words(table, suspect: int) -> str:
    if suspect < 0:
        return ""
    return f" (counted against node {int(table[suspect][GROUP])} device {int(table[suspect][LOCAL])})"


def _count(table, cfg: GuardConfig, v: dict) -> None:
    """A step that goes on: its spikes said once; its values join the running maxima."""
    step = MEM.last["step"]
    if v["spikes"] and step not in MEM.spikes_said:   # one line per step (ranks alike said together)
        MEM.spikes_said.add(step)
        by_text: Dict[str, list] = {}
        for r, what in v["spikes"]:
            by_text.setdefault(what, []).append(r)
        parts = [f"{_ranks_text(ranks)}: {what}" for what, ranks in sorted(by_text.items(), key=lambda i: i[1])]
        say(f"step {step}: spike on " + "; ".join(parts) + ": not fatal, training goes on")
    if v["scaled"]:   # a GradScaler's overflow: skipped by the scaler, not a value to learn from
        return
    spiked = {r for r, _ in v["spikes"]}
    for r, row in enumerate(table):
        if r not in spiked:
            MEM.loss_max = max(MEM.loss_max, abs(row[LOSS]))
            MEM.norm_max = max(MEM.norm_max, row[NORM])
    MEM.seen += 1


def _leave_node(step: int, why: str) -> None:
    print(f"ft_launcher: step {step}: {why}: this node leaves the job (exit {EXIT_NODE_SUSPECT})",
          file=sys.stderr, flush=True)
    _exit(EXIT_NODE_SUSPECT)


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _await_restart(why: str) -> None:
    """A peer leaves (or the job stops): wait for the restart or the stop its exit brings (the
    agent's restart signal raises RestartInPlace here; the agent ends a rank it stops)."""
    from ft_launcher.rank_monitor.rank_side import sections

    end = time.monotonic() + PEER_WAIT_S
    while time.monotonic() < end:
        sections.heartbeat()
        time.sleep(0.02)
    raise RuntimeError(f"the step guard waited {PEER_WAIT_S:g} s for the restart after: {why}")
