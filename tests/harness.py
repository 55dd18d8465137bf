"""The shared job harness of the tests: real ft_launcher jobs on this machine and what they leave.

conftest.py starts processes, tags them and checks that nothing outlives a test (its fixtures:
`launcher`, `reference`); this module is what the tests build on it, imported by name. No test
file imports from another test file.

- The example job: examples/ddp_train.py with STEPS, CKPT_EVERY, HOLD_STEP, SEED (JOB), on one of
  TOPOLOGIES (agents x ranks per agent, all on this machine); BOUND: seconds from launch to the end
  of a faulty job. `Job` runs it (shared log, checkpoint and progress dirs); `References` is the
  fault-free run per topology (and job arguments), the model a recovered job must end with
  exactly. HOLD, DELAY and HANG_TIMEOUTS put a fault inside a held phase (test_fault_matrix's
  docstring says why they are what they are); `fault_rank` is the rank a fault hits (never on the
  store host); `check_one_restart` checks the events of a job that restarted once.
- What a job leaves: `progress` (a rank's progress file), `started` / `ranks_started` (the
  ranks_started events of a cycle), `status_rows` / `in_phase` (the agents' status files),
  `read_json`, `first_agent_line` (the agent's opening line).
- In place: `run_faulty` runs the example under `ft.restartable` (RESTARTABLE) with a fault in a
  phase held IN_PLACE_HOLD s, caught by IN_PLACE_TIMEOUTS.
- `ExampleAgents`: agents running any example script with its arguments (`nodes` x `nproc`, plus
  `spares` hot spares that join once cycle 0's ranks run); test_buddy_copy and test_live_dtensor
  run examples/hsdp_train.py on it.
- `SleeperJob` / `sleepers_with_spare`: agents whose ranks run tests/scripts/cycle_sleeper.py (no
  torch: a cycle starts in milliseconds); `await_spare`: a third agent waits as a hot spare.
- Plumbing: `listening(port)` (the store host is up), `paused` (processes SIGSTOPped for a block),
  `await_state` (a process in a /proc state), `fill_backlog` / `unanswered` (a liveness port
  whose connects time out, as across a network blip: not refused), `communicate_all` (every agent's end within
  a bound, else all killed and the test failed), `own_launcher` (a launcher of its own for a run
  a fixture makes outside any test), `sample_each_cycle` / `check_flat` (a healthy rank's RSS,
  fds and threads across many restarts), `write` (a file in the test's dir), `bench_module` (a
  script of bench/ imported, with bench's own `harness` beside this one).
- The agent's parts without an agent: `monitored_ranks` (real monitors, a real rank under each),
  `round_protocol` (one agent's round protocol on a store this process hosts).
"""
import contextlib
import glob
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from conftest import EXAMPLE, ROOT, SCRIPTS, Launcher, free_port, read_events, wait_for, wait_until_gone

# ---- the example job ------------------------------------------------------------------------------
STEPS, CKPT_EVERY, HOLD_STEP, SEED = 20, 3, 3, 7
HOLD, DELAY = 16.0, 12.0     # phase held HOLD s; a simulated fault is due DELAY..DELAY*1.2 s after start (2x2 on 2 loaded cores: ~9.5 s to step 1)
JOB = [EXAMPLE, "--steps", STEPS, "--ckpt-every", CKPT_EVERY, "--hold-step", HOLD_STEP, "--seed", SEED,
       "--step-time", "0.02"]
LONG = 30  # a timeout that should not fire
# Per phase: timeouts that catch a hang there (see test_fault_matrix's docstring).
HANG_TIMEOUTS = {
    "setup": ["--ft-rank-section-timeouts", f"setup:{HOLD + 2},step:{LONG},checkpointing:{LONG}"],
    "checkpointing": ["--ft-rank-section-timeouts", f"setup:{LONG},step:{LONG},checkpointing:{HOLD + 2}"],
    "step": ["--ft-rank-section-timeouts", f"setup:{LONG},step:{HOLD + 1},checkpointing:{LONG}"],
    "oos": ["--ft-rank-section-timeouts", f"setup:{LONG},step:{LONG},checkpointing:{LONG}",
            "--ft-rank-out-of-section-timeout", str(HOLD + 1)],
}
TOPOLOGIES = {"1x2": (1, 2), "2x2": (2, 2), "2x1": (2, 1), "1x3": (1, 3)}
BOUND = {"1x2": 90, "2x2": 120, "2x1": 120, "1x3": 120}   # seconds from launch to the end of a faulty job


