"""A rank without torch: prints the CPUs it may run on (`local rank L cpus 0,1`), in one write so
that two ranks sharing the launcher's stdout never interleave inside a line."""
import os

line = f"local rank {os.environ['LOCAL_RANK']} cpus {','.join(map(str, sorted(os.sched_getaffinity(0))))}\n"
os.write(1, line.encode())
