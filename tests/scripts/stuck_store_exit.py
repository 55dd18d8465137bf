"""A thread stuck in a torch store call to a paused host, and the host dying while this process
exits (a store failover's old watcher, an abandoned connect). Exits 7: `safe` through
agent.rounds.store_threads.exit_past_stuck, `plain` by a normal interpreter exit (which aborts).

    python stuck_store_exit.py safe|plain

`plain` kills the host from a finalizer that runs while the interpreter finalizes (an object
held by `sys.last_value`, which finalization clears after it has marked the interpreter as
finalizing; a module global's __del__ may never run), and waits there: the stuck thread's call
then comes back into the finalizing interpreter every time. Killing the host just before the
exit raced with it: the call could come back first (DistNetworkError) and the process exit 7
without the abort this test needs. The host dies with this process however it ends (its
parent-death signal), so `safe`'s os._exit leaves nothing behind either.
"""
import datetime, os, signal, subprocess, sys, time
from torch.distributed import TCPStore
from ft_launcher.agent.rounds import store_threads
host = subprocess.Popen([sys.executable, "-c", "import ctypes, signal, time\n"
                         "ctypes.CDLL(None).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG\n"
                         "from torch.distributed import TCPStore\n"
                         "s = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
                         "print(s.port, flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
client = TCPStore("127.0.0.1", int(host.stdout.readline()), is_master=False, timeout=datetime.timedelta(seconds=2))
os.kill(host.pid, signal.SIGSTOP)
while open(f"/proc/{host.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":   # stopped before the call
    time.sleep(0.01)
thread = store_threads.start(lambda: client.add("k", 1), "stuck")
thread.join(3)   # past the call's 2 s timeout: still inside torch
assert thread.is_alive()


class _KillHostWhileFinalizing:
    def __del__(self, kill=os.kill, pid=host.pid, sleep=time.sleep):   # globals may be gone by now
        kill(pid, signal.SIGKILL)   # its connection resets: the stuck call comes back, mid-finalization
        sleep(5)                    # the abort comes during this wait


code = 7
if sys.argv[1] == "safe":
    sys.exit(store_threads.exit_past_stuck(code))
sys.last_value = _KillHostWhileFinalizing()
sys.exit(code)
