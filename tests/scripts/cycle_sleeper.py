"""A rank without torch for rendezvous tests: appends `<cycle> <rank> <time>` to
<dir>/rank_<RANK>.txt, then sleeps SECONDS in cycle 0 and exits 0 at once in later cycles.

    python cycle_sleeper.py DIR SECONDS
"""
import os
import sys
import time

out, seconds = sys.argv[1], float(sys.argv[2])
cycle = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
rank = os.environ.get("RANK", "0")
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, f"rank_{rank}.txt"), "a") as fh:
    fh.write(f"{cycle} {rank} {time.time():.6f}\n")
if cycle == 0:
    time.sleep(seconds)
