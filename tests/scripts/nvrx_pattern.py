"""Rank script: NVRx's section-based integration pattern, unchanged but for the import.

    nvrx_pattern.py STATE [--slow-rank R --slow-step S]

init_workload_monitoring, load_state_dict (from STATE when it exists), setup / step /
checkpointing sections with heartbeats, calculate_and_set_section_timeouts and
calculate_and_set_hb_timeouts, then rank 0 saves state_dict() to STATE. With --slow-rank, that
rank stalls in 'step' number S for 30 s in the first cycle (a hang, as far as a computed timeout
is concerned).
"""
import argparse
import json
import os
import time

from ft_launcher import RankMonitorClient

p = argparse.ArgumentParser()
p.add_argument("state")
p.add_argument("--slow-rank", type=int, default=None)
p.add_argument("--slow-step", type=int, default=0)
args = p.parse_args()
rank = int(os.environ["RANK"])
slow = rank == args.slow_rank and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"

client = RankMonitorClient()
client.init_workload_monitoring()
if os.path.exists(args.state):
    with open(args.state) as fh:
        client.load_state_dict(json.load(fh))
    if rank == 0:
        print(f"loaded step timeout {client.section_timeouts.section['step']:.3f}", flush=True)

client.start_section("setup")
time.sleep(0.05)
client.end_section("setup")
for step in range(20):
    client.start_section("step")
    time.sleep(30 if (slow and step == args.slow_step) else 0.05)
    client.end_section("step")
    client.send_heartbeat()
client.start_section("checkpointing")
time.sleep(0.05)
client.end_section("checkpointing")

assert client.calculate_and_set_section_timeouts(), "sections not computed"
assert client.calculate_and_set_hb_timeouts(), "heartbeat timeouts not computed"
if rank == 0:
    with open(args.state + ".tmp", "w") as fh:
        json.dump(client.state_dict(), fh)
    os.replace(args.state + ".tmp", args.state)
client.shutdown_workload_monitoring()
