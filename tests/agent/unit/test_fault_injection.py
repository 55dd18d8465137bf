"""The simulated-fault injector (agent/recovery.fault_injection.py) on real processes: a planned fault
fires into its rank once due, and never into anything else when that rank has already ended
(it used to reach os.kill(-1, ...): every process the user may signal)."""
import signal
import subprocess
import sys
import time
import types

from ft_launcher.agent.recovery.fault_injection import FaultInjector
from ft_launcher.rank_monitor.config import FaultToleranceConfig


class Said:
    def __init__(self):
        self.lines, self.events = [], []

    def say(self, line):
        self.lines.append(line)

    def event(self, kind, line=None, **fields):
        self.events.append((kind, line, fields))


def injector(count=1):
    ft = FaultToleranceConfig(simulate_fault=True, simulated_fault_type="rank_killed", simulated_fault_rank=1,
                              simulated_fault_base_delay=0.0, simulated_fault_count=count)
    fired = [0]

    def claim():
        fired[0] += 1
        return fired[0]
    return FaultInjector(ft, claim, lambda: fired[0], Said()), fired


def test_a_due_fault_kills_its_rank_and_an_ended_rank_gets_nothing():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for count in (1, -1):
            inj, fired = injector(count)
            inj.plan(0, 2, 0, 2, time.monotonic_ns())
            assert inj.pending is not None and inj.pending.rank == 1
            ended = types.SimpleNamespace(rank=1, exitcode=0, pid=proc.pid)   # rank 1 ended before the fault
            inj.inject_due([ended], time.monotonic_ns())
            assert inj.pending is None and fired[0] == 0 and not inj.events.events
            assert inj.fire(-1) is None and inj.fire(0) is None
        assert proc.poll() is None and bystander.poll() is None
        inj, fired = injector()
        inj.plan(0, 2, 0, 2, time.monotonic_ns())
        inj.inject_due([types.SimpleNamespace(rank=1, exitcode=None, pid=proc.pid)], time.monotonic_ns())
        assert proc.wait(10) == -signal.SIGKILL and fired[0] == 1
        assert [e[0] for e in inj.events.events] == ["fault_injected"] and bystander.poll() is None
    finally:
        for p in (proc, bystander):
            p.kill()
            p.wait()
