"""A thread stuck in a torch store call to a paused host, and the host dying as this process exits
(a store failover's old watcher, an abandoned connect). Exits 7: `safe` through
agent.rounds.store_threads.exit_past_stuck, `plain` by a normal interpreter exit (which aborts).

    python stuck_store_exit.py safe|plain
"""
import datetime, os, signal, subprocess, sys, time
from torch.distributed import TCPStore
from ft_launcher.agent.rounds import store_threads
host = subprocess.Popen([sys.executable, "-c", "import time\nfrom torch.distributed import TCPStore\n"
                         "s = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
                         "print(s.port, flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
client = TCPStore("127.0.0.1", int(host.stdout.readline()), is_master=False, timeout=datetime.timedelta(seconds=2))
os.kill(host.pid, signal.SIGSTOP)
thread = store_threads.start(lambda: client.add("k", 1), "stuck")
thread.join(3)   # past the call's 2 s timeout: still inside torch
assert thread.is_alive()
host.kill()      # its connection resets while this process exits
code = 7
sys.exit(store_threads.exit_past_stuck(code) if sys.argv[1] == "safe" else code)
