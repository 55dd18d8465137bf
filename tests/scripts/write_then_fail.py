"""A rank without torch: in cycle 0 writes TEXT into PATH and exits 1; in later cycles exits 0.

    python write_then_fail.py PATH TEXT
"""
import os
import sys

if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
    with open(sys.argv[1], "w") as fh:
        fh.write(sys.argv[2] + "\n")
    sys.exit(1)
print("ran again", flush=True)
