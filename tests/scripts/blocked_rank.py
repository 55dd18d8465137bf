"""A rank under ft.restartable whose main thread blocks, without the GIL, where the in-place restart
signal's Python handler cannot run until the call returns (tests/monitor/unit/test_restart_watcher.py and
bench/gpu_live_checks.py act as its agent: they write the request and wake its watcher).

    blocked_rank.py OUT HOW SECONDS [--cycles K]

HOW (in cycles 0..K-1, default K=1; cycle K returns at once):
  sleep   time.sleep(SECONDS) with the restart signal blocked in the main thread meanwhile (as
          in a CUDA sync, which retries its wait when a signal interrupts it)
  recv    a socket recv that no peer answers, signal blocked likewise (SECONDS: its timeout)
  store   a TCPStore wait for a key nobody sets (a torch op that releases the GIL; SECONDS: its
          timeout), signal blocked likewise, also in the store's threads (torch's wait runs Python's
          signal handlers while it waits, when a thread of the process takes the signal)
  cuda    torch.cuda._sleep of about SECONDS, then torch.cuda.synchronize() (a GPU only); with
          --nccl the rank first joins a world-size-1 NCCL group (init form given by --init)
Files in OUT (monotonic ns), per cycle c: `blocked_<c>` (about to block), `reacted_<c+1>` (the restart
watcher's hook ran for request c+1: "<ns> <request> <process groups before the abort>"),
`unblocked_<c>` (the call returned), `handler_<c>` (the exception that left the blocked code:
RestartInPlace from the handler, or an aborted collective's), `act_<c>` (restart_watcher.last_act()
as JSON, after it); `done_cycle_<K>`.
"""
import argparse
import json
import os
import signal
import socket
import sys
import time

import ft_launcher as ft
from ft_launcher.rank_monitor.rank_side import inprocess, restart_watcher


def mark(out, name, text=""):
    tmp = os.path.join(out, f".{name}.tmp")
    with open(tmp, "w") as fh:
        fh.write(f"{time.monotonic_ns()} {text}".strip())
    os.replace(tmp, os.path.join(out, name))


def groups():
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_initialized():
        return 0
    from torch.distributed import distributed_c10d as c10d

    return len(c10d._world.pg_names)


def init(kind):
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.update(RANK="0", WORLD_SIZE="1")
    torch.cuda.set_device(0)
    if kind == "none":
        dist.init_process_group()
    elif kind == "device_id":
        dist.init_process_group(device_id=torch.device("cuda", 0))
    else:
        dist.init_process_group(kind)
    dist.all_reduce(torch.ones(1, device="cuda"))   # the communicator exists


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("how", choices=("sleep", "recv", "store", "cuda"))
    p.add_argument("seconds", type=float)
    p.add_argument("--nccl", action="store_true")
    p.add_argument("--init", default="nccl")
    p.add_argument("--cycles", type=int, default=1)
    args = p.parse_args()
    restart_watcher.ON_REQUEST.append(lambda request: mark(args.out, f"reacted_{request}", f"{request} {groups()}"))

    def train():
        cycle = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        if cycle >= args.cycles:
            mark(args.out, f"done_cycle_{cycle}")
            return
        try:
            if args.nccl:
                init(args.init)
            block = {inprocess.IN_PLACE_SIGNAL}
            if args.how == "cuda":
                import torch
            else:   # held back in this thread and in every thread started from here on (the store's)
                signal.pthread_sigmask(signal.SIG_BLOCK, block)
            if args.how == "store":   # made (torch imported, which holds the GIL a while) before the block
                from datetime import timedelta

                import torch.distributed as dist

                store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=args.seconds))
            mark(args.out, f"blocked_{cycle}")
            try:
                if args.how == "sleep":
                    time.sleep(args.seconds)
                elif args.how == "recv":
                    a, b = socket.socketpair()
                    a.settimeout(args.seconds)
                    try:
                        a.recv(1)
                    except socket.timeout:
                        pass
                elif args.how == "store":
                    try:
                        store.wait(["never set"])
                    except Exception:  # noqa: BLE001 - its timeout
                        pass
                else:
                    torch.cuda._sleep(int(args.seconds * 1.4e9))   # ~ SECONDS of GPU cycles on a ~1.4-2 GHz GPU
                    torch.cuda.synchronize()
                mark(args.out, f"unblocked_{cycle}")
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, block)   # the pending signal's handler runs now
            time.sleep(30)   # never reached in a test: the handler raises first
        except BaseException as exc:  # RestartInPlace, or an aborted collective's error
            mark(args.out, f"handler_{cycle}", type(exc).__name__)
            mark(args.out, f"act_{cycle}", json.dumps(restart_watcher.last_act()))
            raise

    ft.restartable(train)()


if __name__ == "__main__":
    main()
