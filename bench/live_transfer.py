"""The live-state transfer alone: rank 0 sends a model + AdamW state to rank 1 with live state's own
wire (live_wire.send_state/recv_state, each object's committed state as live_objects keeps it) over
a 2-process gloo group (no launcher), as restore() does for a replaced rank (fresh objects on the
receiver each repetition). Isolates the wire from a recovery.

    python bench/live_transfer.py                    # the bench MLP at --width 2048 (113 MB, 32 tensors)
    python bench/live_transfer.py --layers 150       # 150 Linear(256, 256): 118 MB in 750 tensors

Run it from the checkout whose live_state.py is measured (that root goes first on sys.path).
Prints one line per repetition (MB, seconds, MB/s) and one 113 MB tensor sent alone (the wire's
raw speed). One intra-op thread per rank, as ft_launcher sets OMP_NUM_THREADS=1 for 2 ranks.
"""
import argparse
import os
import socket
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build(args):
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    if args.layers:
        model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(args.layers)])
    else:
        w = args.width
        model = nn.Sequential(nn.Linear(256, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(),
                              nn.Linear(w, 256))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)


def rank_main(rank, port, args):
    sys.path.insert(0, ROOT)
    import torch
    import torch.distributed as dist
    from ft_launcher.rank_monitor.rank_side.live import live_objects, live_wire

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model, opt = build(args)
    if rank == 0:
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(8, 256)).sum().backward()
            opt.step()
    cpu, times, nbytes = torch.device("cpu"), [], 0
    for rep in range(args.reps):
        if rank == 1 and rep:
            model, opt = build(args)
        tracked = [live_objects.Tracked(n, o) for n, o in (("model", model), ("optimizer", opt))]
        if rank == 0:
            for t in tracked:
                t.snapshot()
        dist.barrier()
        t0 = time.perf_counter()
        with torch.no_grad():
            if rank == 0:
                for t in tracked:
                    live_wire.send_state(t.committed(), cpu, lambda x: dist.send(x, 1))
            else:
                nbytes = 0
                for t in tracked:
                    state, n = live_wire.recv_state(t.fresh()[0], cpu, lambda x: dist.recv(x, 0))
                    t.obj.load_state_dict(t.bind(state, t.meshes))
                    nbytes += n
        times.append(time.perf_counter() - t0)
        if rank == 1:
            print(f"rep {rep}: {nbytes / 1e6:.1f} MB in {times[-1]:.3f} s = {nbytes / 1e6 / times[-1]:.0f} MB/s",
                  flush=True)
    raw = torch.randn(113_000_000 // 4) if rank == 0 else torch.empty(113_000_000 // 4)
    dist.barrier()
    t0 = time.perf_counter()
    dist.send(raw, 1) if rank == 0 else dist.recv(raw, 0)
    if rank == 1:
        t = statistics.median(times)
        print(f"median {t:.3f} s ({nbytes / 1e6 / t:.0f} MB/s); raw: one 113 MB tensor in "
              f"{time.perf_counter() - t0:.3f} s", flush=True)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=2048, help="the bench MLP's hidden width (2048: 113 MB of state)")
    p.add_argument("--layers", type=int, default=0, help="instead: this many Linear(256, 256) layers")
    p.add_argument("--reps", type=int, default=6)
    args = p.parse_args()
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(port, args), nprocs=2)


if __name__ == "__main__":
    main()
