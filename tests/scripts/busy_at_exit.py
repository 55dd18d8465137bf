"""A process that ends while a daemon thread is inside a torch op (the GIL released) and whose
interpreter's end takes a second (a module-level object's __del__ sleeps): the op returns while the
interpreter finalizes, and CPython's pthread_exit of that thread aborts the process
("terminate called without an active exception"). `settle` as argv[1]: the rank's exit settle
(rank_side.exit_settle) is installed first, and the process exits 0.

    python busy_at_exit.py [settle]
"""
import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

if sys.argv[1:] == ["settle"]:
    from ft_launcher.rank_monitor.rank_side import exit_settle

    exit_settle.install()


class SlowEnd:
    def __del__(self):   # the interpreter's end lasts a second: the op below returns inside it
        time.sleep(1.0)


slow_end = SlowEnd()
inside = threading.Event()


def busy():
    a = torch.randn(1500, 1500)
    inside.set()
    for _ in range(4):   # ~0.3 s of matmuls, each with the GIL released
        a = torch.tanh(a @ a)


torch.set_num_threads(1)
threading.Thread(target=busy, daemon=True).start()
inside.wait()
print("main done", flush=True)
