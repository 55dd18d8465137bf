"""A restartable job (ft.restartable, no process group) in which one rank cannot reach its restart
point: in cycle 0, rank STUCK ignores the in-place restart signal (as training code stuck in a C
call, or one that changed our signal's handler, would) and keeps running; once it does, rank FAIL
raises. From cycle 1 on every rank writes `<out>/done_<rank>_<cycle>_<pid>` and returns.

usage: stuck_restart.py OUT STUCK FAIL
"""
import os
import signal
import sys
import time

import ft_launcher as ft
from ft_launcher.rank_monitor.rank_side.inprocess import IN_PLACE_SIGNAL

OUT, STUCK, FAIL = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])


def train():
    rank, cycle = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    ignoring = os.path.join(OUT, "ignoring")
    if cycle == 0 and rank == STUCK:
        signal.signal(IN_PLACE_SIGNAL, signal.SIG_IGN)
        with open(ignoring, "w") as fh:
            fh.write(str(os.getpid()))
        while True:
            time.sleep(0.05)
    if cycle == 0 and rank == FAIL:
        while not os.path.exists(ignoring):
            time.sleep(0.01)
        raise RuntimeError("simulated exception while a peer ignores restarts")
    with open(os.path.join(OUT, f"done_{rank}_{cycle}_{os.getpid()}"), "w"):
        pass


if __name__ == "__main__":
    ft.restartable(train)()
