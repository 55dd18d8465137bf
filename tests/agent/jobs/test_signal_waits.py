"""Signals end every wait of the agent within about a second, with 128+N, and a wait for peers
says who joined and who is missing (issue 9, item 1). Real agents, a real rendezvous wait."""
import os
import signal
import subprocess
import threading
import time

import pytest

from conftest import SCRIPTS, free_port, read_events, wait_for

ENV_DUMP = os.path.join(SCRIPTS, "env_dump.py")
SLEEPER = os.path.join(SCRIPTS, "sleeper.py")
EXIT_BOUND = 3.0  # seconds from the signal to the agent's exit: 1 s promised, slack for a busy machine


class Lines:
    """Collects a process's stderr lines as they come, so a test can await one."""

    def __init__(self, stream):
        self.lines = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream):
        for line in stream:
            self.lines.append(line.rstrip("\n"))

    def wait(self, text, timeout):
        return wait_for(lambda: [l for l in self.lines if text in l], timeout, f"a line with {text!r}")

    def text(self):
        self._thread.join(5)
        return "\n".join(self.lines)


def _exit_time(proc, timeout=30):
    start = time.monotonic()
    proc.wait(timeout=timeout)
    return time.monotonic() - start


@pytest.mark.parametrize("sig,to_group", [(signal.SIGTERM, False),   # the others take the same handler: slow
                                           pytest.param(signal.SIGINT, True, marks=pytest.mark.slow),
                                           pytest.param(signal.SIGHUP, False, marks=pytest.mark.slow)],
                         ids=["SIGTERM", "SIGINT-to-group", "SIGHUP"])
def test_signal_ends_the_wait_for_a_missing_node(launcher, tmp_path, sig, to_group):
    port = free_port()
    proc = launcher.start(["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--log-dir", tmp_path / "logs",
                           ENV_DUMP, tmp_path], start_new_session=to_group)
    lines = Lines(proc.stderr)
    progress = lines.wait("waiting for nodes", 60)[0]
    assert "1 of 2 joined (" in progress and "1 more needed" in progress
    (os.killpg if to_group else os.kill)(proc.pid, sig)
    elapsed = _exit_time(proc)
    err = lines.text()
    assert proc.returncode == 128 + sig, err
    assert elapsed < EXIT_BOUND
    assert "Traceback" not in err
    assert f"received {signal.Signals(sig).name} while waiting for the other nodes" in err
    kinds = [e["kind"] for e in read_events(tmp_path / "logs")]
    assert kinds[-2:] == ["signal", "job_stopped"]


def test_sigterm_while_waiting_for_the_store_host(launcher, tmp_path):
    # Nothing listens at the endpoint and this agent may not host it: it waits for the host.
    port = free_port()
    proc = launcher.start(["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", "is_host=false",
                           ENV_DUMP, tmp_path])
    lines = Lines(proc.stderr)
    lines.wait("waiting for the rendezvous host", 60)
    proc.send_signal(signal.SIGTERM)
    elapsed = _exit_time(proc)
    assert proc.returncode == 143 and elapsed < EXIT_BOUND, lines.text()
    assert "received SIGTERM while waiting for the rendezvous store" in lines.text()


def test_waiting_agents_name_the_missing_node_and_a_signal_on_one_stops_both(launcher, tmp_path):
    port = free_port()
    common = ["--nnodes", "3", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "wait3", ENV_DUMP, tmp_path]
    host = launcher.start(common, extra_env={"GROUP_RANK": "0"})
    other = launcher.start(common, extra_env={"GROUP_RANK": "1"})
    host_lines, other_lines = Lines(host.stderr), Lines(other.stderr)
    progress = host_lines.wait("2 of 3 joined", 60)[0]
    assert "missing: node rank 2" in progress and "join_timeout 600s" in progress
    other.send_signal(signal.SIGTERM)
    start = time.monotonic()
    for proc, lines in ((other, other_lines), (host, host_lines)):
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{'the signalled agent' if proc is other else 'the host'} did not exit:\n" + lines.text())
    elapsed = time.monotonic() - start
    assert other.returncode == 143 and host.returncode == 143, host_lines.text() + other_lines.text()
    assert elapsed < EXIT_BOUND
    assert "another node is shutting down the job (SIGTERM)" in host_lines.text()


def test_sigterm_ends_a_hot_spares_wait(launcher, tmp_path):
    port = free_port()
    common = ["--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "spare",
              "--rdzv-conf", "last_call_timeout=1", SLEEPER, tmp_path]
    trainer = launcher.start(common, extra_env={"GROUP_RANK": "0"})
    wait_for(lambda: (tmp_path / "pids_0").exists(), 60, "the trainer's rank to start")
    spare = launcher.start(common, extra_env={"GROUP_RANK": "1"})
    spare_lines = Lines(spare.stderr)
    spare_lines.wait("hot spare: ", 60)   # not the --nnodes note, said before the handlers
    spare.send_signal(signal.SIGTERM)
    elapsed = _exit_time(spare)
    assert spare.returncode == 143 and elapsed < EXIT_BOUND, spare_lines.text()
    trainer.send_signal(signal.SIGTERM)
    trainer.wait(timeout=30)
