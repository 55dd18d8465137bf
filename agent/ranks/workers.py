"""The ranks of one node: their environment, starting, exit tracking and stopping.

A rank is started either by activating a warm reserve (agent.ranks.reserve_pool) or by spawning a
fresh interpreter; to the agent both are the same: a child process, a pidfd, output wired for
the cycle at start. Each rank runs in its own session (pgid == pid), so a signal to its group reaches the children
it started; it gets PR_SET_PDEATHSIG=SIGKILL (through util-linux `setpriv`, which sets it and
execs, or a preexec hook where setpriv is missing), and its group is registered with the
orphan watchdog. Exits are observed through pidfds, which the agent's event loop selects on.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import time
from typing import Dict, List, Optional

from ft_launcher.rank_monitor.rank_side import inprocess

from ft_launcher.agent.rounds.elastic import Elastic
from ft_launcher.rank_monitor import buddy_store, shm_layout
from ft_launcher.rank_monitor.pdeathsig import set_pdeathsig
from ft_launcher.rank_monitor.flight_recorder import recorder_env

from ft_launcher.agent.ranks.gpu_env import nccl_env
from ft_launcher.agent.ranks import numa_bind
from ft_launcher.agent.observation import nvrx_cycle_info, nvrx_logs
from ft_launcher.agent.launch_config import LaunchConfig
from ft_launcher.agent.ranks.orphan_watchdog import OrphanWatchdog
from ft_launcher.agent.ranks.process_wait import Unkillable, kill_and_wait
from ft_launcher.agent.ranks.rank_output import RankOutput

_SETPRIV = shutil.which("setpriv")
_WAKE_FD: Optional[int] = None   # the agent's wake pipe, which ranks inherit (rank_monitor.rank_side.inprocess)


def set_wake_fd(fd: int) -> None:
    """Every rank and reserve started from now on inherits `fd` (the agent's wake pipe, write end)
    and finds its number in FT_LAUNCHER_WAKE_FD: an in-process restartable rank whose function
    raised wakes the agent through it."""
    global _WAKE_FD
    _WAKE_FD = fd


_set_pdeathsig = set_pdeathsig   # runs in the child between fork and exec (fallback only)


@dataclasses.dataclass
class Rank:
    local_rank: int
    rank: int
    proc: subprocess.Popen
    pidfd: int
    start_ns: int
    output: object
    warm: bool = False                  # an activated warm reserve, not a fresh interpreter
    in_place: bool = False              # restarted in its own process (rank_monitor.rank_side.inprocess)
    exitcode: Optional[int] = None
    unkillable: bool = False            # still alive after SIGKILL (agent.ranks.process_wait)

    @property
    def pid(self) -> int:
        return self.proc.pid


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def slot_env(cfg: LaunchConfig, local_rank: int) -> Dict[str, str]:
    """What a rank of slot `local_rank` gets whatever the round: the agent's environment plus the
    slot's fixed variables. A warm reserve starts with exactly this (what torch and OpenMP read
    at import time is therefore what the rank would have read)."""
    env = dict(os.environ)
    if env.pop("FT_LAUNCHER_QUIET_CPP_LOG", None):  # the agent's own setting, not the user's
        env.pop("TORCH_CPP_LOG_LEVEL", None)
    env.update({
        "LOCAL_RANK": str(local_rank), "ROLE_NAME": cfg.role,
        "LOCAL_WORLD_SIZE": str(cfg.nproc_per_node),
        "TORCHELASTIC_MAX_RESTARTS": str(cfg.max_restarts),
        "TORCHELASTIC_RUN_ID": cfg.rdzv_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "PYTHONUNBUFFERED": env.get("PYTHONUNBUFFERED", "1"),
    })
    env[inprocess.ENV_GRANULARITY] = cfg.ft.restart_granularity
    env[shm_layout.ENV_WARNED] = shm_layout.warned_prefix(os.getpid())   # a rank's warnings: once per agent
    env[buddy_store.ENV_PREFIX] = buddy_store.prefix_for(os.getpid(), local_rank)   # the slot's host copies
    env[inprocess.ENV_EMPTY_CUDA_CACHE] = "1" if cfg.ft.empty_cuda_cache else "0"
    env.update(Elastic.of(cfg).rank_env())   # --elastic: the world may shrink and grow back
    if cfg.ft.install_exception_hook:
        env["FT_LAUNCHER_EXCEPTION_HOOK"] = "1"   # a warm reserve installs rank_monitor.rank_side.excepthook
    if _WAKE_FD is not None:
        env[inprocess.ENV_WAKE_FD] = str(_WAKE_FD)
    if cfg.ft.cycle_info_dir:   # NVRx's: the path of the current cycle's info file (agent.observation.nvrx_cycle_info)
        env[nvrx_cycle_info.ENV_CURRENT] = nvrx_cycle_info.current_link(cfg.ft.cycle_info_dir)
    env.update(recorder_env(env))   # torch's flight recorder, for the job's dump on a hang
    env.update(nccl_env(env, cfg.ft, cfg.log_dir))   # torch's NCCL watchdog after our monitors
    if cfg.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"  # torchrun's default, so ranks do not oversubscribe
    return env


def rank_env(cfg: LaunchConfig, local_rank: int, rank: int, cycle: int, group_rank: int, world_size: int,
             group_world_size: int, master: tuple, extra: Dict[str, str]) -> Dict[str, str]:
    """The whole environment of one rank in one round: the slot's, plus the round's placement."""
    env = slot_env(cfg, local_rank)
    env.update({
        "RANK": str(rank), "GROUP_RANK": str(group_rank), "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(world_size), "GROUP_WORLD_SIZE": str(group_world_size),
        "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]),
        "TORCHELASTIC_RESTART_COUNT": str(cycle),
    })
    env.update(extra)
    return env


def popen_rank_process(cmd: List[str], env: Dict[str, str], stdout, stderr, pass_fds=()) -> subprocess.Popen:
    """A rank's process (a cold rank or a warm reserve): its own session, SIGKILL when the agent
    dies, no stdin."""
    kwargs = {}
    if _WAKE_FD is not None:
        pass_fds = tuple(pass_fds) + (_WAKE_FD,)
    if _SETPRIV:
        cmd = [_SETPRIV, "--pdeathsig", "KILL", "--"] + cmd
    else:
        kwargs["preexec_fn"] = _set_pdeathsig
    return subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True, pass_fds=pass_fds, **kwargs)


class WorkerGroup:
    """The ranks of this node for one cycle."""

    def __init__(self, cfg: LaunchConfig, watchdog: OrphanWatchdog, output: RankOutput, cycle: int):
        self.cfg = cfg
        self.watchdog = watchdog
        self.output = output
        self.cycle = cycle
        self.ranks: List[Rank] = []

    def start(self, local_rank: int, rank: int, env: Dict[str, str], cycle: int, reserve=None) -> Rank:
        """Start global rank `rank` in slot `local_rank`: activate `reserve` (a warm interpreter
        from agent.ranks.reserve_pool) when one is given and takes, else spawn a fresh interpreter.
        Either way the output is wired now, for this cycle's log file."""
        cfg = self.cfg
        log_file = os.path.join(cfg.log_dir, f"cycle_{cycle}", f"rank_{rank}.log") if cfg.log_dir else None
        show = cfg.local_ranks_filter is None or local_rank in cfg.local_ranks_filter
        applog = ((nvrx_logs.cycle_log_file(cfg.applog_prefix, cycle),
                   nvrx_logs.rank_prefix(rank, int(env.get("WORLD_SIZE", "1")))) if cfg.applog_prefix else None)
        stdout, stderr, handle = self.output.plan(
            rank, cfg.capture.get(local_rank, 0), cfg.tee.get(local_rank, 0), show, log_file, applog, cycle)
        start_ns = time.monotonic_ns()
        try:
            proc = reserve.activate(env, stdout, stderr, " ".join(cfg.entrypoint)) if reserve else None
            if proc is None:
                proc = popen_rank_process(list(cfg.entrypoint), env, stdout, stderr)
                self.watchdog.watch(proc.pid)
            numa_bind.bind(proc.pid, local_rank)   # NVRX_GPUS_PER_NUMA set: its NUMA node's CPUs
        finally:
            for fd in (stdout, stderr):
                if isinstance(fd, int) and fd >= 0:
                    os.close(fd)
        self.output.attach(handle)
        rank_obj = Rank(local_rank, rank, proc, os.pidfd_open(proc.pid), start_ns, handle,
                        warm=reserve is not None and proc is reserve.proc)
        self.ranks.append(rank_obj)
        return rank_obj

    def adopt(self, rank: Rank, global_rank: int, cycle: int) -> Rank:
        """Take over a rank of the previous cycle that restarts in place, as global rank
        `global_rank`; its captured output goes on in this cycle's log file."""
        rank.rank, rank.start_ns, rank.in_place, rank.warm = global_rank, time.monotonic_ns(), True, False
        self.output.recycle(rank.output, global_rank, cycle)
        if self.cfg.log_dir or self.cfg.applog_prefix:   # the directory is made (or its failure said) by RankOutput
            rank.output = self.output.redirect(
                rank.output,
                os.path.join(self.cfg.log_dir, f"cycle_{cycle}", f"rank_{global_rank}.log") if self.cfg.log_dir else None,
                nvrx_logs.cycle_log_file(self.cfg.applog_prefix, cycle) if self.cfg.applog_prefix else None,
                global_rank)
        self.ranks.append(rank)
        return rank

    def reap(self, rank: Rank) -> Optional[int]:
        """Collect an exited rank; kill what is left of its process group."""
        if rank.exitcode is not None:
            return rank.exitcode
        code = rank.proc.poll()
        if code is None:
            return None
        rank.exitcode = code
        killpg(rank.pid, signal.SIGKILL)
        self.watchdog.forget(rank.pid)
        os.close(rank.pidfd)
        self.output.finish(rank.output)
        return code

    def leftovers(self, keep=()) -> List[dict]:
        """check_remaining_processes (NVRx 0.7): what is still alive in the process groups of this
        cycle's stopped ranks (not those in `keep`, which restart in place)."""
        kept = {id(r) for r in keep}
        pgids = [r.pid for r in self.ranks if id(r) not in kept]
        deadline = time.monotonic() + 1.0   # a process SIGKILLed a moment ago may still be on its way out
        while True:
            left = processes_in_groups(pgids)
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.02)

    def running(self) -> List[Rank]:
        return [r for r in self.ranks if r.exitcode is None and self.reap(r) is None]

    def stop(self, sig: int, grace: float, keep=()) -> None:
        """Send `sig` to every running rank's group but those in `keep`; SIGKILL those still there
        after `grace`. Raises Unkillable (agent.ranks.process_wait) for ranks SIGKILL does not end;
        they are not waited for again."""
        kept = {id(r) for r in keep}
        running = [r for r in self.running() if id(r) not in kept and not r.unkillable]
        for r in running:
            killpg(r.pid, signal.SIGCONT)
            killpg(r.pid, sig)
        deadline = time.monotonic() + grace
        stuck = []
        for r in running:
            try:
                r.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                if not kill_and_wait(r.proc):
                    r.unkillable = True
                    stuck.append((r.rank, r.pid))
                    continue
            self.reap(r)
        if stuck:
            raise Unkillable(stuck)


def processes_in_groups(pgids) -> List[dict]:
    """Live processes (not zombies) whose process group is one of `pgids`, from /proc."""
    wanted, found = set(pgids), []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                head, tail = fh.read().rsplit(b")", 1)
            fields = tail.split()
            state, ppid, pgid = fields[0].decode(), int(fields[1]), int(fields[2])
            if pgid not in wanted or state in ("Z", "X"):
                continue
            with open(f"/proc/{name}/cmdline", "rb") as fh:
                cmdline = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError, IndexError):
            continue
        found.append({"pid": int(name), "ppid": ppid, "pgid": pgid, "state": state,
                      "name": head.split(b"(", 1)[-1].decode(errors="replace"), "cmdline": cmdline[:100]})
    return found


def killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
