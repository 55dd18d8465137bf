"""Rank script of the in-place carrier's tests (no torch, no agent): under ft.restartable, waits
inside its function until it is restarted in place; in cycle 0 the rank named by RAISE raises
RuntimeError at once instead (it then waits, alive, for its restart).

    restartable_rank.py RAISE
"""
import os
import sys
import time

import ft_launcher as ft


@ft.restartable
def train():
    if os.environ["RANK"] == sys.argv[1] and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        raise RuntimeError("simulated exception in step 3")
    while True:
        time.sleep(0.01)


train()
