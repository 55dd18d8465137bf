"""How often a gloo FSDP rank dies of SIGABRT at its interpreter's end after its training completed,
with and without ft_launcher's exit settle (rank_monitor.rank_side.exit_settle), in the same run.

Each job: --ranks processes on gloo (no launcher), fully_shard over a 2-layer MLP, a few AdamW
steps, the full parameters' checksum through DTensor.full_tensor() (the end of most FSDP scripts),
destroy_process_group(), exit. Jobs alternate: one plain, one with exit_settle.install(). A gloo
worker that frees the last all-gather's output while the interpreter finalizes aborts the process
("terminate called without an active exception"); the settle lets it finish first.

    python bench/exit_race.py --jobs 40 --ranks 4

Prints per mode: rank exits, aborts (exit -6), their rate, and the settle's median time at exit.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def rank_main(rank: int, world: int, port: int, settle: bool) -> None:
    import atexit

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if settle:
        from ft_launcher.rank_monitor.rank_side import exit_settle

        atexit.register(lambda: print(f"SETTLE_END {time.monotonic():.6f}", flush=True))   # runs after the settle
        exit_settle.install()
        atexit.register(lambda: print(f"SETTLE_START {time.monotonic():.6f}", flush=True))  # runs before it
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step * 1009 + rank))
        opt.zero_grad()
        nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        opt.step()
    with torch.no_grad():
        total = float(sum(p.full_tensor().double().sum() for p in model.parameters()))
    if rank == 0:
        print(f"FINAL {total!r}", flush=True)
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=40, help="jobs per mode")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--settle", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank is not None:
        rank_main(args.rank, args.ranks, args.port, args.settle)
        return
    counts = {False: [0, 0], True: [0, 0]}   # mode -> [exits, aborts]
    settle_s = []
    other = []
    for _ in range(args.jobs):
        for mode in (False, True):
            port = _port()
            procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank", str(r), "--ranks",
                                       str(args.ranks), "--port", str(port)] + (["--settle"] if mode else []),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                     for r in range(args.ranks)]
            for proc in procs:
                out, err = proc.communicate(timeout=120)
                counts[mode][0] += 1
                if proc.returncode == -6:
                    counts[mode][1] += 1
                elif proc.returncode:
                    other.append((mode, proc.returncode, err[-300:]))
                marks = dict(ln.split() for ln in out.splitlines() if ln.startswith("SETTLE_"))
                if "SETTLE_START" in marks and "SETTLE_END" in marks:
                    settle_s.append(float(marks["SETTLE_END"]) - float(marks["SETTLE_START"]))
    for mode, name in ((False, "plain"), (True, "exit settle")):
        exits, aborts = counts[mode]
        print(f"{name:12s} rank exits {exits:4d}  SIGABRT {aborts:3d}  ({100.0 * aborts / max(1, exits):.1f} %)")
    if settle_s:
        print(f"exit settle: median {statistics.median(settle_s) * 1e3:.1f} ms, max {max(settle_s) * 1e3:.1f} ms "
              f"per rank exit")
    for mode, code, err in other:
        print(f"other exit ({'settle' if mode else 'plain'}): {code}: {err}")


if __name__ == "__main__":
    main()