def fault_rank(topology):
    """The rank a fault hits: on the last node, not the store host."""
    return 1 if topology == "1x2" else 3


def read_json(path):
    with open(path) as fh:
        return json.load(fh)


def write(tmp_path, text, name="ft.yaml"):
    """`text` into tmp_path/name (a configuration file, by default); returns its path."""
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def bench_module(name):
    """bench/<name>.py imported as a module (bench/ on sys.path only while it loads, for its own
    imports: bench/bench_jobs.py)."""
    path = list(sys.path)
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path[:] = path


def listening(port):
    """Something accepts connections on 127.0.0.1:`port` (the store host, once it has bound it)."""
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def paused(procs):
    """`procs` (psutil processes) stopped with SIGSTOP for the block, resumed after (those still there)."""
    for proc in procs:
        proc.send_signal(signal.SIGSTOP)
    try:
        yield procs
    finally:
        for proc in procs:
            try:
                proc.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass


def await_state(pid, states, timeout=5.0):
    """Wait until process `pid` is in one of `states` (/proc/<pid>/stat's letters, e.g. "T": stopped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as fh:
            if fh.read().rsplit(")", 1)[1].split()[0] in states:
                return
        select.select([], [], [], 0.01)
    raise AssertionError(f"process {pid} never reached state {states}")


def fill_backlog(host, port, settle=0.3):
    """Connections to `port`, whose process is stopped (nothing accepts), until its listen backlog
    is full: the kernel then drops a new connect's SYN, and that connect times out as if the host
    were unreachable (never refused). The connections held, for the caller to close."""
    held = []
    while len(held) < 10000:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setblocking(False)
        sock.connect_ex((host, port))
        _, writable, _ = select.select([], [sock], [], settle)
        if not writable or sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            sock.close()
            return held
        held.append(sock)
    raise AssertionError(f"the backlog of {host}:{port} never filled")


@contextlib.contextmanager
def unanswered(agent, host="127.0.0.1"):
    """For the block, agent `agent`'s liveness port (a psutil process; not the store host's agent:
    that port is then the only one it listens on) answers no connect, as across a network blip:
    connects time out, none is refused. Stopping the agent is not enough (its kernel would still
    complete handshakes into the listen backlog): it is stopped and its backlog filled. After the
    block it runs again, accepts those connections (their peer gone) and answers. Yields the port."""
    ports = [c.laddr.port for c in agent.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
    assert len(ports) == 1, f"agent {agent.pid} listens on {ports}, not on its liveness port alone"
    agent.send_signal(signal.SIGSTOP)
    held = []
    try:
        await_state(agent.pid, ("T", "t"))
        held = fill_backlog(host, ports[0])
        yield ports[0]
    finally:
        agent.send_signal(signal.SIGCONT)
        for sock in held:
            sock.close()


def progress(progress_dir, rank):
    """[(cycle, step, time)] written by one rank."""
    path = os.path.join(progress_dir, f"rank_{rank}.txt")
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        rows = [line.split() for line in fh if line.strip()]
    return [(int(c), int(s), float(t)) for c, s, t in rows if c.isdigit()]


def communicate_all(agents, deadline, bound):
    """[(returncode, stdout, stderr)] of every agent once each has ended; past `deadline`
    (monotonic s) every agent is killed and the test fails, showing their stderr."""
    results = []
    for proc in agents:
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except Exception:
            for p in agents:
                p.kill()
            outs = [p.communicate() for p in agents]
            pytest.fail(f"job did not end within {bound}s\n" + "\n".join(o[1][-3000:] for o in outs))
        results.append((proc.returncode, out, err))
    return results


class Job:
    """One ft_launcher job: one or two agents on this machine, sharing log, checkpoint and progress dirs."""

    def __init__(self, launcher, root, topology, ft_args=(), job_args=(), max_restarts=1, rdzv_conf=None,
                 pet=False):
        self.launcher = launcher
        self.nodes, self.nproc = TOPOLOGIES[topology]
        self.topology = topology
        self.world = self.nodes * self.nproc
        self.logs, self.ckpt, self.prog = root / "logs", root / "ckpt", root / "progress"
        port = free_port()
        self.port = port
        base = ["--nproc-per-node", self.nproc, "--max-restarts", max_restarts, "--log-dir", self.logs]
        if self.nodes == 1:
            base = ["--standalone"] + base
        else:
            conf = "join_timeout=30,last_call_timeout=1" + (f",{rdzv_conf}" if rdzv_conf else "")
            base += ["--nnodes", self.nodes, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                     "--rdzv-id", f"mtx{port}", "--rdzv-conf", conf]
        # pet: these flags only as PET_* variables, no GROUP_RANK (as Kubeflow's operator starts pods)
        self.pet = None
        if pet:
            assert self.nodes > 1, "a PET_* job is a multi-node one"
            self.pet = {f"PET_{str(f)[2:].replace('-', '_').upper()}": str(v) for f, v in zip(base[::2], base[1::2])}
            base = []
        self.args = base + list(ft_args) + JOB + list(job_args) + [
            "--ckpt-dir", self.ckpt, "--progress-dir", self.prog]
        self.agents = []
        self.start = None

    def launch(self):
        self.start = time.monotonic()
        for node in range(self.nodes):
            self.launch_agent(node)
        return self

    def group_rank(self, node):
        """The GROUP_RANK of the `node`th agent started (its place in the node order)."""
        return node

    def launch_agent(self, node):
        # the first agent hosts the store (it binds the endpoint first); wait until it does
        if node > 0:
            wait_for(lambda: listening(self.port), 30, "the store host to listen")
        proc = self.launcher.start(self.args, extra_env=self.pet or {"GROUP_RANK": str(self.group_rank(node))})
        self.agents.append(proc)
        return proc

    def wait(self, bound=None):
        """Wait for every agent; returns [(returncode, stdout, stderr)] and the elapsed seconds."""
        bound = bound or BOUND[self.topology]
        results = communicate_all(self.agents, self.start + bound + 15, bound + 15)
        return results, time.monotonic() - self.start

    def events(self):
        return read_events(self.logs)

    def final(self):
        return read_json(self.ckpt / "final.json")


@contextlib.contextmanager
def own_launcher(root):
    """A Launcher with a token of its own, for a run that a module- or session-wide fixture makes
    outside any test (a reference run): when the block ends, whatever it started is killed and
    must be gone."""
    token = uuid.uuid4().hex
    helper = Launcher(token, root)
    try:
        yield helper
    finally:
        helper.cleanup()
        left = wait_until_gone(token, timeout=5)
        for proc in left:
            proc.kill()
    assert not left, f"a fixture's run left processes: {left}"


class References:
    """The fault-free run of the example job per (topology, extra job arguments): its final
    checksum, computed once (conftest's `reference` fixture keeps one for the session)."""

    def __init__(self, tmp_path_factory):
        self.factory = tmp_path_factory
        self.cache = {}

    def checksum(self, topology, job_args=()):
        key = (topology, tuple(map(str, job_args)))
        if key not in self.cache:
            root = self.factory.mktemp(f"reference_{topology}")
            with own_launcher(root) as helper:
                job = Job(helper, root, topology, job_args=job_args).launch()
                results, _ = job.wait(bound=120)
                assert all(code == 0 for code, _, _ in results), results[0][2][-3000:]
                final = job.final()
                assert final["world_size"] == job.world and final["cycle"] == 0, final
                if not job_args:
                    assert final["step"] == STEPS, final
                self.cache[key] = final["checksum"]
        return self.cache[key]


def check_one_restart(evs, job):
    """Exactly one restart, job-wide: every node restarted once, into cycle 1, and completed."""
    restarts = [e for e in evs if e["kind"] == "restart"]
    assert restarts and {e["detail"]["restarts_used"] for e in restarts} == {1}, restarts
    assert {e["detail"]["next_cycle"] for e in restarts} == {1}
    assert len(restarts) == len({e["node"] for e in restarts}), "a node restarted twice"
    assert not [e for e in evs if e["kind"] == "cycle_start" and e["cycle"] > 1]
    assert [e for e in evs if e["kind"] == "job_complete"]
    assert job.final()["cycle"] == 1


# ---- what the agents said --------------------------------------------------------------------------
def started(evs, cycle):
    """rank -> (pid, in place) from the ranks_started events of `cycle` (every node's)."""
    out = {}
    for e in evs:
        if e["kind"] == "ranks_started" and e["cycle"] == cycle:
            for r in e["detail"]["ranks"]:
                out[r["rank"]] = (r["pid"], r.get("in_place", False))
    return out


def ranks_started(logs, cycle):
    """rank -> its row (pid, warm, in_place, ...) in the ranks_started events of `cycle` in `logs`."""
    return {r["rank"]: r for e in read_events(logs, "ranks_started") if e["cycle"] == cycle
            for r in e["detail"]["ranks"]}


def first_agent_line(stderr):
    """The agent's opening line (the node count, the endpoint and where each came from)."""
    return next(line for line in stderr.splitlines() if line.startswith("[ft_launcher "))


def status_rows(job):
    """Every rank's row in the agents' status files (logs/status/*.json) now."""
    rows = []
    for path in glob.glob(str(job.logs / "status" / "*.json")):
        try:
            with open(path) as fh:
                rows += json.load(fh).get("ranks") or []
        except (OSError, ValueError):
            continue
    return rows


def in_phase(job, rank, phase):
    """The pid of `rank` while it is in `phase` of cycle 0 (its agent's status file), else None."""
    if phase == "step":   # the held step: the rank finished the one before it
        if not any(c == 0 and s == HOLD_STEP - 1 for c, s, _ in progress(job.prog, rank)):
            return None
    if phase == "checkpointing" and not any(c == 0 and s == HOLD_STEP for c, s, _ in progress(job.prog, rank)):
        return None
    for row in status_rows(job):
        if row["rank"] == rank and row.get("section") == phase and not row.get("in_place"):
            return row["pid"]
    return None


# ---- in place ------------------------------------------------------------------------------------
IN_PLACE_HOLD = 4.0
RESTARTABLE = ["--restartable"]
# The hold is inside its section: the faulted phase's timeout leaves room for it (a SIGSTOPped rank
# is caught 7 s into step or checkpointing). Setup's is longer: after the restart the healthy ranks
# wait in setup (init_process_group) for the failed slot's new process, which may start cold.
IN_PLACE_TIMEOUTS = ["--ft-rank-section-timeouts",
                     f"setup:20,step:{IN_PLACE_HOLD + 3:g},checkpointing:{IN_PLACE_HOLD + 3:g}"]


def run_faulty(launcher, tmp_path, topology, fault, phase, rank, ft_args=(), job_args=()):
    """The example under ft.restartable, every rank holding `phase` IN_PLACE_HOLD s; `rank` is
    SIGKILLed (killed) or SIGSTOPped (hung) once its agent's status file shows it there, or raises
    once its hold is over (raise). Returns the launched Job."""
    job_args = list(RESTARTABLE) + ["--hold", f"{phase}:{IN_PLACE_HOLD}"] + list(job_args)
    if fault == "raise":
        job_args += ["--raise-in", phase, "--fail-rank", rank]
    job = Job(launcher, tmp_path, topology, IN_PLACE_TIMEOUTS + list(ft_args), job_args).launch()
    if fault in ("killed", "hung"):
        pid = wait_for(lambda: in_phase(job, rank, phase), 60, f"rank {rank} in {phase}", interval=0.02)
        os.kill(pid, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
    return job


def sample_each_cycle(proc, logs, pid, timeout):
    """{cycle: (RSS, open fds, threads)} of process `pid`, sampled as each cycle's ranks_started
    event appears in `logs`, until the job `proc` ends (or `timeout` s, or `pid` is gone)."""
    healthy = psutil.Process(pid)
    samples, seen = {}, 0
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        evs = read_events(logs, "ranks_started")
        if len(evs) > seen:
            seen = len(evs)
            try:
                samples[evs[-1]["cycle"]] = (healthy.memory_info().rss, healthy.num_fds(), healthy.num_threads())
            except psutil.NoSuchProcess:
                break
        time.sleep(0.05)
    return samples


def check_flat(samples, settled):
    """Print the samples (every fifth cycle and the last); from cycle `settled` on (the first
    cycles warm up) to the last, fds and threads grew by at most 2 and RSS by at most 10 % + 20 MB."""
    print("\ncycle  rss_MB  fds  threads")
    for cycle in sorted(samples):
        if cycle % 5 == 0 or cycle == max(samples):
            rss, fds, threads = samples[cycle]
            print(f"{cycle:5d}  {rss / 2**20:6.1f}  {fds:3d}  {threads:7d}")
    early = samples[min(c for c in samples if c >= settled)]
    late = samples[max(samples)]
    assert late[1] <= early[1] + 2, f"file descriptors grew: {early[1]} -> {late[1]}"
    assert late[2] <= early[2] + 2, f"threads grew: {early[2]} -> {late[2]}"
    assert late[0] <= early[0] * 1.10 + 20 * 2**20, f"RSS grew: {early[0] / 2**20:.1f} -> {late[0] / 2**20:.1f} MB"


# ---- agents whose ranks do not import torch -----------------------------------------------------
class ExampleAgents:
    """`script` with `script_args` on `nodes` agents x `nproc` ranks on this machine (one agent:
    --standalone), plus `spares` agents that wait as hot spares (`--nnodes N:N+spares`); shared log
    dir `root/logs`."""

    def __init__(self, launcher, root, nodes, nproc, script, script_args=(), ft_args=(), spares=0, max_restarts=1):
        self.launcher, self.root = launcher, root
        self.nodes, self.nproc, self.spares = nodes, nproc, spares
        self.logs = root / "logs"
        self.port = free_port()
        base = ["--nproc-per-node", nproc, "--max-restarts", max_restarts, "--log-dir", self.logs,
                "--ft-warm-reserves", 0]
        if nodes == 1 and not spares:
            base = ["--standalone"] + base
        else:
            base += ["--nnodes", f"{nodes}:{nodes + spares}" if spares else nodes, "--rdzv-backend", "c10d",
                     "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", f"exa{self.port}",
                     "--rdzv-conf", "join_timeout=30,last_call_timeout=1"]
        self.args = base + list(ft_args) + [script] + list(script_args)
        self.agents = []

    def launch(self):
        for node in range(self.nodes):
            if node == 1:
                wait_for(lambda: listening(self.port), 30, "the store host to listen")
            self.agents.append(self.launcher.start(self.args, extra_env={"GROUP_RANK": str(node)}))
        return self

    def add_spares(self):
        wait_for(lambda: read_events(str(self.logs), "ranks_started"), 60, "cycle 0's ranks")
        for i in range(self.spares):
            self.agents.append(self.launcher.start(self.args, extra_env={"GROUP_RANK": str(self.nodes + i)}))
        wait_for(lambda: len(read_events(str(self.logs), "spare_waiting")) >= self.spares, 60, "the spares to wait")

    def wait(self, bound=240, lost=()):
        """Every agent's (code, out, err); each not in `lost` must exit 0."""
        results = communicate_all(self.agents, time.monotonic() + bound, bound)
        for i, (code, _, err) in enumerate(results):
            if i not in lost:
                assert code == 0, f"agent {i} exited {code}\n{err[-3000:]}"
        return results

    def events(self):
        return read_events(str(self.logs))


class SleeperJob:
    """Agents of one job whose ranks run cycle_sleeper.py (no torch): quick to start."""

    def __init__(self, launcher, tmp_path, nnodes, max_restarts=1):
        self.launcher = launcher
        self.port = free_port()
        self.logs, self.out = tmp_path / "logs", tmp_path / "ranks"
        self.args = ["--nnodes", nnodes, "--nproc-per-node", 1, "--max-restarts", max_restarts,
                     "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", f"fo{self.port}",
                     "--rdzv-conf", "join_timeout=30,last_call_timeout=1", "--ft-warm-reserves", 0,
                     "--log-dir", self.logs, os.path.join(SCRIPTS, "cycle_sleeper.py"), self.out, 60]
        self.agents = []

    def start(self, order):
        if order:
            wait_for(lambda: listening(self.port), 30, "the store host to listen")
        self.agents.append(self.launcher.start(self.args, extra_env={"GROUP_RANK": str(order)}))

    def rows(self, rank):
        path = self.out / f"rank_{rank}.txt"
        if not path.exists():
            return []
        return [(int(c), float(t)) for c, _, t in (line.split() for line in path.read_text().splitlines())]


def sleepers_with_spare(launcher, tmp_path):
    """Two trainers running cycle_sleeper.py and a hot spare; agent 0 hosts the store."""
    job = SleeperJob(launcher, tmp_path, "2:3")
    job.start(0)
    job.start(1)
    wait_for(lambda: job.rows(0) and job.rows(1), 60, "two nodes to run their ranks")
    job.start(2)
    await_spare(job.logs)
    return job


def await_spare(logs):
    """The third agent waits as a hot spare and both trainers have seen it (they learn of it from
    their keep-alive tick: a failover must count it)."""
    wait_for(lambda: read_events(logs, "spare_waiting"), 30, "the third agent to wait as a spare")
    wait_for(lambda: len(read_events(logs, "spare_joined")) == 2, 10, "the trainers to see the spare")


# ---- the agent's parts without an agent ------------------------------------------------------------
@contextlib.contextmanager
def monitored_ranks(launcher, run_dir, commands, cfg=None, cycle=0, env=None):
    """Real rank monitors (the agent's MonitorHandle and the monitor process it starts), one per
    command, and a real rank under each: `commands[i]` (the arguments after the interpreter) runs
    as local and global rank i of cycle `cycle` with its monitor's environment, and the monitor is
    told of it as an agent tells it (`env`: more variables for every rank). For the agent's parts
    that read monitors (section statistics, open sections, in-place words). Yields (monitors, ranks: agent.ranks.workers.Rank); on the way
    out the ranks are killed and the monitors stopped."""
    from ft_launcher.agent.ranks.workers import Rank
    from ft_launcher.rank_monitor.agent_side.monitor_handle import MonitorHandle
    from ft_launcher.rank_monitor.config import FaultToleranceConfig

    monitors, ranks = [], []
    before = os.environ.get("FT_TEST_TOKEN")
    os.environ["FT_TEST_TOKEN"] = launcher.token   # the monitors carry the test's token: its leak check sees them
    try:
        for local_rank in range(len(commands)):
            monitors.append(MonitorHandle.start(local_rank, cfg or FaultToleranceConfig(), str(run_dir)))
        for i, (monitor, command) in enumerate(zip(monitors, commands)):
            rank_env = launcher.env(dict(monitor.rank_env(), RANK=str(i), LOCAL_RANK=str(i),
                                         WORLD_SIZE=str(len(commands)), TORCHELASTIC_RESTART_COUNT=str(cycle),
                                         **(env or {})))
            start_ns = time.monotonic_ns()
            proc = subprocess.Popen([sys.executable] + [str(a) for a in command], env=rank_env, cwd=ROOT,
                                    start_new_session=True)
            monitor.rank_started(proc.pid, i, cycle, start_ns)
            ranks.append(Rank(local_rank=i, rank=i, proc=proc, pidfd=-1, start_ns=start_ns, output=None))
        yield monitors, ranks
    finally:
        if before is None:
            del os.environ["FT_TEST_TOKEN"]
        else:
            os.environ["FT_TEST_TOKEN"] = before
        for rank in ranks:
            rank.proc.kill()
            rank.proc.wait()
        for monitor in monitors:
            monitor.stop()


def round_protocol(ft=None, node_id="node-a", nproc=2):
    """One agent's RoundProtocol (agent.rounds.rendezvous) of a one-node job, on a TCPStore this
    process hosts (released with the objects): for the agent's parts that read and write the
    round's keys. `ft`: the job's FaultToleranceConfig."""
    from ft_launcher.agent.launch_config import LaunchConfig
    from ft_launcher.agent.rounds.job_store import JobStore
    from ft_launcher.agent.rounds.rendezvous import RoundProtocol
    from ft_launcher.agent.rounds.round_types import NodeInfo
    from ft_launcher.rank_monitor.config import FaultToleranceConfig

    cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, entrypoint=["x"], standalone=True,
                       rdzv_port=0, rdzv_id=f"unit{uuid.uuid4().hex[:8]}", ft=ft or FaultToleranceConfig())
    return RoundProtocol(JobStore(cfg, lambda line: None), cfg, NodeInfo(node_id, "127.0.0.1", None, nproc))
