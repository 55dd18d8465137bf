"""Shared test machinery: launch real ft_launcher processes, tag everything they start, and
prove with psutil that nothing they started outlives the test.

Every process a test launches carries FT_TEST_TOKEN=<unique> in its environment; ranks,
monitors, watchdogs and grandchildren inherit it, so even an orphan reparented to init is
found. Zombies count as gone (this machine's PID 1 reaps late). Files count too: whatever of ours
appeared in /dev/shm or the temp dir during the test, is still there once its processes are gone,
and carries in its name the pid of a process this test started (every such file is named after
its agent's pid: `ft_launcher_<pid>_...`, `ft_launcher-<pid>`, `ft_launcher_reserves_<pid>_...`,
`ft_launcher_fr_<pid>_...`) is a leak. The test's pids are those it launched and those a light
sampler (TokenWatch) saw carrying its token; files of other jobs on the machine, or of an earlier
test, are never blamed on it.

The jobs the tests run on this (the example job, its fault-free references, what a job leaves
behind) are tests/harness.py's.
"""
import io
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import psutil
import pytest

# The local SLURM cluster (session fixture) and the hook that marks its tests `slurm`.
from slurm_cluster import pytest_collection_modifyitems, slurm_cluster  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "ddp_train.py")
SCRIPTS = os.path.join(ROOT, "tests", "scripts")
LAUNCHER = [sys.executable, "-m", "ft_launcher"]
# Every agent a test starts raises on a node-state change its diagram lacks (agent.node_state)
os.environ["FT_LAUNCHER_STRICT_STATES"] = "1"


def read_events(log_dir, kind=None):
    """The agent's events.jsonl in `log_dir` (all, or those of one kind); [] before any is written."""
    path = os.path.join(log_dir, "events.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    return [r for r in records if kind is None or r["kind"] == kind]


def wait_for(predicate, timeout, what, interval=0.05):
    """Poll `predicate` until it returns something truthy (which is returned); fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def monitor_of(agent_pid, local_rank):
    """The rank monitor of `local_rank` under an agent, found by the name it shows in `ps`."""
    title = f"ft_launcher: rank_monitor local_rank={local_rank}"
    for child in psutil.Process(agent_pid).children():
        try:
            if child.cmdline()[:1] == [title]:
                return child
        except psutil.NoSuchProcess:
            continue
    return None


def node_tree(pid):
    """An agent and every process under it but its orphan watchdog: what a test kills to lose a
    node. The watchdog is spared so that it clears this machine's /dev/shm and temp dir of the
    lost agent's files, as a lost machine's vanish with it."""
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for proc in procs:
        try:
            if "orphan_watchdog" not in " ".join(proc.cmdline()):
                out.append(proc)
        except psutil.NoSuchProcess:
            continue
    return out


def _ephemeral_range():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            low, high = map(int, fh.read().split())
            return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(following: int = 3) -> int:
    """A free port P whose next `following` ports are free too (a store failover hosts on P+1,
    P+2, ...), below the kernel's ephemeral range: no outgoing connection takes P+k as its local
    port while the test runs (one did in CI, and the successor could not host)."""
    low, _ = _ephemeral_range()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low - following)
        socks = []
        try:
            for p in range(port, port + following + 1):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    with socket.socket() as s:   # no luck below the range: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tagged(token):
    """Live (non-zombie) processes whose environment carries `token`."""
    found = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get("FT_TEST_TOKEN") == token:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def wait_until_gone(token, timeout):
    deadline = time.monotonic() + timeout
    while True:
        left = tagged(token)
        if not left or time.monotonic() > deadline:
            return left
        psutil.wait_procs(left, timeout=min(0.2, max(0.01, deadline - time.monotonic())))


class Launcher:
    """Starts ft_launcher processes for one test, all tagged with the test's token."""

    def __init__(self, token, tmp_path):
        self.token = token
        self.tmp = tmp_path
        self.procs = []
        self.owned = set()   # pids of agents a test started another way (its leak check covers them)

    def env(self, extra=None):
        env = dict(os.environ)
        env["FT_TEST_TOKEN"] = self.token
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        env.update(extra or {})
        return env

    def start(self, args, extra_env=None, **kwargs):
        proc = subprocess.Popen(LAUNCHER + [str(a) for a in args], env=self.env(extra_env), cwd=self.tmp,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, args, timeout=120, extra_env=None):
        proc = self.start(args, extra_env)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"ft_launcher did not finish in {timeout}s\nstdout:\n{out}\nstderr:\n{err}")
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def cleanup(self):
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


# What our processes may leave on purpose: --redirects without --log-dir keeps the logs it names.
KEPT = ("ft_launcher_logs_",)


