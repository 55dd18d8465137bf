"""Liveness told by the kernel (agent/rounds/keepalive.py): a node's liveness port, a watcher's
connection to it, `probe` and `Misses`. A paused process is alive (its kernel holds the connection
and answers connects); a killed one is dead at once (EOF on the watcher's connection, connects
refused); one whose port does not answer (connects time out, as across a network blip) is gone
only once its silent probes span the window, and an answer in between clears it. Real
processes; no store."""
import os
import select
import signal
import socket
import subprocess
import sys
import time

from conftest import ROOT
from harness import await_state, fill_backlog

from ft_launcher.agent.rounds.keepalive import ANSWERED, REFUSED, SILENT, Misses, probe, watch_connection

LISTENER = ("import select, sys\n"
            "from ft_launcher.agent.rounds.keepalive import AliveListener\n"
            "a = AliveListener('127.0.0.1')\n"
            "print(a.port, flush=True)\n"
            "while True:\n"
            "    select.select([a], [], [])\n"
            "    a.accept()\n")


def _listener():
    """A process holding an AliveListener that accepts every connection; and its port."""
    root = ROOT
    proc = subprocess.Popen([sys.executable, "-c", LISTENER], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=root))
    return proc, int(proc.stdout.readline())


def test_a_paused_node_is_alive_and_a_killed_one_is_dead_at_once():
    proc, port = _listener()
    try:
        watcher = watch_connection("127.0.0.1", port, gone_after=4.0)
        _, writable, _ = select.select([], [watcher], [], 5)
        assert writable and watcher.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
        # paused: the kernel keeps the connection and accepts new ones (the backlog): alive
        os.kill(proc.pid, signal.SIGSTOP)
        await_state(proc.pid, ("T", "t"))
        readable, _, _ = select.select([watcher], [], [], 0.5)
        assert not readable and probe("127.0.0.1", port) == ANSWERED
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
        assert probe("127.0.0.1", port) == REFUSED
        assert probe("127.0.0.1", 0) == ANSWERED   # a node without a liveness port is not judged
        watcher.close()
    finally:
        proc.kill()
        proc.wait()


def test_an_unanswered_port_is_gone_only_after_the_window_and_a_refused_one_at_once():
    """Misses against a real listener: its process stopped and its backlog full (connects time out,
    never refused). Silent probes are no verdict until they span the window (at least two); one
    answer clears them; a killed process's port is gone at the first probe (refused)."""
    proc, port = _listener()
    window, within = 1.2, 0.3
    misses = Misses(window, within)
    held = []
    try:
        assert not misses.gone("127.0.0.1", port)
        os.kill(proc.pid, signal.SIGSTOP)
        await_state(proc.pid, ("T", "t"))
        held = fill_backlog("127.0.0.1", port)
        assert probe("127.0.0.1", port, within) == SILENT
        first = time.monotonic()
        while not misses.gone("127.0.0.1", port):
            assert time.monotonic() - first < window + 3 * within, "never gone"
        assert time.monotonic() - first >= window   # not before the window, whatever one probe says
        # a blip: silent for less than the window, then answered: the count starts again
        blip = Misses(window, within)
        assert not blip.gone("127.0.0.1", port)
        os.kill(proc.pid, signal.SIGCONT)   # it accepts what filled its backlog, and answers again
        for sock in held:
            sock.close()
        held = []
        assert probe("127.0.0.1", port, 5.0) == ANSWERED   # (a SYN dropped before it drained: resent)
        assert not blip.gone("127.0.0.1", port)
        os.kill(proc.pid, signal.SIGSTOP)
        await_state(proc.pid, ("T", "t"))
        held = fill_backlog("127.0.0.1", port)
        start = time.monotonic()
        assert not blip.gone("127.0.0.1", port)   # the earlier miss does not count: one silent probe
        assert time.monotonic() - start < window
        # dead: refused at the first probe
        proc.kill()
        proc.wait(5)
        fresh = Misses(window, within)
        start = time.monotonic()
        assert fresh.gone("127.0.0.1", port) and time.monotonic() - start < within
    finally:
        for sock in held:
            sock.close()
        proc.kill()
        proc.wait()
