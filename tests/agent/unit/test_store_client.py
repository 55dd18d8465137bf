"""The agents' store client (agent/rounds/store_client.py) against torch's real TCPStore server
(libuv backend) in a process of its own: the protocol both ways with torch's own client, waits
that block in the store, and slow told from dead and foreign (issue 34).
"""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT
from ft_launcher.agent.rounds import store_client
from ft_launcher.agent.rounds.store_client import NotAStore, StoreClient, StoreTimeout, StoreUnreachable

SERVER = ("import socket, sys, time\n"
          "from ft_launcher.agent.rounds.job_store import host_store\n"
          "s = host_store('127.0.0.1', 0, 60)\n"
          "print(s.port, s.store.libuvBackend, flush=True)\n"
          "time.sleep(120)\n")


@pytest.fixture
def server():
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        port, libuv = proc.stdout.readline().split()
        assert libuv == "True"
        yield proc, int(port)
    finally:
        proc.kill()
        proc.wait()


def _stop(proc):
    """SIGSTOP `proc` and await the stop (a signal is delivered asynchronously)."""
    os.kill(proc.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with open(f"/proc/{proc.pid}/stat") as fh:
            if fh.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)


def _client(port, **kw):
    return StoreClient.connect("127.0.0.1", port, within=10, **kw)


def test_every_call_round_trips_and_torch_sees_the_same_keys(server):
    from datetime import timedelta

    from torch.distributed import TCPStore

    _, port = server
    c = _client(port)
    c.set("a", "1")
    assert c.get("a") == b"1" and c.add("n", 5) == 5 and c.add("n", 251) == 256
    assert c.check(["a"]) and not c.check(["a", "missing"])
    assert c.compare_set("cs", "", "x") == b"x" and c.compare_set("cs", "y", "z") == b"x"
    assert c.compare_set("cs", "x", "z") == b"z"
    c.multi_set(["m1", "m2"], ["v1", b"v2"])
    assert c.multi_get(["m1", "m2"]) == [b"v1", b"v2"] and c.multi_get_now(["m1", "nope"]) == [b"v1", b""]
    c.append("ap", "x")
    c.append("ap", "yz")
    assert c.join_step("ap", "!", "n", "a") == (257, b"1") and c.get_now("ap") == b"xyz!"
    assert c.delete_key("ap") and c.ping() < 1.0
    theirs = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    assert theirs.get("m2") == b"v2" and theirs.add("n", 0) == 257
    theirs.set("from_torch", "t")
    assert c.get_now("from_torch") == b"t"


def test_a_wait_is_one_request_answered_when_the_key_comes(server):
    _, port = server
    waiter, writer = _client(port, label="waiter"), _client(port, label="writer")
    store_client.counting(True)
    store_client.STATS.pop("waiter", None)
    threading.Timer(1.5, lambda: writer.set("later", "1")).start()
    start = time.monotonic()
    waiter.wait(["later"])
    took = time.monotonic() - start
    assert 1.4 < took < 3.0
    calls = store_client.STATS["waiter"]
    assert calls["wait"][0] == 1 and "cancel_wait" not in calls, calls   # no polling
    start = time.monotonic()
    with pytest.raises(StoreTimeout):
        waiter.wait(["never"], 0.5)
    assert time.monotonic() - start < 1.5
    waiter.set("after_timeout", "ok")   # the connection is clean after a cancelled wait
    assert waiter.get_now("after_timeout") == b"ok"


def test_a_paused_store_is_slow_not_dead_and_a_killed_one_is_dead_at_once(server):
    proc, port = server
    lines = []
    c = _client(port, unresponsive=20.0, ping_every=1.0, say=lines.append)
    c.set("k", "v")
    _stop(proc)
    threading.Timer(4.0, lambda: os.kill(proc.pid, signal.SIGCONT)).start()
    start = time.monotonic()
    assert c.add("slow", 1) == 1   # answered once the store runs again
    assert 3.5 < time.monotonic() - start < 10
    assert any("has not answered" in line and "alive" in line for line in lines), lines
    waiter = _client(port, unresponsive=20.0, ping_every=0.5)
    box = []

    def wait():
        try:
            waiter.wait(["never"])
        except StoreUnreachable as exc:
            box.append((exc.how, time.monotonic()))
    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.5)
    killed = time.monotonic()
    proc.kill()
    thread.join(10)
    assert box and box[0][0] == "dead" and box[0][1] - killed < 1.0, box
    with pytest.raises(StoreUnreachable) as lost:
        c.add("k2", 1)
    assert lost.value.how == "dead"
    proc.wait(10)   # its sockets are closed once it is reaped (before, a connect may still complete, then close)
    with pytest.raises(StoreUnreachable) as refused:
        _client(port)
    assert refused.value.how == "dead"


