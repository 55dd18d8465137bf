"""Liveness told by the kernel (agent/rounds/keepalive.py): a node's liveness port, a watcher's
connection to it, and `probe`. A paused process is alive (its kernel holds the connection and
answers connects); a killed one is dead at once (EOF on the watcher's connection, connects
refused). Real processes; no store."""
import os
import select
import signal
import socket
import subprocess
import sys
import time

from ft_launcher.agent.rounds.keepalive import probe, watch_connection

LISTENER = ("import select, sys\n"
            "from ft_launcher.agent.rounds.keepalive import AliveListener\n"
            "a = AliveListener('127.0.0.1')\n"
            "print(a.port, flush=True)\n"
            "while True:\n"
            "    select.select([a], [], [])\n"
            "    a.accept()\n")


def _await_state(pid, states, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as fh:
            if fh.read().rsplit(")", 1)[1].split()[0] in states:
                return
        select.select([], [], [], 0.01)
    raise AssertionError(f"process {pid} never reached state {states}")


def test_a_paused_node_is_alive_and_a_killed_one_is_dead_at_once():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", LISTENER], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=root))
    try:
        port = int(proc.stdout.readline())
        watcher = watch_connection("127.0.0.1", port, gone_after=4.0)
        _, writable, _ = select.select([], [watcher], [], 5)
        assert writable and watcher.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
        # paused: the kernel keeps the connection and accepts new ones (the backlog): alive
        os.kill(proc.pid, signal.SIGSTOP)
        _await_state(proc.pid, ("T", "t"))
        readable, _, _ = select.select([watcher], [], [], 0.5)
        assert not readable and probe("127.0.0.1", port)
        os.kill(proc.pid, signal.SIGCONT)
        # killed: the watcher reads EOF (or a reset) at once, and a connect is refused
        killed = time.monotonic()
        proc.kill()
        readable, _, _ = select.select([watcher], [], [], 5)
        assert readable and time.monotonic() - killed < 1.0
        try:
            assert watcher.recv(1) == b""
        except ConnectionResetError:
            pass
        proc.wait(5)
        assert not probe("127.0.0.1", port)
        assert probe("127.0.0.1", 0)   # a node without a liveness port is not judged
        watcher.close()
    finally:
        proc.kill()
        proc.wait()
