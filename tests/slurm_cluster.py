"""A real SLURM cluster on this one host, as a session-scoped pytest fixture (``slurm_cluster``).

Owns: installing slurm-wlm + munge (apt-get, as root, when missing, and only when asked: see
SYSTEM_SETUP below), bringing up a private
``munged``, one ``slurmctld`` and one ``slurmd -N nK`` per emulated node in a private temporary
directory, waiting until every node is idle, and tearing all of it down afterwards (jobs
cancelled, every daemon and step daemon it started ended, no process left behind).

The emulated nodes n1..n3 all run on this host: each has its own slurmd port, spool, log and pid
file; their names are mapped to 127.0.0.1 in /etc/hosts so that programs (the launcher's
rendezvous endpoint = first host of the node list) can resolve them.

A test run changes nothing on the machine unless asked: only with FT_TEST_SYSTEM_SETUP=1 in the
environment does the fixture install the packages and add the names to /etc/hosts (that line is
removed again when the session ends). `.ci/run` sets it; a user's `pytest` does not, and then
runs the SLURM tests where SLURM is installed and n1-n3 resolve, and skips them (saying how to
opt in) elsewhere.

Where the cluster cannot be had (not root, not asked to set it up, apt-get fails, a daemon does
not start, nodes never become idle) the fixture calls ``pytest.skip`` with the reason: never a
silent pass. With FT_REQUIRE_SLURM=1 in the environment it fails instead (for CI, where SLURM
must be tested).

Tests that use the fixture are marked ``slurm`` automatically (``-m "not slurm"`` leaves them out);
tests/conftest.py imports the fixture and that hook (pytest 9 refuses ``pytest_plugins`` outside
the root conftest).

Also runnable by hand: ``python tests/slurm_cluster.py srun -N 2 env`` brings a cluster up,
runs the command in it (for at most an hour), and tears it down.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable, Sequence

import psutil
import pytest

APT_LINE = "apt-get install -y --no-install-recommends slurm-wlm munge"
NEEDED_BINARIES = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo", "squeue", "scancel")
NODE_NAMES = ("n1", "n2", "n3")
PARTITION = "ft"
START_DEADLINE_S = 60.0
SYSTEM_SETUP = "FT_TEST_SYSTEM_SETUP"   # =1: the tests may apt-get packages and edit /etc/hosts
HOSTS_MARK = "  # ft_launcher tests: emulated SLURM nodes"


def system_setup_allowed() -> bool:
    return os.environ.get(SYSTEM_SETUP, "") not in ("", "0")


class ClusterUnavailable(Exception):
    """The cluster could not be brought up; the message says why (one line, then log tails)."""


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def _die_with_parent() -> None:
    """In a daemon about to exec: get SIGTERM when the process that started it dies, so a test
    run killed before its teardown (a CI timeout's SIGTERM skips it) leaves no cluster behind."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def ensure_installed() -> None:
    """Install slurm-wlm and munge with apt-get when missing; raise ClusterUnavailable if not possible."""
    missing = [b for b in NEEDED_BINARIES if shutil.which(b) is None]
    if not missing:
        return
    if not system_setup_allowed():
        raise ClusterUnavailable(f"SLURM is not installed ({', '.join(missing)} missing); {SYSTEM_SETUP}=1 lets "
                                 f"the tests install it (`{APT_LINE}`)")
    if os.geteuid() != 0:
        raise ClusterUnavailable(f"SLURM is not installed ({', '.join(missing)} missing) and not root to apt-get it")
    if shutil.which("apt-get") is None:
        raise ClusterUnavailable(f"SLURM is not installed ({', '.join(missing)} missing) and there is no apt-get")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = APT_LINE.split()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:  # a fresh machine may have no package lists yet
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, text=True, timeout=300)
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    missing = [b for b in NEEDED_BINARIES if shutil.which(b) is None]
    if res.returncode != 0 or missing:
        tail = " | ".join((res.stderr or res.stdout).strip().splitlines()[-3:])
        raise ClusterUnavailable(f"`{APT_LINE}` failed (exit {res.returncode}): {tail}")


