"""The agent's handle on one rank monitor process: spawn, control channel, reports, statistics.

This is the only part of rank_monitor the agent uses. It spawns `ft_launcher.rank_monitor.monitor_side.server`
with subprocess (never fork: the agent has threads) in its own session, talks to it over a
socketpair (JSON lines), and maps the shared-memory record for section statistics and a rank's
workload control requests (read), and to tell the rank why and until when it is being stopped
(the agent's only words, see shm_layout).
Note: the monitor dies with the *thread* that started it (PR_SET_PDEATHSIG semantics), so call
`start` from a long-lived thread (the agent's main thread).
"""
from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import time
import uuid
from typing import Dict, List, Optional

from ft_launcher.rank_monitor import nvrx_wire
from ft_launcher.rank_monitor import shm_layout as L
from ft_launcher.rank_monitor.json_channel import JsonLineChannel
from ft_launcher.rank_monitor.config import FaultToleranceConfig
from ft_launcher.rank_monitor.own_modules import module_command



class MonitorStartError(RuntimeError):
    """The monitor process did not come up."""


def _rank_config(cfg: FaultToleranceConfig) -> str:
    return json.dumps({
        "sections": dict(cfg.rank_section_timeouts),
        "out_of_section": cfg.rank_out_of_section_timeout,
        "hb_initial": cfg.initial_rank_heartbeat_timeout,
        "hb_subsequent": cfg.rank_heartbeat_timeout,
        "safety_factor": cfg.safety_factor,
        "floor": cfg.calc_timeout_floor,
        "cfg": json.loads(cfg.to_json()),   # the whole configuration: RankMonitorClient.cfg
    })


