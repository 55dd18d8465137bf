"""Rank script for the warm-reserve tests: records how it was started, so a rank that a warm
reserve became can be compared with a cold one.

    reserve_probe.py OUT_DIR [--fail-rank R --go FILE] [--hold FILE] [--slow-lib] [--slow-start S]
                     [--spin] [--user-modules] [--patched-lib] [--set-env NAME=VALUE] [extra args]

Writes OUT_DIR/identity_<rank>_<cycle>.json (pid, argv, __name__, __file__, sys.path[0], cwd and
the launcher's variables) and prints one line to stdout and one to stderr. In cycle 0, rank R
waits for FILE to exist, then exits 1 (the test's restart, at a moment the test chooses). In
later cycles every rank waits for the --hold file, if given, then exits 0. --slow-lib imports
tests/warm_lib/slowwarm (instant in a rank, 600 s in a reserve). --slow-start S: in cycle 0, S
seconds before the first `step` (a long cold start). --spin: in cycle 0, after the first `step`,
every rank busy-loops instead of sleeping (a job that keeps the cores busy). --user-modules imports the user's
own `agent` and `rank_monitor` (beside the script) and records their WHO. --patched-lib patches
torch's device probe, then imports tests/warm_lib/device_probe, which copies its answer at import
(as a torchtitan script on a CPU does), and records that answer and whether the library was
loaded before the script ran. --set-env sets a variable before anything else (as a script that
sets OMP_NUM_THREADS before importing torch). Every identity says whether torch was loaded before
the script ran.
"""
import json
import os
import sys
import time

torch_preloaded = "torch" in sys.modules
if "--set-env" in sys.argv:
    os.environ.update([sys.argv[sys.argv.index("--set-env") + 1].split("=", 1)])

import ft_launcher as ft  # noqa: E402

out_dir = sys.argv[1]
rank, cycle = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])


def arg(name):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None


def wait_file(path, limit=120, spin=False):
    deadline = time.monotonic() + limit
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(f"rank {rank}: {path} never appeared")
        if not spin:
            time.sleep(0.02)


if "--slow-lib" in sys.argv:
    import slowwarm  # noqa: F401

names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
         "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "FT_TEST_TOKEN")
user_modules = None
if "--user-modules" in sys.argv:
    import agent
    import rank_monitor

    user_modules = [agent.WHO, rank_monitor.WHO]

patched_lib = None
if "--patched-lib" in sys.argv:
    preloaded = "device_probe" in sys.modules
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"
    import device_probe

    patched_lib = {"device_type": device_probe.DEVICE_TYPE, "preloaded": preloaded}

identity = {"pid": os.getpid(), "argv": sys.argv, "name": __name__, "file": __file__, "path0": sys.path[0],
            "cwd": os.getcwd(), "env": {k: os.environ.get(k) for k in names}, "user_modules": user_modules,
            "patched_lib": patched_lib, "torch_preloaded": torch_preloaded}
if cycle == 0 and arg("--slow-start"):
    time.sleep(float(arg("--slow-start")))
with ft.section("step"):  # the import record is written here
    tmp = os.path.join(out_dir, f".identity_{rank}_{cycle}")
    with open(tmp, "w") as fh:
        json.dump(identity, fh)
    os.replace(tmp, os.path.join(out_dir, f"identity_{rank}_{cycle}.json"))
print(f"probe stdout rank {rank} cycle {cycle}", flush=True)
print(f"probe stderr rank {rank} cycle {cycle}", file=sys.stderr, flush=True)
if cycle == 0 and arg("--fail-rank") is not None:
    if rank == int(arg("--fail-rank")):
        wait_file(arg("--go"), spin="--spin" in sys.argv)
        sys.exit(1)
    end = time.monotonic() + 600
    while "--spin" in sys.argv and time.monotonic() < end:
        pass
    time.sleep(max(0.0, end - time.monotonic()))  # stopped by the restart
if arg("--hold"):
    wait_file(arg("--hold"))
