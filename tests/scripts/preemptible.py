"""Rank script: a rank that handles preemption. Writes <dir>/ready_<RANK>, then waits; on
SIGTERM writes sigterm_<RANK>, spends GRACE seconds "saving a checkpoint", writes saved_<RANK>
and exits 143. Never outlives a broken test by much (exits 3 after 120 s).

    preemptible.py DIR [GRACE]
"""
import os
import signal
import sys
import time


def write(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def main():
    out_dir = sys.argv[1]
    grace = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    rank = os.environ["RANK"]

    def on_term(signum, frame):
        write(os.path.join(out_dir, f"sigterm_{rank}"), str(os.getpid()))
        time.sleep(grace)
        write(os.path.join(out_dir, f"saved_{rank}"), str(os.getpid()))
        os._exit(143)

    signal.signal(signal.SIGTERM, on_term)
    write(os.path.join(out_dir, f"ready_{rank}"), str(os.getpid()))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.2)
    sys.exit(3)


if __name__ == "__main__":
    main()
