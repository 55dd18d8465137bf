"""Runs NVRx's own RankMonitorClient against NVRx's own RankMonitorServer (nvidia-resiliency-ext
0.4.1, no ft_launcher involved) and writes what its state_dict() returns.

    nvrx_real_client.py WORKDIR OUT.json

One rank (a gloo process group of one: NVRx's calculations are collectives) opens 'setup' once
and 'step' 12 times with a heartbeat after each, computes the 'setup' and 'step' timeouts (not
'checkpointing', which keeps its configured 420 s), the out-of-section and the heartbeat
timeouts, and writes `state_dict()` to OUT.json.
"""
import json
import os
import sys
import time

import torch.distributed as dist
from nvidia_resiliency_ext.fault_tolerance import FaultToleranceConfig, RankMonitorClient, RankMonitorServer

workdir, out = sys.argv[1], sys.argv[2]
cfg = FaultToleranceConfig(rank_section_timeouts={"setup": 600.0, "step": 180.0, "checkpointing": 420.0},
                           rank_out_of_section_timeout=300.0, initial_rank_heartbeat_timeout=900.0,
                           rank_heartbeat_timeout=600.0, safety_factor=5.0, workload_check_interval=1.0)
socket_path = os.path.join(workdir, "rmon.sock")
server = RankMonitorServer.run_in_subprocess(cfg, socket_path)
os.environ.update(FT_RANK_MONITOR_IPC_SOCKET=socket_path, RANK="0", LOCAL_RANK="0")
dist.init_process_group("gloo", init_method=f"file://{os.path.join(workdir, 'pg')}", rank=0, world_size=1)
try:
    client = RankMonitorClient()
    client.init_workload_monitoring()
    client.start_section("setup")
    time.sleep(0.05)
    client.end_section("setup")
    for _ in range(12):
        client.start_section("step")
        time.sleep(0.02)
        client.end_section("step")
        client.send_heartbeat()
    assert client.calculate_and_set_section_timeouts(selected_sections=["setup", "step"])
    assert client.calculate_and_set_hb_timeouts()
    with open(out, "w") as fh:
        json.dump(client.state_dict(), fh)
    client.shutdown_workload_monitoring()
finally:
    dist.destroy_process_group()
    server.terminate()
    server.join(10)
