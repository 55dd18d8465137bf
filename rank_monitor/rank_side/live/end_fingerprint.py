"""The replicas' last comparison, at the job's end: a flip in memory or in an optimizer step within
the last K-1 steps (K: the fingerprint's period, replica_fingerprint) was never compared during the
run. When the script destroys its process group, each rank of a guarded LiveState posts the digest
of its state (parameters and optimizer state, as the guard's fingerprint takes it) with its shard
identity to the job's store, and reads its peers' digests, waiting at most a bound (a rank that
never reaches the end costs that wait, never a hang). Replicas that disagree are said in one line
(the odd ones when a majority names them; the last step the digests agreed); so is a comparison
that could not be made. Nothing is healed here: the training is over; the line says which
replica's state to keep, or that the checkpoint at or before the last agreement is the good one.

Through the store, not a collective: a peer that ended otherwise (no destroy, an exit) would leave a
collective waiting for ever.
"""
from __future__ import annotations

from datetime import timedelta
from typing import List, Optional

WAIT_S = 60.0          # at least this long for the slowest peer (a rank saving the final checkpoint first)
WAIT_STEPS = 30        # or this many of its step times, if longer
PREFIX = "ft_launcher/fp_end"


class _Done:
    cycle: Optional[int] = None   # the cycle compared (once per cycle: a second destroy compares nothing;
    #                               an in-place restart's next end compares again)


_DONE = _Done()


def _guarded_live():
    """The guarded LiveState this process holds committed state for, and its last committed step."""
    from ft_launcher.rank_monitor.rank_side.live.live_registry import REG

    for held in REG.held.values():
        live = held.live
        if getattr(live, "guard", None) is not None and getattr(live, "_guarded", False):
            return live, held.step
    return None, None


def compare() -> Optional[str]:
    """Post this rank's digest, read every rank's, say a disagreement. -> the line said, or None."""
    import torch.distributed as dist

    from ft_launcher.rank_monitor.rank_side import comm_backend
    from ft_launcher.rank_monitor.rank_side.live import replica_fingerprint, step_guard

    from ft_launcher.rank_monitor.rank_side.live.live_state import _cycle

    if _DONE.cycle == _cycle() or not (dist.is_available() and dist.is_initialized()):
        return None
    live, step = _guarded_live()
    if live is None or not step_guard.MEM.fp.on:
        return None
    targets = live.guard_targets()
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2 or not targets.found:
        return None
    _DONE.cycle = _cycle()
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    d = int(replica_fingerprint.digest(targets.state(), comm_backend.transfer_device()).item())
    identity = live.shard_identity() or 0
    scope = f"{PREFIX}/{_cycle()}"   # the cycle's ranks (a new process and a kept one alike)
    store.set(f"{scope}/{rank}", f"{identity} {d} {step}")
    step_s = step_guard.MEM.fp.step_s or 0.0
    bound = max(WAIT_S, WAIT_STEPS * step_s)
    keys = [f"{scope}/{r}" for r in range(world)]
    try:
        store.wait(keys, timedelta(seconds=bound))
    except Exception:  # noqa: BLE001 - a timeout: who is missing is read key by key
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        line = (f"the replicas' last comparison at the job's end (step {step}) was not made: "
                f"{step_guard._ranks_text(missing)} did not reach the end within {bound:.0f} s; "
                f"{_last(step_guard.MEM.fp.agreed)}")
        step_guard.say(line, by=min(r for r in range(world) if r not in missing))
        return line
    rows = [store.get(k).decode().split() for k in keys]
    return judge_rows(rows, step, step_guard.MEM.fp.agreed)


def judge_rows(rows: List[List[str]], step: int, agreed: Optional[int]) -> Optional[str]:
    """Every rank's (identity, digest, step) -> the line said when replicas disagree, else None."""
    from ft_launcher.rank_monitor.rank_side.live import step_guard

    table = []
    for identity, digest, _ in rows:
        row = [0.0] * step_guard.COLS
        d = int(digest) & ((1 << 64) - 1)
        row[step_guard.FP_ON], row[step_guard.FP_ID] = 1.0, float(int(identity) & ((1 << 32) - 1))
        row[step_guard.FP_HI], row[step_guard.FP_LO] = float(d >> 32), float(d & ((1 << 32) - 1))
        table.append(row)
    groups = step_guard.diverged(table)
    if not groups:
        return None
    where = "; ".join(f"{step_guard._ranks_text(g['ranks'])} disagree" + (
        f" ({step_guard._ranks_text(g['odd'])} against {step_guard._ranks_text(g['good'])})" if g["odd"] is not None
        else " and no majority names the odd one") for g in groups)
    keep = ("keep a majority replica's state" if all(g["odd"] is not None for g in groups)
            else "no replica is known good")
    line = (f"at the job's end (step {step}) the replicas' parameters and optimizer state differ ({where}): "
            f"silent data corruption in memory or in an optimizer step; {_last(agreed)}; the final state is not "
            f"exact: {keep}, or resume from a checkpoint "
            + (f"at or before step {agreed}" if agreed is not None else "made before the fault"))
    step_guard.say(line)
    return line


def _last(agreed: Optional[int]) -> str:
    return (f"the digests last agreed at step {agreed}" if agreed is not None
            else "no comparison had agreed in this process")