class MonitorHandle:
    def __init__(self, local_rank: int, cfg: FaultToleranceConfig, run_dir: str,
                 proc: subprocess.Popen, sock: socket.socket, shm_path: str, stack_template: str) -> None:
        self.local_rank = local_rank
        self.cfg = cfg
        self.run_dir = run_dir
        self.proc = proc
        self.pid = proc.pid
        self._chan = JsonLineChannel(sock)
        self.shm_path = shm_path
        self.stack_template = stack_template
        self._pending: List[dict] = []
        self._died_reported = False
        self._stopped = False
        self._mm = None
        self._words = None
        self._request_seen = None
        self.nvrx_socket: Optional[str] = None   # where the monitor serves NVRx's client (None: it cannot)

    # ---- lifecycle -----------------------------------------------------------------------------
    @staticmethod
    def tidy_run_dir(run_dir: str, remove_if_empty: bool) -> None:
        """After the monitors stopped: delete the stack files no dump was written to, and the
        directory itself when nothing else is left in it and it is ours."""
        try:
            names = os.listdir(run_dir)
        except OSError:
            return
        for name in names:
            path = os.path.join(run_dir, name)
            if name.startswith("stack_local") and name.endswith(".txt"):
                try:
                    if os.path.getsize(path) == 0:
                        os.unlink(path)
                except OSError:
                    pass
        if remove_if_empty:
            try:
                os.rmdir(run_dir)
            except OSError:  # a stack dump worth keeping (its path was logged), or not ours
                pass

    @classmethod
    def start(cls, local_rank: int, cfg: FaultToleranceConfig, run_dir: str,
              ready_timeout: float = 20.0) -> "MonitorHandle":
        os.makedirs(run_dir, exist_ok=True)
        shm_path = os.path.join(L.default_shm_dir(),
                                f"ft_launcher_{os.getpid()}_{uuid.uuid4().hex[:8]}_local{local_rank}")
        stack_template = os.path.join(os.path.abspath(run_dir), f"stack_local{local_rank}_{{pid}}.txt")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cmd = module_command("ft_launcher.rank_monitor.monitor_side.server", [
            "--fd", str(theirs.fileno()), "--local-rank", str(local_rank), "--shm", shm_path,
            "--stack-template", stack_template, "--config", cfg.to_json(), "--parent-pid", str(os.getpid()),
            "--nvrx-socket", nvrx_wire.socket_path(shm_path)])
        try:
            proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno()], start_new_session=True,
                                    stdin=subprocess.DEVNULL, close_fds=True)
        finally:
            theirs.close()
        handle = cls(local_rank, cfg, run_dir, proc, ours, shm_path, stack_template)
        try:
            handle._await_ready(ready_timeout)
            handle._mm, handle._words = L.attach(shm_path)
        except BaseException:
            handle.stop()
            raise
        return handle

    def _await_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for msg in self._chan.receive():
                if msg.get("kind") == "ready":
                    self.nvrx_socket = msg.get("nvrx_socket")
                    return
                self._pending.append(msg)
            if self._chan.eof:
                raise MonitorStartError(f"rank monitor for local_rank {self.local_rank} exited during start "
                                        f"(exit status {self.proc.poll()})")
            left = deadline - time.monotonic()
            if left <= 0:
                raise MonitorStartError(f"rank monitor for local_rank {self.local_rank} not ready after {timeout}s")
            select.select([self._chan], [], [], left)

    def stop(self) -> None:
        """End the server and remove the shared-memory file. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self._chan.send({"op": "stop"})
        except OSError:
            pass
        self._chan.close()
        try:
            self.proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=3)
        if self._words is not None:
            self._words.release()
            self._mm.close()
            self._words = self._mm = None
        for path in (self.shm_path, L.env_file(self.shm_path), L.wake_pipe(self.shm_path),
                     nvrx_wire.socket_path(self.shm_path)):
            try:
                os.unlink(path)
            except OSError:
                pass

    @staticmethod
    def record_pattern(agent_pid: int) -> str:
        """A glob matching every shared-memory file the monitors of agent `agent_pid` create."""
        return os.path.join(L.default_shm_dir(), f"ft_launcher_{agent_pid}_*")

    def alive(self) -> bool:
        return not self._stopped and not self._chan.eof and self.proc.poll() is None

    # ---- towards the monitor -------------------------------------------------------------------
    def _tell(self, msg: dict) -> None:
        if self._stopped or self._chan.eof:
            return
        try:
            self._chan.send(msg)
        except OSError:
            self._chan.eof = True   # reported as the monitor's death by read_reports

    def rank_env(self) -> Dict[str, str]:
        """The rank's variables for its monitor: our client's record, and the socket on which the
        monitor answers NVRx's RankMonitorClient (both of NVRx's variables name it)."""
        env = {
            L.ENV_SHM: self.shm_path,
            L.ENV_STACK_FILE: self.stack_template,
            L.ENV_CONFIG: _rank_config(self.cfg),
            L.ENV_LOCAL_RANK: str(self.local_rank),
        }
        if self.nvrx_socket:
            env[nvrx_wire.ENV_RANK_MONITOR_SOCKET] = env[nvrx_wire.ENV_LAUNCHER_SOCKET] = self.nvrx_socket
        return env

    def rank_started(self, pid: int, rank: int, cycle: int, start_ns: int) -> None:
        self._tell({"op": "rank_started", "pid": int(pid), "rank": int(rank), "cycle": int(cycle),
                    "start_ns": int(start_ns)})

    def rank_stopped(self) -> None:
        self._tell({"op": "rank_stopped"})

    def hang_verdict(self, pid: int, kill: bool) -> None:
        """The verdict on the hang this monitor reported for `pid` (agent.recovery.hang_blame): stop the
        rank (it hung) or release it (it only waited on the rank that hung)."""
        self._tell({"op": "hang_verdict", "pid": int(pid), "kill": bool(kill)})

    def end_rank(self, pid: int, reason: str) -> None:
        """Dump the rank's stack and stop it (the monitor's end_rank: a hang no timeout watches)."""
        self._tell({"op": "end_rank", "pid": pid, "reason": reason})

    def flight_done(self, cycle: int) -> None:
        """The job's flight-recorder dump of `cycle` is complete: a hung rank held for it may go on
        to its stack dump. May be called from another thread than the agent's main one."""
        self._tell({"op": "flight_done", "cycle": int(cycle)})

    def update_config(self, cfg: FaultToleranceConfig) -> None:
        self.cfg = cfg
        self._tell({"op": "config", "cfg": cfg.to_json()})

    # ---- from the monitor ----------------------------------------------------------------------
    def fileno(self) -> int:
        return self._chan.fileno()

    def read_reports(self) -> List[dict]:
        """Non-blocking. Reports in arrival order; {"kind": "monitor_died"} once on channel EOF."""
        if self._stopped:
            return []
        out, self._pending = self._pending, []
        out.extend(m for m in self._chan.receive() if m.get("kind") != "ready")
        if self._chan.eof and not self._died_reported:
            self._died_reported = True
            out.append({"kind": "monitor_died", "local_rank": self.local_rank, "pid": self.pid,
                        "exit_status": self.proc.poll()})
        return out

    def reported_hang(self, cycle: int) -> bool:
        """Non-blocking, consumes nothing: has the monitor reported a hang in `cycle` that
        read_reports has not handed out yet? (It is then stopping the rank.)"""
        if not self._stopped:
            self._pending.extend(m for m in self._chan.receive() if m.get("kind") != "ready")
        return any(m.get("kind") == "hang" and m.get("cycle") == cycle for m in self._pending)

    def pending_hang(self, cycle: int) -> Optional[dict]:
        """The hang report of `cycle` that read_reports has not handed out yet, if any (consumes nothing)."""
        if not self.reported_hang(cycle):
            return None
        return next(m for m in self._pending if m.get("kind") == "hang" and m.get("cycle") == cycle)

    def stalled_for(self) -> float:
        """Seconds since the monitor's loop last ticked (it ticks at least once a second)."""
        if self._words is None:
            return 0.0
        tick = self._words[L.H_MONITOR_NS]
        return max(0.0, (time.monotonic_ns() - tick) / 1e9) if tick else 0.0

    def _current(self) -> bool:
        """The record holds the running incarnation's data (see shm_layout.read_stats)."""
        w = self._words
        return w is not None and bool(w[L.H_START_NS]) and w[L.H_ATTACH_NS] >= w[L.H_START_NS]

    def control_request(self) -> Optional[dict]:
        """A new workload control request of the running rank: {"action": WorkloadAction value,
        "description": str}, once per request; None when there is none."""
        w = self._words
        if w is None or not w[L.H_REQUEST_ACTION] or not self._current():
            return None
        key = (w[L.H_GEN], w[L.H_REQUEST_SEQ])
        if key == self._request_seen:
            return None
        self._request_seen = key
        n = max(0, min(w[L.H_REQUEST_LEN], L.REQUEST_BYTES))
        text = bytes(self._mm[L.REQUEST_OFFSET:L.REQUEST_OFFSET + n]).decode("utf-8", "replace")
        w[L.H_REQUEST_READ] = key[1]   # read: the rank may write its next one (L.await_request_read)
        return {"action": w[L.H_REQUEST_ACTION] - 1, "description": text}

    def record(self):
        """(mmap, words) of the rank's shared-memory record, or None before the monitor is up."""
        return None if self._words is None else (self._mm, self._words)

    def mark_stopping(self, reason: int, deadline_ns: int) -> None:
        """Before the rank is signalled: why (L.STOP_*) and when SIGKILL follows."""
        if self._words is not None:
            self._words[L.H_STOP_DEADLINE_NS] = int(deadline_ns)
            self._words[L.H_STOP_REASON] = int(reason)
    def live(self):
        """The rank's open sections, last heartbeat and section counters now (shm_layout.read_live)."""
        if self._words is None:
            return None
        return L.read_live(self._mm, self._words)

    def section_stats(self) -> dict:
        if self._words is None:
            return {}
        return L.read_stats(self._mm, self._words)