def kept_on_purpose(path):
    """--redirects' logs, and a run dir (no --log-dir) that holds only the stack dumps and the
    flight-recorder dumps (`cycle_<c>/flight_recorder`) of a hang: the hang's lines named them, so
    they stay for the operator."""
    if os.path.basename(path).startswith(KEPT):
        return True
    try:
        names = os.listdir(path) if re.fullmatch(r"ft_launcher-\d+", os.path.basename(path)) else []
        return bool(names) and all(
            (n.startswith("stack_local") and os.path.getsize(os.path.join(path, n)) > 0)
            or (re.fullmatch(r"cycle_\d+", n) and os.listdir(os.path.join(path, n)) == ["flight_recorder"])
            for n in names)
    except OSError:
        return False


# the agent pid in the names of the files our processes make (see the module docstring)
OWNER_PID = re.compile(r"^ft_launcher(?:_reserves|_fr)?[-_](\d+)(?:_|$)")
RUNTIME_DIR = re.compile(r"^ft_launcher-jobs-\d+$")   # agent.observation.job_status.runtime_dir: <host>-<pid>.json


class TokenWatch:
    """The pids of every process that carried a test's token while the test ran, sampled by a
    daemon thread (each new pid's environment is read once), so that the files of a process
    that ended before the teardown are still known as the test's own."""

    INTERVAL = 0.2

    def __init__(self, token):
        self.needle = f"FT_TEST_TOKEN={token}".encode() + b"\0"
        self.pids = set()
        self._checked = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="token-watch", daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(self.INTERVAL):
            self.sample()

    def sample(self):
        try:
            pids = {int(n) for n in os.listdir("/proc") if n.isdigit()}
        except OSError:
            return
        self._checked &= pids   # a pid used again later is read again
        for pid in pids - self._checked:
            self._checked.add(pid)
            try:
                with open(f"/proc/{pid}/environ", "rb") as fh:
                    if self.needle in fh.read() + b"\0":
                        self.pids.add(pid)
            except OSError:
                continue

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=2)
        self.sample()
        return self.pids


def owner_pids(path):
    """The pids a file of ours names: its agent's, or for the runtime dir the agents listed in it."""
    name = os.path.basename(path)
    found = OWNER_PID.match(name)
    if found:
        return {int(found.group(1))}
    if RUNTIME_DIR.match(name):
        try:
            entries = os.listdir(path)
        except OSError:
            return set()
        return {int(m.group(1)) for m in (re.search(r"-(\d+)\.json$", e) for e in entries) if m}
    return set()


def ours_on_disk():
    """Paths of ours in /dev/shm and the temp dir: monitor records, their restart files, the
    reserves', flight recorder's and stack dumps' scratch directories."""
    found = set()
    for where in {"/dev/shm", tempfile.gettempdir()}:
        try:
            names = os.listdir(where)
        except OSError:
            continue
        found.update(p for p in (os.path.join(where, n) for n in names if n.startswith("ft_launcher"))
                     if not kept_on_purpose(p))
    return found


def leaked_files(before, pids):
    """Files of ours that appeared since `before` and name one of `pids` (this test's processes)."""
    return sorted(p for p in ours_on_disk() - before if owner_pids(p) & pids)


@pytest.fixture
def console():
    """What an agent's part says to the operator, for a test that builds the part without an agent."""
    return io.StringIO()


@pytest.fixture
def events(tmp_path, console):
    """An agent's event log (agent.observation.events.EventLog): events.jsonl in tmp_path (read it
    with read_events(tmp_path)), its lines on `console`."""
    from ft_launcher.agent.observation.events import EventLog

    log = EventLog(str(tmp_path / "events.jsonl"), stream=console)
    yield log
    log.close()


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The fault-free runs of the example job (harness.References: a checksum per topology and
    job arguments), each computed once for the whole session."""
    from harness import References   # harness imports this module: here, not at the top

    return References(tmp_path_factory)


@pytest.fixture
def launcher(tmp_path):
    token = uuid.uuid4().hex
    before = ours_on_disk()
    watch = TokenWatch(token)
    helper = Launcher(token, tmp_path)
    try:
        yield helper
    finally:
        watch.sample()   # the processes still running, before they are killed
        helper.cleanup()
        left = wait_until_gone(token, timeout=5)
        for proc in left:
            proc.kill()
        pids = watch.stop() | {p.pid for p in helper.procs} | helper.owned
    assert not left, f"processes left behind: {[(p.pid, p.cmdline()) for p in left]}"
    leaked = leaked_files(before, pids)
    assert not leaked, f"files left behind in /dev/shm or the temp dir: {leaked}"
