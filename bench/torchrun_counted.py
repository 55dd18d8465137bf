"""torch.distributed.run with every store call of the agent counted (calls and payload bytes per
method), written to $FT_BENCH_TORCH_STORE_STATS/<pid>.json at exit. Used by
bench/rendezvous_scale.py; it changes nothing else: the arguments are torchrun's.

Calls made from Python on TCPStore and PrefixStore objects are counted, which covers torch's c10d
rendezvous (its backend's `_call_store`) and the agent's own store use after it.
"""
import atexit
import datetime
import json
import os
import sys
import time

import torch.distributed as dist
from torch.distributed import run

STATS = {}
MARKS = {}
METHODS = ("set", "get", "add", "compare_set", "multi_get", "multi_set", "check", "wait", "delete_key",
           "append", "num_keys", "queue_push", "queue_pop")


def _size(value):
    if isinstance(value, (bytes, str)):
        return len(value)
    if isinstance(value, (list, tuple)):
        return sum(_size(v) for v in value)
    return 8 if isinstance(value, (int, float)) else 0


def _wrap(cls, name):
    inner = getattr(cls, name, None)
    if inner is None:
        return

    def call(self, *args, **kwargs):
        row = STATS.setdefault(name, [0, 0])
        row[0] += 1
        row[1] += sum(_size(a) for a in args if not isinstance(a, datetime.timedelta))
        result = inner(self, *args, **kwargs)
        row[1] += _size(result)
        return result
    setattr(cls, name, call)


for cls in (dist.TCPStore, dist.PrefixStore):
    for method in METHODS:
        _wrap(cls, method)


def _write():
    out = os.environ.get("FT_BENCH_TORCH_STORE_STATS")
    if out:
        with open(os.path.join(out, f"{os.getpid()}.json"), "w") as fh:
            json.dump({"calls": {"all": STATS}, "marks": MARKS}, fh)


atexit.register(_write)
MARKS["started_at"] = time.time()
if __name__ == "__main__":
    sys.argv[0] = "torchrun"
    run.main()
