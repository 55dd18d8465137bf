"""Two gloo ranks (torch.multiprocessing) that run a training function CALLS times; each call ends
as scripts end: DDP alive, a closing all_gather_object, destroy_process_group(), return. The
function's frame drops DDP's Reducer, the group's last reference, holding the GIL, while a gloo
worker may still be freeing the all-gather's work and wait for the GIL: a deadlock (pytorch#56297's
class). `hold` as argv[3]: each call runs between rank_side.call_groups' hold() and release(), as
ft.restartable runs it. A call that does not end within CALL_LIMIT s prints every thread's stack and
exits 3.

    python gather_at_return.py PORT CALLS [hold]
"""
import faulthandler
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

CALL_LIMIT = 10


def train(rank, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
    ddp(torch.randn(2, 4)).sum().backward()
    gathered = [None, None]
    dist.all_gather_object(gathered, {"rank": rank, "checksum": float(ddp.module.weight.sum())})
    dist.destroy_process_group()


def rank_main(rank, port, calls, hold):
    from ft_launcher.rank_monitor.rank_side import call_groups

    for call in range(calls):
        faulthandler.dump_traceback_later(CALL_LIMIT, exit=True)
        if hold:
            call_groups.hold()
        train(rank, port + call)   # a new store port per call: no wait for the last one's to close
        if hold:
            call_groups.release()
        faulthandler.cancel_dump_traceback_later()
    print(f"rank {rank}: {calls} calls ended", flush=True)


if __name__ == "__main__":
    mp.spawn(rank_main, args=(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:] == ["hold"]), nprocs=2)
