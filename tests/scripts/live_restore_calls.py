"""What `LiveState.restore()` does to the objects of each rank: 3 ranks, a model, AdamW and a
counting object in one LiveState. In cycle 0, rank 2 raises after the commit of step 4 (its state
is suspect: it receives), ranks 0 and 1 keep theirs (one of them sends). Every rank writes
`<out>/restore_<rank>_<cycle>.json` after restore(): the step, how often restore() called each
object's state_dict() and load_state_dict(), where AdamW's `step` tensors are, whether a kept
rank's optimizer state is the previous call's own tensors (moved, not copied), and whether the
previous call's model and optimizer are gone (weak references).

usage: live_restore_calls.py OUT
"""
import gc
import json
import os
import random
import sys
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

import ft_launcher as ft

OUT = sys.argv[1]
CALLS = {"state_dict": 0, "load_state_dict": 0}
BEFORE = {}   # this process: the previous call's objects (weak) and its optimizer tensors' addresses


class Counted(nn.Sequential):
    def state_dict(self, *args, **kwargs):
        CALLS["state_dict"] += 1
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        CALLS["load_state_dict"] += 1
        return super().load_state_dict(*args, **kwargs)


class Tally:
    """A user's object (neither module nor optimizer): a counter."""

    def __init__(self):
        self.seen = 0

    def state_dict(self):
        CALLS["state_dict"] += 1
        return {"seen": self.seen}

    def load_state_dict(self, state):
        CALLS["load_state_dict"] += 1
        self.seen = state["seen"]


def train():
    rank, cycle = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo")
    torch.manual_seed(1)
    random.seed(1)
    model = Counted(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tally = Tally()
    live = ft.LiveState(model=model, optimizer=opt, tally=tally)
    for key in CALLS:
        CALLS[key] = 0
    start = live.restore()
    gc.collect()
    state = [opt.state[p] for p in model.parameters()]
    record = {"step": start, "calls": dict(CALLS), "seen": tally.seen,
              "step_devices": sorted({s["step"].device.type for s in state if "step" in s}),
              "moved": [s["exp_avg"].data_ptr() for s in state if "exp_avg" in s] == BEFORE.get("ptrs"),
              "previous_gone": all(ref() is None for ref in BEFORE.get("refs", []))}
    with open(os.path.join(OUT, f"restore_{rank}_{cycle}.json"), "w") as fh:
        json.dump(record, fh)
    ddp = nn.parallel.DistributedDataParallel(model)
    for step in range((start or 0) + 1, 9):
        g = torch.Generator().manual_seed(step * 100 + rank)
        x = torch.randn(16, 8, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True)).backward()
        with live.commit(step):
            opt.step()
            tally.seen += 1
        if cycle == 0 and step == 4:
            BEFORE["ptrs"] = [opt.state[p]["exp_avg"].data_ptr() for p in model.parameters()]
            BEFORE["refs"] = [weakref.ref(model), weakref.ref(opt)]
            dist.barrier()
            if rank == 2:
                raise RuntimeError("simulated exception after the commit of step 4")
    del ddp
    dist.destroy_process_group()


if __name__ == "__main__":
    ft.restartable(train)()
