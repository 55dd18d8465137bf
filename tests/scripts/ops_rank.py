"""Rank script for the operations tests (stragglers, no-progress stop, workload control,
preemption): `step` sections that sleep, no torch, no collectives.

    ops_rank.py OUT_DIR [--steps N] [--step-time S] [--slow-rank R --slow-time S]
                [--fail-rank R --fail-at-step K]   (cycle 0 fails at step K; later cycles before any
                                                    step, while the other ranks wait for it)
                [--request Continue|ExcludeThisNode|ShutdownWorkload --request-rank R --request-at K]
                [--preempt]                        (report SIGTERM through ft_launcher.preempted())

Each rank appends "cycle step" lines to OUT_DIR/steps_<RANK>; exits 0 after N steps.
"""
import argparse
import json
import os
import sys
import time

import ft_launcher as ft

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--steps", type=int, default=20)
p.add_argument("--step-time", type=float, default=0.05)
p.add_argument("--slow-rank", type=int, default=None)
p.add_argument("--slow-time", type=float, default=0.0)
p.add_argument("--fail-rank", type=int, default=None)
p.add_argument("--fail-at-step", type=int, default=3)
p.add_argument("--fail-cycles", type=int, default=-1, help="fail only in cycles below this (-1: every cycle)")
p.add_argument("--request", default=None)
p.add_argument("--request-rank", type=int, default=0)
p.add_argument("--request-at", type=int, default=3)
p.add_argument("--preempt", action="store_true")
args = p.parse_args()

rank = int(os.environ.get("RANK", 0))
cycle = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
if 0 <= args.fail_cycles <= cycle:
    args.fail_rank = None
os.makedirs(args.out, exist_ok=True)
log = open(os.path.join(args.out, f"steps_{rank}"), "a", buffering=1)


def write(name, data):
    tmp = os.path.join(args.out, f".{name}")
    with open(tmp, "w") as fh:
        json.dump(data, fh)
    os.replace(tmp, os.path.join(args.out, name))


if args.preempt:
    calls = []

    @ft.on_preemption
    def on_preemption(p):
        calls.append(p.grace_left)

    assert ft.preempted() is None
    write(f"ready_{rank}", {"pid": os.getpid()})

step_time = args.step_time + (args.slow_time if rank == args.slow_rank else 0.0)
if args.fail_rank == rank and cycle > 0:
    print(f"rank {rank}: failing before any step in cycle {cycle}", flush=True)
    sys.exit(1)
if args.fail_rank is not None and cycle > 0:   # the others wait for it (as in a collective) until stopped
    end = time.monotonic() + 120
    while time.monotonic() < end:
        ft.heartbeat()
        time.sleep(0.1)
    sys.exit(3)
step = 0
while step < args.steps or args.preempt:
    step += 1
    with ft.section("step"):
        time.sleep(step_time)
    ft.heartbeat()
    log.write(f"{cycle} {step}\n")
    if args.fail_rank == rank and step == args.fail_at_step:
        print(f"rank {rank}: failing at step {step} in cycle {cycle}", flush=True)
        sys.exit(1)
    if args.request and rank == args.request_rank and step == args.request_at and cycle == 0:
        client = ft.RankMonitorClient()
        client.init_workload_monitoring()
        client.send_workload_control_request(
            ft.WorkloadControlRequest(ft.WorkloadAction[args.request], f"test asks for {args.request}"))
    if args.preempt:
        p = ft.preempted()
        if p:   # save, then leave before the grace runs out
            write(f"preempted_{rank}", {"grace_left": p.grace_left, "callback_grace": calls[0],
                                        "signal": p.signal, "step": step})
            sys.exit(0)
print(f"rank {rank} done in cycle {cycle}", flush=True)
