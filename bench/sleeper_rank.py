"""The rank of bench/rendezvous_scale.py: imports nothing heavy (no torch), so only the launcher's
protocol is measured. Writes `<RANK> <unix time at start>` to <out dir>/rank_<RANK>, sleeps, exits 0.

    python bench/sleeper_rank.py OUT_DIR SECONDS
"""
import os
import sys
import time

started = time.time()
out, seconds = sys.argv[1], float(sys.argv[2])
rank = os.environ.get("RANK", "0")
with open(os.path.join(out, f"rank_{rank}"), "w") as fh:
    fh.write(f"{rank} {started:.6f}\n")
time.sleep(seconds)
