"""Rank script: start a grandchild, write both pids to <dir>/pids_<rank>, then wait for a
signal. SIGTERM prints a line and exits 0 (or is ignored with --ignore-term)."""
import os
import signal
import subprocess
import sys
import time

out_dir = sys.argv[1]
rank = os.environ["RANK"]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def on_term(signum, frame):
    print(f"rank {rank} got SIGTERM", flush=True)
    if "--ignore-term" not in sys.argv:
        sys.exit(0)


signal.signal(signal.SIGTERM, on_term)
tmp = os.path.join(out_dir, f".pids_{rank}")
with open(tmp, "w") as fh:
    fh.write(f"{os.getpid()} {child.pid}\n")
os.replace(tmp, os.path.join(out_dir, f"pids_{rank}"))
while True:
    time.sleep(600)
