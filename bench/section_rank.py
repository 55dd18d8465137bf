"""Rank script of bench/sections.py: times section enter+exit pairs and heartbeats in this
process, in batches, and appends the per-call medians (ns) as JSON lines to OUT/rank_<RANK>.jsonl.

Phases: 'monitor running'; then, if --stop-monitor-phase, it writes OUT/ready_<RANK>, waits for
OUT/stopped (the driver has SIGSTOPped the monitors) and measures again ('monitor stopped').
"""
import json
import os
import statistics
import sys
import time

import ft_launcher as ft

out = sys.argv[1]
two_phases = "--stop-monitor-phase" in sys.argv
rank = os.environ.get("RANK", "0")
BATCH, BATCHES = 1000, 200
clock = time.perf_counter_ns


def per_call(body) -> float:
    samples = []
    for _ in range(BATCHES):
        t0 = clock()
        body()
        samples.append((clock() - t0) / BATCH)
    return statistics.median(samples)


sec = ft.section("step")
ft.heartbeat()


def sections():
    for _ in range(BATCH):
        with sec:
            pass


def sections_by_name():
    for _ in range(BATCH):
        with ft.section("step"):
            pass


def heartbeats():
    for _ in range(BATCH):
        ft.heartbeat()


def empty_loop():
    for _ in range(BATCH):
        pass


def measure(phase):
    row = {"phase": phase, "section_pair_ns": per_call(sections), "section_by_name_pair_ns": per_call(sections_by_name),
           "heartbeat_ns": per_call(heartbeats), "loop_ns": per_call(empty_loop)}
    with open(os.path.join(out, f"rank_{rank}.jsonl"), "a") as fh:
        fh.write(json.dumps(row) + "\n")


measure("monitor running")
if two_phases:
    open(os.path.join(out, f"ready_{rank}"), "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(out, "stopped")) and time.monotonic() < deadline:
        time.sleep(0.01)
    measure("monitor stopped")