def _resolves(name: str) -> bool:
    try:
        socket.gethostbyname(name)
        return True
    except OSError:
        return False


def ensure_hosts(names: Iterable[str], hosts_file: str = "/etc/hosts") -> str | None:
    """Map each name to 127.0.0.1 in /etc/hosts unless it already resolves (idempotent); only
    with SYSTEM_SETUP. Returns the line it added (for remove_hosts_line), or None."""
    names = list(names)
    if all(_resolves(n) for n in names):
        return None
    if not system_setup_allowed():
        raise ClusterUnavailable(f"the emulated node names {', '.join(names)} do not resolve; {SYSTEM_SETUP}=1 lets "
                                 f"the tests map them to 127.0.0.1 in {hosts_file} (for the session)")
    path = Path(hosts_file)
    text = path.read_text()
    known = set()
    for line in text.splitlines():
        fields = line.split("#", 1)[0].split()
        if len(fields) >= 2:
            known.update(fields[1:])
    add = [n for n in names if n not in known]
    added = None
    if add:
        sep = "" if text.endswith("\n") or not text else "\n"
        added = "127.0.0.1 " + " ".join(add) + HOSTS_MARK
        try:
            path.write_text(text + sep + added + "\n")
        except OSError as e:
            raise ClusterUnavailable(f"cannot map {', '.join(add)} to 127.0.0.1 in {hosts_file}: {e}") from None
    for n in names:
        try:
            socket.gethostbyname(n)
        except OSError as e:
            raise ClusterUnavailable(f"node name {n} does not resolve after adding it to {hosts_file}: {e}")
    return added


def remove_hosts_line(line: str | None, hosts_file: str = "/etc/hosts") -> None:
    """Undo ensure_hosts: remove the one line it added (anything else in the file stays)."""
    if not line:
        return
    path = Path(hosts_file)
    try:
        lines = path.read_text().splitlines(keepends=True)
        kept = [l for l in lines if l.rstrip("\n") != line]
        if len(kept) != len(lines):
            path.write_text("".join(kept))
    except OSError:
        pass