def test_a_store_paused_past_the_limit_is_unresponsive(server):
    proc, port = server
    c = _client(port, unresponsive=1.5, ping_every=0.5)
    _stop(proc)
    try:
        start = time.monotonic()
        with pytest.raises(StoreUnreachable) as lost:
            c.wait(["never"])
        assert lost.value.how == "unresponsive" and 1.4 < time.monotonic() - start < 4.0
    finally:
        os.kill(proc.pid, signal.SIGCONT)


def _listener(answer=None, close=False):
    """A program on a port that is not a store: it answers `answer`, closes, or says nothing."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def serve():
        conn, _ = srv.accept()
        conn.recv(64)
        if answer:
            conn.sendall(answer)
        if close:
            conn.close()
        else:
            time.sleep(30)
    if answer is not None or close:
        threading.Thread(target=serve, daemon=True).start()
    return srv


@pytest.mark.parametrize("answer,close", [(b"HTTP/1.1 400 Bad Request\r\n\r\n", False), (b"", True)],
                         ids=["answers-something-else", "closes"])
def test_a_foreign_program_is_told_by_what_it_answers_at_once(answer, close):
    srv = _listener(answer, close)
    try:
        start = time.monotonic()
        with pytest.raises(NotAStore):
            StoreClient.connect("127.0.0.1", srv.getsockname()[1], within=30)
        assert time.monotonic() - start < 1.0
    finally:
        srv.close()


def test_a_silent_running_program_on_this_host_is_not_a_store_and_a_stopped_one_is_waited_for(server):
    srv = _listener()   # listens, never answers, its process (this one) runs
    try:
        start = time.monotonic()
        with pytest.raises(NotAStore, match="its process is running"):
            StoreClient.connect("127.0.0.1", srv.getsockname()[1], within=30, handshake_limit=1.0)
        assert time.monotonic() - start < 4.0
    finally:
        srv.close()
    proc, port = server
    _stop(proc)   # a paused store: waited for, then answered
    threading.Timer(2.5, lambda: os.kill(proc.pid, signal.SIGCONT)).start()
    lines = []
    c = StoreClient.connect("127.0.0.1", port, within=30, handshake_limit=1.0, say=lines.append)
    assert c.ping() < 1.0 and any("stopped (paused)" in line for line in lines), lines


def test_a_signal_between_a_request_and_its_answer_leaves_the_connection_in_step(server):
    # A signal (stop) that ends a call after its request went out must not leave that call's
    # answer on the connection for the next call to read as its own (CI: the agent's interrupt
    # after a SIGTERM read a join count's answer as its compare_set's and waited for bytes that
    # never came; the other node then waited close_timeout for a verdict).
    _, port = server
    c = _client(port, unresponsive=5.0)
    c.set("n", "x" * 300)

    class Signalled(Exception):
        pass

    def signalled():
        raise Signalled()
    for call in (lambda: c.get_now("n"), lambda: c.add("count", 7), lambda: c.check(["n"]),
                 lambda: c.multi_get_now(["n", "count"])):
        c.stop = signalled
        with pytest.raises(Signalled):
            call()
        c.stop = None
        start = time.monotonic()
        assert c.compare_set("cs", "", "mine") == b"mine"   # its own answer, at once
        assert c.get_now("n") == b"x" * 300 and time.monotonic() - start < 1.0
        c.delete_key("cs")
    # ... and one that ends it midway through a long answer (read in slices of 1 MB at most)
    big = os.urandom(3 << 20)
    c.set("big", big)
    for after in (2, 3, 4):
        asked = []

        def later():
            asked.append(1)
            if len(asked) >= after:
                raise Signalled()
        c.stop = later
        try:
            c.multi_get_now(["n", "big", "n"])
        except Signalled:
            pass
        c.stop = None
        assert c.compare_set("cs", "", "mine") == b"mine" and c.get_now("big") == big
        c.delete_key("cs")
