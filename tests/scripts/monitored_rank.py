"""Rank script of the rank-monitor tests: sections and heartbeats with no torch, so a cycle
starts in milliseconds. Every rank runs setup, STEPS steps (with a nested 'fwd' section and a
heartbeat after each) and a checkpointing section, appending one line per step to
<out>/rank_<RANK>.txt. The rank named by --rank, in the cycle named by --cycle, misbehaves as
--fault says instead:

    setup | step | checkpointing | fwd   sleep forever inside that section
    oos                                    sleep forever between two sections
    no_heartbeat                           never send a heartbeat (sections as usual)
    heartbeat_stops                        heartbeat a few times, then keep stepping without
    busy_gil                               spin in pure Python inside 'step' (holds the GIL)
    ignore_term                            like 'step', but ignore SIGTERM (writes <out>/term_<RANK>)
"""
import argparse
import os
import signal
import sys
import time

import ft_launcher as ft

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--fault", default=None)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--cycle", type=int, default=0)
p.add_argument("--steps", type=int, default=40)
p.add_argument("--step-time", type=float, default=0.02)
args = p.parse_args()

rank = int(os.environ["RANK"])
cycle = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
fault = args.fault if (rank == args.rank and cycle == args.cycle) else None
progress = open(os.path.join(args.out, f"rank_{rank}.txt"), "a", buffering=1)


def hang_forever():
    while True:
        time.sleep(3600)


def busy_loop():
    n = 0
    while True:
        n += 1


def on_term(signum, frame):
    with open(os.path.join(args.out, f"term_{rank}"), "w") as fh:
        fh.write(str(os.getpid()))


if fault == "ignore_term":
    signal.signal(signal.SIGTERM, on_term)

if fault != "no_heartbeat":
    ft.heartbeat()
with ft.section("setup"):
    if fault == "setup":
        hang_forever()
    time.sleep(0.01)

for step in range(args.steps):
    with ft.section("step"):
        with ft.section("fwd"):
            if fault == "fwd":
                hang_forever()
            time.sleep(args.step_time / 2)
        if fault in ("step", "ignore_term") and step == 3:
            hang_forever()
        if fault == "busy_gil" and step == 3:
            busy_loop()
        time.sleep(args.step_time / 2)
    if fault == "oos" and step == 3:
        hang_forever()
    if fault not in ("no_heartbeat",) and not (fault == "heartbeat_stops" and step >= 3):
        ft.heartbeat()
    progress.write(f"{cycle} {step}\n")

with ft.section("checkpointing"):
    if fault == "checkpointing":
        hang_forever()
    time.sleep(0.01)
print(f"rank {rank} done in cycle {cycle}", flush=True)
sys.exit(0)
