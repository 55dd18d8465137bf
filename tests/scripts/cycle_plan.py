"""A rank without torch whose every cycle follows a plan: appends `<cycle> <rank> <time>` to
<dir>/rank_<RANK>.txt, then does what PLAN says for its cycle (a comma-separated list, one word
per cycle, the last repeated):

    fail    raise the same RuntimeError from the same line (an identical traceback every time)
    step    complete one 'step' section (progress), then fail as above
    hold    sleep 120 s (the test does something to the job meanwhile)

    python cycle_plan.py DIR PLAN
"""
import os
import sys
import time

import ft_launcher as ft

out, plan = sys.argv[1], sys.argv[2].split(",")
cycle = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
rank = os.environ.get("RANK", "0")
word = plan[min(cycle, len(plan) - 1)]
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, f"rank_{rank}.txt"), "a") as fh:
    fh.write(f"{cycle} {rank} {time.time():.6f}\n")
if word == "hold":
    time.sleep(120)
if word == "step":
    with ft.section("step"):
        pass
    time.sleep(0.5)   # the agent reads the step count from its monitor before the failure
raise RuntimeError("the same failure in every cycle")
