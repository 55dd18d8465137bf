"""A library module that imports at once in a rank and takes 600 s in a warm reserve (no RANK
yet): lets a test hold a reserve in its warm-up."""
import os
import time

if "RANK" not in os.environ:
    time.sleep(600)
