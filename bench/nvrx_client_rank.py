"""Rank script of bench/nvrx_client.py: times section enter+exit pairs and heartbeats of one
client in this process and writes the per-call medians (ns) as JSON to OUT/<name>.json.

    nvrx_client_rank.py OUT NAME nvrx|ours

`nvrx`: NVRx's own RankMonitorClient (nvidia_resiliency_ext.fault_tolerance, as Megatron imports
it), whichever monitor its FT_RANK_MONITOR_IPC_SOCKET names; `ours`: ft_launcher.section /
heartbeat (the shared-memory hot path).
"""
import json
import os
import statistics
import sys
import time

out, name, client_kind = sys.argv[1], sys.argv[2], sys.argv[3]
clock = time.perf_counter_ns
BATCH, BATCHES = (100, 40) if client_kind == "nvrx" else (1000, 200)


def per_call(body) -> float:
    body()   # warm
    samples = []
    for _ in range(BATCHES):
        t0 = clock()
        body()
        samples.append((clock() - t0) / BATCH)
    return statistics.median(samples)


if client_kind == "nvrx":
    from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

    client = RankMonitorClient()
    client.init_workload_monitoring()

    def sections():
        for _ in range(BATCH):
            client.start_section("step")
            client.end_section("step")

    def heartbeats():
        for _ in range(BATCH):
            client.send_heartbeat()
else:
    import ft_launcher as ft

    sec = ft.section("step")

    def sections():
        for _ in range(BATCH):
            with sec:
                pass

    def heartbeats():
        for _ in range(BATCH):
            ft.heartbeat()

result = {"section_pair_ns": per_call(sections), "heartbeat_ns": per_call(heartbeats)}
if client_kind == "nvrx":
    client.shutdown_workload_monitoring()
with open(os.path.join(out, f"{name}.json"), "w") as fh:
    json.dump(result, fh)