class SlurmCluster:
    """A running local cluster: ``env`` for the SLURM tools, helpers to run and await jobs."""

    def __init__(self, root: Path, nodes: Sequence[str] = NODE_NAMES, cpus_per_node: int = 2):
        self.root = root
        self.nodes = list(nodes)
        self.cpus_per_node = cpus_per_node
        self.partition = PARTITION
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge" / "munge.socket.2"
        self.procs: dict[str, subprocess.Popen] = {}
        self.hosts_line: str | None = None   # what ensure_hosts added to /etc/hosts (removed by stop)
        self.startup_s: float | None = None
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_"))}
        env["SLURM_CONF"] = str(self.conf)
        self.env = env

    # ---- bring-up ---------------------------------------------------------------------
    def start(self) -> None:
        t0 = time.monotonic()
        self._start_munge()
        self._write_conf()
        self._spawn("slurmctld", ["slurmctld", "-D", "-i"], self.root / "slurmctld.out")
        for n in self.nodes:
            (self.root / "spool" / n).mkdir(parents=True, exist_ok=True)
            self._spawn(f"slurmd:{n}", ["slurmd", "-D", "-N", n], self.root / f"slurmd.{n}.out")
        self.wait_idle(START_DEADLINE_S)
        self.startup_s = time.monotonic() - t0

    def _start_munge(self) -> None:
        d = self.root / "munge"
        d.mkdir(mode=0o700)
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._spawn(
            "munged",
            ["munged", "-F", "-f", f"--socket={self.munge_socket}", f"--key-file={key}",
             f"--pid-file={d / 'munged.pid'}", f"--log-file={d / 'munged.log'}",
             f"--seed-file={d / 'munged.seed'}", "--num-threads=4"],
            d / "munged.out",
        )
        deadline = time.monotonic() + 15
        while not self.munge_socket.exists():
            if self.procs["munged"].poll() is not None or time.monotonic() > deadline:
                raise ClusterUnavailable(
                    f"munged did not start (exit {self.procs['munged'].poll()}):\n"
                    f"{_tail(d / 'munged.out')}\n{_tail(d / 'munged.log')}")
            time.sleep(0.05)

    def _write_conf(self) -> None:
        r = self.root
        (r / "state").mkdir()
        ctld_port, *node_ports = _free_ports(1 + len(self.nodes))
        host = socket.gethostname()
        lines = [
            "ClusterName=ftlocal",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd.%n.pid",
            f"SlurmctldLogFile={r}/slurmctld.log",
            f"SlurmdLogFile={r}/slurmd.%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "PlugStackConfig=/dev/null",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "KillWait=5",
            "MinJobAge=600",
            "InactiveLimit=0",
            "MessageTimeout=10",
            "SlurmdTimeout=60",
            "SchedulerParameters=sched_interval=2",
        ]
        for name, port in zip(self.nodes, node_ports):
            lines.append(
                f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
                f"CPUs={self.cpus_per_node} RealMemory=1000 State=UNKNOWN")
        lines.append(
            f"PartitionName={self.partition} Nodes={','.join(self.nodes)} Default=YES "
            "MaxTime=INFINITE State=UP OverSubscribe=FORCE:8")
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, name: str, cmd: list[str], out: Path) -> None:
        with open(out, "wb") as f:
            self.procs[name] = subprocess.Popen(
                cmd, env=self.env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=_die_with_parent)

    def node_states(self) -> dict[str, str]:
        res = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=15, check=False)
        states = {}
        for line in res.stdout.splitlines():
            fields = line.split()
            if len(fields) == 2:
                states[fields[0]] = fields[1]
        return states

    def wait_idle(self, timeout: float) -> None:
        """Await every node idle (no job on it), up to ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise ClusterUnavailable(f"{name} exited with {p.returncode}:\n{self.log_tails()}")
            states = self.node_states()
            if len(states) == len(self.nodes) and all(s == "idle" for s in states.values()):
                return
            time.sleep(0.5)
        raise ClusterUnavailable(f"nodes not idle after {timeout:.0f} s: {states}\n{self.log_tails()}")

    def log_tails(self) -> str:
        parts = []
        for p in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.out")):
            parts.append(f"--- {p.name}\n{_tail(p, 8)}")
        return "\n".join(parts)

    # ---- using it ---------------------------------------------------------------------
    def run(self, cmd: Sequence[str], timeout: float, check: bool = True, **kw) -> subprocess.CompletedProcess:
        """Run a command with the cluster's environment (text output captured)."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        env = dict(self.env, **kw.pop("env_extra", {}))
        return subprocess.run(list(cmd), env=env, timeout=timeout, check=check, **kw)

    def popen(self, cmd: Sequence[str], env_extra: dict | None = None, **kw) -> subprocess.Popen:
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.STDOUT)
        kw.setdefault("text", True)
        kw.setdefault("start_new_session", True)
        return subprocess.Popen(list(cmd), env=dict(self.env, **(env_extra or {})), **kw)

    def jobs(self) -> dict[str, str]:
        """Live jobs of this cluster: id -> state (PENDING, RUNNING, COMPLETING, ...)."""
        res = self.run(["squeue", "-h", "-o", "%i %T"], timeout=15, check=False)
        return dict(line.split()[:2] for line in res.stdout.splitlines() if len(line.split()) >= 2)

    def job_state(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, ...); {} once the job is forgotten."""
        res = self.run(["scontrol", "-o", "show", "job", job_id], timeout=15, check=False)
        if res.returncode != 0:
            return {}
        return dict(re.findall(r"(\w+)=(\S*)", res.stdout))

    def sbatch(self, args: Sequence[str], timeout: float = 30, env_extra: dict | None = None) -> str:
        """Submit a batch job; returns its id."""
        res = self.run(["sbatch", "--parsable", *args], timeout=timeout, check=False, env_extra=env_extra or {})
        if res.returncode != 0:
            raise RuntimeError(f"sbatch failed ({res.returncode}): {res.stderr.strip()}")
        return res.stdout.strip().split(";")[0]

    def wait_job_done(self, job_id: str, timeout: float) -> dict[str, str]:
        """Await the job leaving PENDING/RUNNING/COMPLETING; returns its final scontrol record."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job_state(job_id)
            if info and info.get("JobState") not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED"):
                return info
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} not done after {timeout:.0f} s: {info.get('JobState')}")

    def cancel_all(self, wait_s: float = 20) -> None:
        """scancel every job and await the nodes idle again."""
        if self.jobs():
            self.run(["scancel", f"--partition={self.partition}"], timeout=15, check=False)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not self.jobs():
                break
            time.sleep(0.3)

    def step_daemons(self) -> list[psutil.Process]:
        """slurmstepd processes of this cluster: they hold files or sockets under its directory
        (their environment and command line say nothing: slurmstepd clears and rewrites both)."""
        root = str(self.root) + os.sep
        found = []
        for p in psutil.process_iter(["name"]):
            try:
                if not (p.info["name"] or "").startswith("slurmstepd"):
                    continue
                paths = [f.path for f in p.open_files()]
                paths += [c.laddr for c in p.net_connections("unix") if isinstance(c.laddr, str)]
                if any(path.startswith(root) for path in paths):
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return found

    # ---- teardown ---------------------------------------------------------------------
    def stop(self) -> None:
        try:
            self.cancel_all(wait_s=15)
        except Exception:
            pass
        order = [self.procs[k] for k in self.procs if k.startswith("slurmd")]
        order += [self.procs[k] for k in ("slurmctld", "munged") if k in self.procs]
        for p in order:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=10)
        leftover = self.step_daemons()
        for p in leftover:
            try:
                for c in p.children(recursive=True):
                    c.kill()
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(leftover, timeout=10)
        remove_hosts_line(self.hosts_line)
        self.hosts_line = None


