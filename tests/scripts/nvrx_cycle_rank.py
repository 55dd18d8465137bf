"""A rank without torch for NVRx 0.7's launcher features: prints what NVRX_CURRENT_CYCLE_INFO
points at (`rank R cycle C info cycle=N ranks=... link=PATH`), one line on stdout and one on stderr, and
with CKPT_FILE adds ADVANCE to the iteration it holds (rank 0); then global rank FAIL_RANK exits 1
in cycles below FAIL_CYCLES (-1: every cycle) while the others wait to be stopped; in the
other cycles every rank exits 0.

    python nvrx_cycle_rank.py FAIL_RANK FAIL_CYCLES [CKPT_FILE ADVANCE]
"""
import json
import os
import sys
import time

fail_rank, fail_cycles = int(sys.argv[1]), int(sys.argv[2])
cycle, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
link = os.environ.get("NVRX_CURRENT_CYCLE_INFO")
if link:
    with open(link) as fh:
        info = json.load(fh)
    print(f"rank {rank} cycle {cycle} info cycle={info['cycle_number']} ranks={info['active_ranks']} link={link}",
          flush=True)
print(f"rank {rank} cycle {cycle} to stdout", flush=True)
print(f"rank {rank} cycle {cycle} to stderr", file=sys.stderr, flush=True)
if len(sys.argv) > 3 and rank == 0:
    path, advance = sys.argv[3], int(sys.argv[4])
    try:
        with open(path) as fh:
            now = int(fh.read().strip() or 0)
    except FileNotFoundError:
        now = 0
    with open(path + ".tmp", "w") as fh:
        fh.write(str(now + advance))
    os.replace(path + ".tmp", path)
failing = fail_cycles < 0 or cycle < fail_cycles
if rank == fail_rank and failing:
    time.sleep(0.3)   # the others' lines are out first
    print(f"rank {rank} failing in cycle {cycle}", flush=True)
    sys.exit(1)
if failing:
    time.sleep(30)    # stopped at the restart
print(f"rank {rank} done in cycle {cycle}", flush=True)
