"""Live state on one GPU, one process (no process group): where a kept or received state lands and
what the per-step snapshot and the replicas' digest cost on the device. The figures for issue 30.

    python bench/live_state_gpu.py                 # CUDA if there is one, else the CPU
    python bench/live_state_gpu.py --gb 2 --device cpu

1. kept: a model + AdamW (non-capturable: its `step` on the CPU) trained a few steps, its committed
   state moved into fresh objects (live_wire.move_state, the code a kept rank runs): the optimizer's
   tensors are the previous ones (no copy), `step` stays on the CPU, exp_avg on the device; the
   parameters are copied into the fresh model's own tensors. Prints the move's time.
2. received: the same state sent over an in-process wire (live_wire.send_state, then recv_state
   into fresh objects with the device as the transfer device): the parameters land in the model's
   own tensors, exp_avg on the device, `step` on the CPU (as the sender had it), bit-exact.
3. the per-step snapshot (live_objects.Tracked.snapshot: a model with BatchNorm, AdamW, the RNG),
   in microseconds, beside a training step of the same model.
4. the digest (live_wire.digest) of --gb GB of state: ms per GB.
Exit status 0 when every check holds; each line says what it measured.
"""
import argparse
import math
import sys
import time

import torch
import torch.nn as nn

from ft_launcher.rank_monitor.rank_side.live import live_objects as O, live_rng
from ft_launcher.rank_monitor.rank_side.live import live_wire as W


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(device, width):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Dropout(0.1),
                          nn.Linear(width, width)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # non-capturable: `step` on the CPU
    return model, opt


def train(model, opt, device, width, steps):
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        model(torch.randn(64, width, device=device)).square().mean().backward()
        opt.step()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--gb", type=float, default=1.0)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    ok = True

    def check(cond, what):
        nonlocal ok
        ok = ok and bool(cond)
        print(f"  {'ok  ' if cond else 'FAIL'} {what}", flush=True)

    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
          f"torch {torch.__version__}, width {args.width}")
    model, opt = build(device, args.width)
    train(model, opt, device, args.width, 3)
    kept = {n: O.Tracked(n, o) for n, o in (("model", model), ("optimizer", opt))}
    for t in kept.values():
        t.snapshot()
    state_mb = sum(x.numel() * x.element_size() for t in kept.values()
                   for x in W.flat(t.committed()).values()) / 1e6

    print(f"1. kept: {state_mb:.1f} MB moved into fresh objects")
    new_model, new_opt = build(device, args.width)
    sync(device)
    t0 = time.perf_counter()
    ready = {n: W.move_state(kept[n].committed(), O.Tracked(n, o).fresh()[0])
             for n, o in (("model", new_model), ("optimizer", new_opt))}
    new_opt.load_state_dict(ready["optimizer"])
    sync(device)
    took = time.perf_counter() - t0
    first = next(iter(new_model.parameters()))
    state = new_opt.state[first]
    check(state["exp_avg"] is opt.state[next(iter(model.parameters()))]["exp_avg"], "exp_avg moved, not copied")
    check(state["exp_avg"].device.type == device.type and state["step"].device.type == "cpu",
          f"exp_avg on {state['exp_avg'].device}, step on {state['step'].device} (non-capturable AdamW)")
    check(all(torch.equal(a, b) for a, b in zip(model.parameters(), new_model.parameters())),
          "parameters copied into the fresh model's own tensors, equal")
    print(f"     move + load: {took * 1e3:.2f} ms")

    print("2. received over an in-process wire (transfer device = the device)")
    messages = []
    for n in ("model", "optimizer"):
        W.send_state(kept[n].committed(), device, lambda t: messages.append(t.clone()))
    wire = iter(messages)
    recv_model, recv_opt = build(device, args.width)
    own = [p.data_ptr() for p in recv_model.parameters()]
    got = {}
    sync(device)
    t0 = time.perf_counter()
    for n, o in (("model", recv_model), ("optimizer", recv_opt)):
        got[n], _ = W.recv_state(O.Tracked(n, o).fresh()[0], device, lambda t: t.copy_(next(wire)))
    recv_opt.load_state_dict(got["optimizer"])
    sync(device)
    took = time.perf_counter() - t0
    check([p.data_ptr() for p in recv_model.parameters()] == own, "parameters received into the model's own tensors")
    state = recv_opt.state[next(iter(recv_model.parameters()))]
    check(state["exp_avg"].device.type == device.type and state["step"].device.type == "cpu",
          f"received exp_avg on {state['exp_avg'].device}, step on {state['step'].device}")
    check(all(torch.equal(a, b) for a, b in zip(model.parameters(), recv_model.parameters())), "bit-exact")
    print(f"     receive + load: {took * 1e3:.2f} ms ({state_mb / max(took, 1e-9):.0f} MB/s, in-process copies)")

    print("3. per-step snapshot (model with BatchNorm, AdamW, RNG)")
    objs = {"model": O.Tracked("model", model), "optimizer": O.Tracked("optimizer", opt),
            "_rng": O.Tracked("_rng", live_rng.Rng())}
    for t in objs.values():
        t.snapshot()
    sync(device)
    n = 50
    t0 = time.perf_counter()
    for _ in range(n):
        for t in objs.values():
            t.snapshot()
    sync(device)
    snap = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    train(model, opt, device, args.width, 10)
    sync(device)
    step = (time.perf_counter() - t0) / 10
    print(f"     {snap * 1e6:.0f} us per commit vs a {step * 1e3:.2f} ms step ({snap / step * 100:.2f} %)")

    print(f"4. digest of {args.gb:g} GB")
    big = {"w": torch.randn(int(args.gb * 1e9 / 4), device=device)}
    W.digest(big)
    sync(device)
    t0 = time.perf_counter()
    d, nbytes = W.digest(big)
    sync(device)
    took = time.perf_counter() - t0
    print(f"     {took * 1e3:.1f} ms = {took * 1e3 / (nbytes / 1e9):.0f} ms/GB")

    from ft_launcher.rank_monitor.rank_side.live import replica_fingerprint as F
    halves = [big["w"][: big["w"].numel() // 2], big["w"][big["w"].numel() // 2:]]   # two tensors, one pass each
    print(f"5. the replicas' fingerprint (replica_fingerprint.digest, int64 words) of {args.gb:g} GB")
    F.digest(halves, device).item()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        F.digest(halves, device).item()
        times.append(time.perf_counter() - t0)
    took = min(times)
    print(f"     {took * 1e3:.2f} ms = {took * 1e3 / args.gb:.2f} ms/GB (best of 5; the guard's K keeps it within 1 % "
          f"of a step: every {max(1, math.ceil(took / 0.01 / 0.1))} steps of 100 ms)")
    print("all checks hold" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
