"""NVRx's own RankMonitorClient under our rank monitor, beside NVRx 0.4.1's own monitor: the cost
of a section enter+exit pair and of a heartbeat, one run, as a ratio; our own client's
shared-memory hot path for reference.

    python bench/nvrx_client.py

Three runs of bench/nvrx_client_rank.py, one rank each:
- NVRx's client under ft_launcher (our monitor answers it on FT_RANK_MONITOR_IPC_SOCKET);
- NVRx's client against NVRx 0.4.1's RankMonitorServer, started as its launcher starts it
  (RankMonitorServer.run_in_subprocess) with the rank's variables set as its launcher sets them;
- ft_launcher's own client (ft.section / ft.heartbeat) under ft_launcher.
NVRx's 0.4.1 client waits for a reply to every message, so a pair is two socket round trips
under either monitor; 0.7's client with skip_section_response sends without waiting.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_jobs import Job, bench_env  # noqa: E402

RANK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nvrx_client_rank.py")


def under_ft_launcher(out: str, name: str, client: str) -> dict:
    job = Job("ft_launcher", 1, ["--ft-rank-section-timeouts", "step:60"], [out, name, client], script=RANK)
    try:
        job.proc.wait(timeout=300)
    finally:
        job.stop()
    with open(os.path.join(out, f"{name}.json")) as fh:
        return json.load(fh)


def under_nvrx_server(out: str) -> dict:
    from nvidia_resiliency_ext.fault_tolerance import FaultToleranceConfig, RankMonitorServer

    sock = os.path.join(out, "nvrx_rmon.socket")
    cfg = FaultToleranceConfig(rank_section_timeouts={"step": 60.0}, log_level=logging.WARNING)
    server = RankMonitorServer.run_in_subprocess(cfg, sock)
    try:
        env = bench_env(FT_RANK_MONITOR_IPC_SOCKET=sock, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        subprocess.run([sys.executable, RANK, out, "nvrx_server", "nvrx"], env=env, check=True, timeout=300)
    finally:
        server.terminate()
        server.join(10)
    with open(os.path.join(out, "nvrx_server.json")) as fh:
        return json.load(fh)


def main() -> None:
    out = tempfile.mkdtemp(prefix="ftbench_nvrx_client_")
    rows = {
        "NVRx client, our monitor": under_ft_launcher(out, "ours_monitor", "nvrx"),
        "NVRx client, NVRx 0.4.1 monitor": under_nvrx_server(out),
        "ft_launcher client (shared memory)": under_ft_launcher(out, "ours_client", "ours"),
    }
    print(f"{'':38s} {'section pair':>14s} {'heartbeat':>12s}")
    for name, r in rows.items():
        print(f"{name:38s} {r['section_pair_ns'] / 1e3:11.2f} us {r['heartbeat_ns'] / 1e3:9.2f} us")
    ours, theirs = rows["NVRx client, our monitor"], rows["NVRx client, NVRx 0.4.1 monitor"]
    print(f"NVRx client, our monitor / NVRx's monitor: section pair "
          f"{ours['section_pair_ns'] / theirs['section_pair_ns']:.2f}x, heartbeat "
          f"{ours['heartbeat_ns'] / theirs['heartbeat_ns']:.2f}x")


if __name__ == "__main__":
    main()
