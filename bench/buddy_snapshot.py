"""The buddy copy's in-step cost alone: one process copies a model + AdamW state into a slot file in
/dev/shm (rank_monitor.rank_side.live.buddy_copy.write_snapshot, what `LiveState.commit` does every K
steps with `buddy_every=K`) and loads it back into the same objects (what a restore from a host
copy does), on the CPU or a GPU; it prints the seconds and GB/s of each, median of --reps.

    python bench/buddy_snapshot.py                        # CPU, ~47 MB (the live bench's MLP)
    python bench/buddy_snapshot.py --device cuda --width 8192 --layers 8    # a GPU, ~6.4 GB

No process group, no launcher: the slot file is made and removed here.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--layers", type=int, default=3, help="hidden Linear(width, width) layers")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)

    import torch
    import torch.nn as nn

    from ft_launcher.rank_monitor import buddy_store as S
    from ft_launcher.rank_monitor.rank_side.live import buddy_copy, live_objects

    dev = torch.device(args.device)
    layers = [nn.Linear(256, args.width)] + [nn.Linear(args.width, args.width) for _ in range(args.layers)]
    model = nn.Sequential(*layers, nn.Linear(args.width, 256)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(8, 256, device=dev)).sum().backward()
    opt.step()
    objects = {"model": model, "optimizer": opt}
    tracked = {name: live_objects.Tracked(name, obj) for name, obj in objects.items()}
    prefix = S.prefix_for(os.getpid(), 0)
    slot = S.Slot(prefix + "_own0")
    writes, loads, nbytes = [], [], 0
    try:
        for _ in range(args.reps + 1):   # the first write also reserves the slot's pages: not counted
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            states = {name: obj.state_dict() for name, obj in objects.items()}   # as LiveState's commit holds them
            nbytes = buddy_copy.write_snapshot(slot, states, 1, 0, 1, 1, 0, 0)
            writes.append(time.perf_counter() - t0)
            t0 = time.perf_counter()   # a restore from the host copy: read into the objects' tensors, load
            ready, _ = buddy_copy.read_snapshot(slot, {name: t.fresh() for name, t in tracked.items()}, dev)
            for name in sorted(ready):
                objects[name].load_state_dict(tracked[name].bind(ready[name], []))   # no DTensor here
            if dev.type == "cuda":
                torch.cuda.synchronize()
            loads.append(time.perf_counter() - t0)
    finally:
        slot.close()
        S.remove_agent_dir(os.getpid())
    w, ld = statistics.median(writes[1:]), statistics.median(loads[1:])
    print(f"device {dev}, state {nbytes / 1e6:.1f} MB ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M "
          f"parameters + AdamW): copy into host memory {w * 1000:.1f} ms ({nbytes / w / 1e9:.2f} GB/s), "
          f"load back {ld * 1000:.1f} ms ({nbytes / ld / 1e9:.2f} GB/s); median of {args.reps}")


if __name__ == "__main__":
    main()