def start_cluster(nodes: Sequence[str] = NODE_NAMES) -> SlurmCluster:
    """Install if needed, bring a cluster up; raises ClusterUnavailable (already torn down)."""
    if os.geteuid() != 0:
        raise ClusterUnavailable("the local SLURM cluster needs root (daemons run as SlurmUser=root)")
    ensure_installed()
    hosts_line = ensure_hosts(nodes)
    root = Path(tempfile.mkdtemp(prefix="ft-slurm-"))
    root.chmod(0o700)
    cluster = SlurmCluster(root, nodes)
    cluster.hosts_line = hosts_line
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    return cluster


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running 3-node SLURM cluster on this host (skips with the reason when it cannot be had)."""
    try:
        cluster = start_cluster()
    except ClusterUnavailable as e:
        if os.environ.get("FT_REQUIRE_SLURM"):  # where SLURM must be tested (CI): fail, not skip
            pytest.fail(f"no local SLURM cluster (FT_REQUIRE_SLURM is set): {e}", pytrace=False)
        pytest.skip(f"no local SLURM cluster: {e}")
    try:
        yield cluster
    finally:
        cluster.stop()
        if not os.environ.get("FT_KEEP_SLURM_DIR"):
            shutil.rmtree(cluster.root, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "slurm_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker("slurm")


if __name__ == "__main__":
    c = start_cluster()
    print(f"cluster up in {c.startup_s:.1f} s at {c.root} (SLURM_CONF={c.conf})", file=sys.stderr)
    try:
        rc = subprocess.run(sys.argv[1:] or ["sinfo"], env=c.env, timeout=3600).returncode
    finally:
        c.stop()
        print(f"cluster down; log dir {c.root}", file=sys.stderr)
    sys.exit(rc)
