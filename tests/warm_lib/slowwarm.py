"""A library module that imports at once in a rank and takes 600 s in a warm reserve (no RANK
yet): lets a test hold a reserve in its warm-up, asleep, or spinning on the CPU where
FT_TEST_SPIN_WARM=1; with FT_TEST_WARM_CPU=S it is done once the reserve has used S seconds of CPU."""
import os
import time

if "RANK" not in os.environ and os.environ.get("FT_TEST_WARM_CPU"):
    while time.process_time() < float(os.environ["FT_TEST_WARM_CPU"]):
        pass
elif "RANK" not in os.environ:
    end = time.monotonic() + 600
    while os.environ.get("FT_TEST_SPIN_WARM") == "1" and time.monotonic() < end:
        pass
    time.sleep(max(0.0, end - time.monotonic()))
