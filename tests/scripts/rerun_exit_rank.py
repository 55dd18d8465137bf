"""Rank script of the exit-16/17 tests (no torch): under ft.restartable, each call of the function
appends `cycle RANK LOCAL_RANK pid FT_LAUNCHER_RERUN_OF FT_LAUNCHER_RERUN_MOVED` to OUT/rank_<RANK>.txt,
then completes `step` sections. In cycle 0 the rank RANK exits CODE after STEPS steps (the others
step on until they are restarted); with `again`, the same rank exits CODE again at once in cycle 1
(before any step), and its peers wait without a step, as a collective job's would.
Otherwise every rank returns after STEPS steps.

    rerun_exit_rank.py OUT RANK CODE STEPS [again]
"""
import os
import sys
import time

import ft_launcher as ft

out, who, code, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
again = sys.argv[5:] == ["again"]


@ft.restartable
def train():
    env = os.environ
    cycle, rank = int(env["TORCHELASTIC_RESTART_COUNT"]), env["RANK"]
    with open(os.path.join(out, f"rank_{rank}.txt"), "a") as f:
        f.write(f"{cycle} {rank} {env['LOCAL_RANK']} {os.getpid()} {env.get('FT_LAUNCHER_RERUN_OF', '-')} "
                f"{env.get('FT_LAUNCHER_RERUN_MOVED', '-')}\n")
    if cycle == 1 and again:
        if rank == who:
            sys.exit(code)
        while True:   # its step would wait on the rank that exits: until the launcher stops it
            time.sleep(0.01)
    n = 0
    while True:
        with ft.section("step"):
            time.sleep(0.02)
        n += 1
        if rank == who and cycle == 0 and n == steps:
            sys.exit(code)
        if n >= steps and cycle > 0:
            return
        if cycle == 0 and n >= 10 * steps:   # a bound: the failing rank's peers wait for the restart
            return


train()
