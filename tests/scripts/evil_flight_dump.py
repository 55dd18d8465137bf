"""collective_hang.py, with global rank 1's flight-recorder dump replaced by a pickle whose
__reduce__ would create $EVIL_MARKER when unpickled: what anyone who reaches the job's
(unauthenticated) store could put there. The other ranks dump torch's trace as usual.

    evil_flight_dump.py <collective_hang.py's arguments>
"""
import os
import pickle
import runpy
import sys

from ft_launcher.rank_monitor import flight_recorder as FR

marker = os.environ["EVIL_MARKER"]


class CreatesTheMarker:
    def __reduce__(self):
        return open, (marker, "w")


_torch_dump = FR.dump


def dump(fr_dir, local_rank, cycle):
    if os.environ.get("RANK") == "1":
        FR._write(FR.dump_path(fr_dir, local_rank, cycle), pickle.dumps({"entries": [CreatesTheMarker()]}))
    else:
        _torch_dump(fr_dir, local_rank, cycle)


FR.dump = dump   # the dump thread looks the name up at each request
script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "collective_hang.py")
sys.argv = [script] + sys.argv[1:]
runpy.run_path(script, run_name="__main__")
