"""A rank without torch: prints the CPUs it may run on (`local rank L cpus 0,1`)."""
import os

print(f"local rank {os.environ['LOCAL_RANK']} cpus {','.join(map(str, sorted(os.sched_getaffinity(0))))}", flush=True)
