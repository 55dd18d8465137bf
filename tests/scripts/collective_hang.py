"""Rank script: a few all-reduces in 'step' sections, then at step HANG_STEP the rank named by
HANG_RANK sleeps inside its step (a Python-level hang), while the others wait for it in the
step's all-reduce: the collective it never joins. Cycle 0 only; later cycles run to the end.
Optional STEP_TIME: seconds each step of cycle 0 sleeps (a job slow enough for a fault to land in);
HOW: `sleep` (default) or `gil`: hang in native code that holds the GIL (a regular expression
that backtracks for ages), so no other thread of the rank runs.

    collective_hang.py STEPS HANG_RANK HANG_STEP [STEP_TIME [HOW]]"""
import os
import re
import sys
import time

import torch
import torch.distributed as dist

import ft_launcher as ft

steps, hang_rank, hang_step = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
step_time = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
how = sys.argv[5] if len(sys.argv) > 5 else "sleep"
rank = int(os.environ["RANK"])
cycle = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
ft.heartbeat()
with ft.section("setup"):
    dist.init_process_group("gloo")
for step in range(1, steps + 1):
    with ft.section("step"):
        if cycle == 0 and step == hang_step and rank == hang_rank:
            if how == "gil":
                re.match(r"(a+)+$", "a" * 64 + "b")
            time.sleep(3600)
        if cycle == 0 and step_time:
            time.sleep(step_time)
        t = torch.ones(8)
        dist.all_reduce(t)
    ft.heartbeat()
print(f"rank {rank} done cycle {cycle}", flush=True)
dist.destroy_process_group()
