"""The rank monitor process: one per local rank slot, deadline-driven hang detection.

`python -m ft_launcher.rank_monitor.monitor_side.server --fd N --local-rank N --shm PATH --stack-template T --config JSON`
Started once by the agent (through MonitorHandle) and kept across rank restarts. It creates the
shared-memory record the rank writes into, reads it every min(workload_check_interval, 0.05) s or
at the nearest deadline, and on an expired section / out-of-section / heartbeat timeout:
reports to the agent first, holds the rank (at most rank_monitor.flight_recorder.HOLD_SECONDS) until
the agent says the job's ranks have dumped their flight-recorder traces (`flight_done`, only when
the launcher turned those dumps on), asks the rank for a stack dump (only if the rank installed the
handler), then SIGCONT + the termination signal to the rank's process group, SIGKILL after the
grace if that signal is catchable. It then stops enforcing until the agent announces the next
incarnation.

Hang blame: when the agent asks for it (`FT_LAUNCHER_HANG_VERDICT=1` in the monitor's
environment), the monitor does not stop the rank after the stack dump but holds it for the
agent's verdict (agent.recovery.hang_blame): `{"op": "hang_verdict", "pid", "kill"}` either stops it as
above (the rank hung) or releases it (it only waited on the rank that hung: it restarts in place,
and this monitor leaves it alone). Without a verdict within VERDICT_HOLD seconds of the hang, or
once the agent's channel closes, the monitor stops the rank as before. A `rank_started` for the
same process in a later cycle (the agent kept it for an in-place restart) releases a hang still
being handled from its earlier cycle: that cycle is over, and the verdict on it never comes. NVRx's RankMonitorClient: with `--nvrx-socket PATH` the monitor also serves NVRx's client on that
Unix socket, in the same select loop, never blocking on it (monitor_side.nvrx_peers): what that
client sends becomes the same record writes as our own client's.

It exits when the agent's control channel closes, and dies with the agent
(PR_SET_PDEATHSIG).

Control channel: JSON lines over a socketpair. Agent -> monitor: {"op": "rank_started", pid,
rank, cycle, start_ns} | {"op": "rank_stopped"} | {"op": "config", "cfg": json} | {"op": "stop"} |
{"op": "hang_verdict", pid, kill} | {"op": "flight_done", cycle} (the job's flight-recorder dump of
that cycle is complete) | {"op": "end_rank", pid, reason} (the agent found the rank hung where no
timeout watches it, its teardown: dump its stack and stop it; the stack_dump report names `reason`). This channel and the shared-memory record are the agent's only two ways
to its monitor: the record for what the rank writes on its hot path, the channel for the rest.
Monitor -> agent: {"kind": "ready", "nvrx_socket": path or None}, {"kind": "hang", ...}, {"kind": "stack_dump", ...}. A hang
report names the expired timeout (reason, section) and the sections open at that moment, so a
heartbeat or out-of-section hang still says where the rank was.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import select
import signal
import socket
import sys
import time
from typing import List, Optional

from ft_launcher.rank_monitor import flight_recorder as FR
from ft_launcher.rank_monitor import shm_layout as L
from ft_launcher.rank_monitor.json_channel import JsonLineChannel
from ft_launcher.rank_monitor.config import FaultToleranceConfig
from ft_launcher.rank_monitor.monitor_side.nvrx_peers import NvrxPeers
from ft_launcher.rank_monitor.pdeathsig import set_pdeathsig
from ft_launcher.rank_monitor.proc_title import set_title

_mono = time.monotonic_ns
log = logging.getLogger("rank_monitor")

STACK_TEXT_LIMIT = 64 * 1024
# Seconds after a hang is found until a monitor holding the rank for the agent's verdict stops it
# regardless (the agent decides within agent.recovery.hang_blame.BLAME_WAIT, well inside this).
VERDICT_HOLD = 1.0
CATCHABLE_NEVER = (int(signal.SIGKILL), int(signal.SIGSTOP))


_set_pdeathsig = set_pdeathsig


def _pidfd(pid: int) -> Optional[int]:
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


class Incarnation:
    """One life of the rank, as the agent announced it."""

    def __init__(self, pid: int, rank: int, cycle: int, start_ns: int) -> None:
        self.pid, self.rank, self.cycle, self.start_ns = pid, rank, cycle, start_ns
        self.enforcing = True
        self.pidfd = _pidfd(pid)
        if self.pidfd is None and not _alive(pid):
            self.enforcing = False
        try:
            self.own_group = os.getpgid(pid) == pid
        except OSError:
            self.own_group = False
        self.client_pid = 0
        self.client_ok = False

    def close(self) -> None:
        if self.pidfd is not None:
            try:
                os.close(self.pidfd)
            except OSError:
                pass
            self.pidfd = None

    def exited(self) -> bool:
        if self.pidfd is not None:
            r, _, _ = select.select([self.pidfd], [], [], 0)
            return bool(r)
        return not _alive(self.pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


class Incident:
    """Dump-then-terminate sequence for one hung incarnation (runs inside the event loop)."""

    def __init__(self, server: "Server", inc: Incarnation, report: dict, handler_pid: int,
                 handler_sig: int, stack_path: Optional[str]) -> None:
        self.server, self.inc, self.report = server, inc, report
        self.handler_pid, self.handler_sig, self.stack_path = handler_pid, handler_sig, stack_path
        self.phase = "dump"
        self.deadline = 0
        self.found_ns = _mono()
        self.verdict: Optional[bool] = None   # the agent's: True stop the rank, False release it
        self.hold = os.environ.get(L.ENV_HANG_VERDICT) == "1"
        self.last_size = -1
        self.stable_since = 0
        self.baseline = 0

    # ---- signalling -----------------------------------------------------------------------
    def _signal_group(self, sig: int) -> None:
        inc = self.inc
        try:
            if inc.own_group:
                os.killpg(inc.pid, sig)
            elif inc.pidfd is not None:
                signal.pidfd_send_signal(inc.pidfd, sig)
            else:
                os.kill(inc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def begin(self) -> None:
        """Hold for the job's flight-recorder dump when the launcher asked for one, then dump."""
        fr_dir = os.environ.get(FR.ENV_FR_DIR)
        if fr_dir and not self.inc.exited():
            self.phase = "flight"
            self.deadline = _mono() + int(FR.HOLD_SECONDS * 1e9)
            return
        self._begin_dump()

    def _begin_dump(self) -> None:
        self.phase = "dump"
        cfg = self.server.cfg
        if self.stack_path and self.handler_pid:
            try:
                self.baseline = os.path.getsize(self.stack_path)
            except OSError:
                self.baseline = 0
            try:
                # a stopped rank must run its handler: running first, its main thread takes the
                # signal (a stopped process's pending signal goes to whichever thread runs first)
                self._signal_group(signal.SIGCONT)
                os.kill(self.handler_pid, self.handler_sig)
                self.deadline = _mono() + int(cfg.stack_dump_wait * 1e9)
                return
            except (ProcessLookupError, PermissionError):
                pass
        self.stack_path = None
        self._after_dump()

    def _after_dump(self) -> None:
        """Stop the rank, or hold it for the agent's verdict (hang blame) when the agent asked."""
        if self.verdict is False:
            self._release()
        elif not self.hold or self.verdict is True:
            self._terminate()
        else:
            self.phase = "verdict"
            self.deadline = max(self.found_ns + int(VERDICT_HOLD * 1e9), _mono() + 50_000_000)

    def supersede(self) -> None:
        """The agent restarted this process in place for a later cycle: the hang it was found in
        belongs to a cycle that is over (the in-place restart ends it, or its own timeout stops a
        rank that misses its restart point). Released, never stopped; a dump not yet begun is skipped."""
        self.verdict = False
        if self.phase == "flight":
            self._release()

    def _release(self) -> None:
        log.debug("local_rank=%s: rank pid %s released: it waited on the rank that hung",
                  self.server.local_rank, self.inc.pid)
        self.phase = "done"

    def _dump_size(self) -> int:
        try:
            return os.path.getsize(self.stack_path)
        except OSError:
            return 0

    def _finish_dump(self, complete: bool) -> None:
        text = ""
        if complete:
            try:
                with open(self.stack_path, "rb") as f:
                    f.seek(self.baseline)
                    text = f.read(STACK_TEXT_LIMIT).decode("utf-8", "replace")
            except OSError:
                complete = False
        rep = {k: self.report[k] for k in ("rank", "local_rank", "pid", "cycle", "reason", "section")}
        rep.update(kind="stack_dump", stack_file=self.stack_path if complete else None,
                   complete=complete, stack=text)
        self.server.send(rep)
        self._after_dump()

    def _terminate(self) -> None:
        cfg = self.server.cfg
        sig = int(cfg.rank_termination_signal)
        if self.server._client_matches(self.inc):   # a hung rank's SIGTERM is not a preemption
            words = self.server.words
            words[L.H_STOP_DEADLINE_NS] = _mono() + int(cfg.rank_termination_grace * 1e9)
            words[L.H_STOP_REASON] = L.STOP_RESTART
        self._signal_group(signal.SIGCONT)
        self._signal_group(sig)
        log.debug("local_rank=%s: sent signal %s to rank pid %s", self.server.local_rank, sig, self.inc.pid)
        if sig in CATCHABLE_NEVER:
            self.phase = "done"
        else:
            self.phase = "grace"
            self.deadline = _mono() + int(cfg.rank_termination_grace * 1e9)

    # ---- driven by the loop --------------------------------------------------------------
    def step(self) -> None:
        now = _mono()
        if self.phase == "verdict":
            if self.verdict is False:
                self._release()
            elif self.verdict is True or self.inc.exited() or now >= self.deadline or not self.server.running:
                if self.verdict is None and not self.inc.exited():
                    log.info("local_rank=%s: no verdict on hung rank pid %s within %gs: stopping it",
                             self.server.local_rank, self.inc.pid, VERDICT_HOLD)
                self._terminate()
            return
        if self.phase == "flight":
            if self.server.flight_done >= self.inc.cycle or self.inc.exited() or now >= self.deadline:
                self._begin_dump()
            return
        if self.phase == "dump":
            if self.inc.exited():
                self._finish_dump(self._dump_size() > self.baseline)
                return
            size = self._dump_size()
            if size > self.baseline:
                if size != self.last_size:
                    self.last_size, self.stable_since = size, now
                elif now - self.stable_since >= 20_000_000:   # unchanged for 20 ms: written
                    self._finish_dump(True)
                    return
            if now >= self.deadline:
                self._finish_dump(self._dump_size() > self.baseline)
        elif self.phase == "grace":
            if self.inc.exited():
                self.phase = "done"
            elif now >= self.deadline:
                self._signal_group(signal.SIGKILL)
                log.info("local_rank=%s: rank pid %s ignored the termination signal; SIGKILL",
                         self.server.local_rank, self.inc.pid)
                self.phase = "done"

    def wake_at(self) -> int:
        if self.phase in ("dump", "flight", "verdict"):
            return min(self.deadline, _mono() + 10_000_000)
        return self.deadline


class Server:
    def __init__(self, sock: socket.socket, local_rank: int, shm_path: str, stack_template: Optional[str],
                 cfg: FaultToleranceConfig, nvrx_socket: Optional[str] = None) -> None:
        self.chan, self.local_rank, self.shm_path = JsonLineChannel(sock), local_rank, shm_path
        self.stack_template = stack_template
        self.cfg = cfg
        self.mm, self.words = L.create(shm_path)
        self.inc: Optional[Incarnation] = None
        self.incidents: List[Incident] = []
        self.names: List[str] = []
        self.names_gen = -1
        self.running = True
        self.flight_done = -1   # the last cycle whose flight-recorder dump the agent said is complete
        self.nvrx: Optional[NvrxPeers] = None   # NVRx's client on its socket (monitor_side.nvrx_peers)
        if nvrx_socket:
            try:
                self.nvrx = NvrxPeers(self, nvrx_socket)
            except OSError as exc:
                log.warning("local_rank=%s: cannot serve NVRx's client on %s (%s): its RankMonitorClient will "
                            "not connect; ft_launcher's own client works as before", local_rank, nvrx_socket,
                            exc.strerror or exc)

    # ---- channel ----------------------------------------------------------------------------
    def send(self, msg: dict) -> None:
        try:
            self.chan.send(msg)
        except OSError:
            self.running = False

    def read_channel(self) -> None:
        def bad(line, exc):  # a bad message must not end monitoring
            log.warning("local_rank=%s: bad control message %r: %s", self.local_rank, line[:200], exc)

        for msg in self.chan.receive(on_bad_line=bad):
            try:
                self.handle(msg)
            except Exception as exc:  # noqa: BLE001 - same: log it and keep monitoring
                bad(json.dumps(msg).encode(), exc)
        if self.chan.eof:
            self.running = False

    def handle(self, msg: dict) -> None:
        op = msg.get("op")
        if op == "rank_started":
            for incident in self.incidents:   # a hang of this process's earlier cycle, kept in place
                if (incident.inc.pid == int(msg["pid"]) and incident.inc.cycle < int(msg.get("cycle", 0))
                        and incident.phase in ("flight", "dump", "verdict")):
                    incident.supersede()
            self._drop_inc()
            self.inc = Incarnation(int(msg["pid"]), int(msg.get("rank", -1)), int(msg.get("cycle", 0)),
                                   int(msg.get("start_ns") or _mono()))
            self.words[L.H_FROZEN_NS] = 0
            self.words[L.H_START_NS] = self.inc.start_ns
            log.debug("local_rank=%s: watching rank %s pid %s cycle %s", self.local_rank,
                      self.inc.rank, self.inc.pid, self.inc.cycle)
        elif op == "rank_stopped":
            self._drop_inc()
            self.words[L.H_START_NS] = 0   # no incarnation: its statistics are no longer current
        elif op == "config":
            cfg = msg["cfg"]
            self.cfg = FaultToleranceConfig.from_json(cfg if isinstance(cfg, str) else json.dumps(cfg))
        elif op == "stop":
            self.running = False
        elif op == "flight_done":
            self.flight_done = max(self.flight_done, int(msg["cycle"]))
        elif op == "hang_verdict":
            for incident in self.incidents:
                if incident.inc.pid == int(msg["pid"]):
                    incident.verdict = bool(msg.get("kill", True))
        elif op == "end_rank":
            self.end_rank(int(msg["pid"]), str(msg.get("reason") or "teardown"))
        else:
            log.warning("local_rank=%s: unknown control op %r", self.local_rank, op)

    def _drop_inc(self) -> None:
        inc, self.inc = self.inc, None
        if inc is not None:
            inc.enforcing = False
            if not any(i.inc is inc for i in self.incidents):
                self._remove_unused_stack_file(inc)
                inc.close()

    def _remove_unused_stack_file(self, inc: Incarnation) -> None:
        """Every rank opens a stack-dump file in case it hangs; one left empty is clutter."""
        pid = self.words[L.H_HANDLER_PID] if self._client_matches(inc) else 0
        if pid and self.stack_template:
            path = self.stack_template.replace("{pid}", str(pid))
            try:
                if os.path.getsize(path) == 0:
                    os.unlink(path)
            except OSError:
                pass

    # ---- deadlines --------------------------------------------------------------------------
    def _client_matches(self, inc: Incarnation) -> bool:
        w = self.words
        pid = w[L.H_CLIENT_PID]
        if not pid:
            return False
        if pid != inc.client_pid:
            inc.client_pid = pid
            try:
                inc.client_ok = pid == inc.pid or os.getpgid(pid) == inc.pid
            except OSError:
                inc.client_ok = False
        return inc.client_ok

    def _slot_names(self) -> List[str]:
        w = self.words
        n = max(0, min(w[L.H_NSLOTS], L.MAX_SLOTS))
        gen = w[L.H_GEN]
        if gen != self.names_gen or len(self.names) != n:
            self.names = [L.read_name(self.mm, w, i) for i in range(n)]
            self.names_gen = gen
        return self.names

    def evaluate(self, inc: Incarnation, now: int):
        """-> (expired or None, nearest deadline ns or None). expired = dict(reason, section, ...)."""
        w, cfg = self.words, self.cfg
        expired, nearest = [], None
        client = self._client_matches(inc)
        state = w[L.H_CLIENT_STATE] if client else 0
        if state == 2:          # the rank shut monitoring down
            return None, None
        client = client and state == 1
        # NVRx's server starts the out-of-section and initial-heartbeat clocks at its client's
        # InitMsg (what that client's computed timeouts measure); ours at the rank's start.
        origin = w[L.H_ATTACH_NS] if client and w[L.H_CLIENT_KIND] == L.CLIENT_NVRX else inc.start_ns

        def consider(reason, section, start, timeout_s):
            nonlocal nearest
            if timeout_s is None or not start:
                return
            deadline = start + int(timeout_s * 1e9)
            if now >= deadline:
                expired.append({"reason": reason, "section": section, "elapsed": (now - start) / 1e9,
                                "timeout": timeout_s, "overrun": now - deadline})
            elif nearest is None or deadline < nearest:
                nearest = deadline

        open_sections = False
        if client:
            names = self._slot_names()
            for i, name in enumerate(names):
                b = L.slot_base(i)
                if w[b + L.S_OPEN]:
                    timeout = L.decode_timeout(w[b + L.S_TIMEOUT], cfg.rank_section_timeouts.get(name))
                    consider("section", name, w[b + L.S_ENTER_NS], timeout)
            open_sections = w[L.H_OPEN] > 0
        if not open_sections:
            oos = L.decode_timeout(w[L.H_TO_OOS], cfg.rank_out_of_section_timeout) if client \
                else cfg.rank_out_of_section_timeout
            start = (w[L.H_LAST_CLOSE_NS] if client else 0) or origin
            consider("out_of_section", None, start, oos)
        beats = w[L.H_HB_COUNT] if client else 0
        if beats == 0:
            t = L.decode_timeout(w[L.H_TO_HB_INIT], cfg.initial_rank_heartbeat_timeout) if client \
                else cfg.initial_rank_heartbeat_timeout
            consider("initial_heartbeat", None, origin, t)
        else:
            t = L.decode_timeout(w[L.H_TO_HB_SUB], cfg.rank_heartbeat_timeout)
            consider("heartbeat", None, w[L.H_HB_LAST_NS], t)
        if not expired:
            return None, nearest
        order = {"section": 0, "out_of_section": 1, "initial_heartbeat": 2, "heartbeat": 3}
        expired.sort(key=lambda e: (order[e["reason"]], -e["overrun"]))
        return expired[0], nearest

    def check(self) -> Optional[int]:
        """Enforce the current incarnation; returns the nearest deadline (ns) or None."""
        inc = self.inc
        if inc is None or not inc.enforcing:
            return None
        if inc.exited():
            inc.enforcing = False     # the agent learns of the exit itself
            return None
        now = _mono()
        exp, nearest = self.evaluate(inc, now)
        if exp is None:
            return nearest
        # Confirm on a second read: never act on a torn view of a section that just closed.
        again, nearest2 = self.evaluate(inc, _mono())
        if again is None or (again["reason"], again["section"]) != (exp["reason"], exp["section"]):
            return nearest2
        self.fire(inc, again)
        return None

    def _open_sections(self, inc: Incarnation) -> List[str]:
        """Names of the sections the rank has open, outermost first."""
        if not self._client_matches(inc):
            return []
        w = self.words
        opened = [(w[L.slot_base(i) + L.S_ENTER_NS], name) for i, name in enumerate(self._slot_names())
                  if w[L.slot_base(i) + L.S_OPEN]]
        return [name for _, name in sorted(opened)]

    def fire(self, inc: Incarnation, exp: dict) -> None:
        inc.enforcing = False
        w = self.words
        handler_pid = w[L.H_HANDLER_PID] if self._client_matches(inc) else 0
        handler_sig = w[L.H_HANDLER_SIG]
        stack_path = None
        if handler_pid and handler_sig and self.stack_template:
            stack_path = self.stack_template.replace("{pid}", str(handler_pid))
        else:
            handler_pid = 0
        report = {
            "kind": "hang", "reason": exp["reason"], "section": exp["section"], "rank": inc.rank,
            "local_rank": self.local_rank, "pid": inc.pid, "cycle": inc.cycle,
            "elapsed": round(exp["elapsed"], 6), "timeout": exp["timeout"], "stack_file": stack_path,
            "open_sections": self._open_sections(inc),
            "time": time.time(),
        }
        L.freeze_stats(self.mm, w)   # before the rank can be resumed: the hang is no observation
        # The agent logs the operator's line for this report; here only for debugging.
        log.debug("local_rank=%s: rank %s (pid %s, cycle %s) hung: %s%s after %.3fs (timeout %ss)",
                    self.local_rank, inc.rank, inc.pid, inc.cycle, exp["reason"],
                    f" '{exp['section']}'" if exp["section"] else "", exp["elapsed"], exp["timeout"])
        self.send(report)
        incident = Incident(self, inc, report, handler_pid, handler_sig, stack_path)
        self.incidents.append(incident)
        incident.begin()

    def end_rank(self, pid: int, reason: str) -> None:
        """The agent's word that the rank hung where no timeout watches it (its teardown): dump its
        stack and stop it, as a hang but without a hang report, a flight-recorder hold or a verdict."""
        inc = self.inc
        if inc is None or inc.pid != pid or inc.exited() or any(i.inc is inc for i in self.incidents):
            return
        inc.enforcing = False
        w = self.words
        handler_pid = w[L.H_HANDLER_PID] if self._client_matches(inc) else 0
        handler_sig = w[L.H_HANDLER_SIG]
        stack_path = (self.stack_template.replace("{pid}", str(handler_pid))
                      if handler_pid and handler_sig and self.stack_template else None)
        report = {"rank": inc.rank, "local_rank": self.local_rank, "pid": inc.pid, "cycle": inc.cycle,
                  "reason": reason, "section": None}
        incident = Incident(self, inc, report, handler_pid if stack_path else 0, handler_sig, stack_path)
        incident.hold = False
        self.incidents.append(incident)
        incident._begin_dump()

    # ---- loop ---------------------------------------------------------------------------------
    def poll_interval_ns(self) -> int:
        wci = self.cfg.workload_check_interval
        secs = min(wci, 0.05) if wci > 0 else 0.05
        return int(max(secs, 0.002) * 1e9)

    def run(self) -> None:
        self.send({"kind": "ready", "pid": os.getpid(), "shm": self.shm_path,
                   "nvrx_socket": self.nvrx.path if self.nvrx else None})
        while self.running:
            self.words[L.H_MONITOR_NS] = _mono()   # liveness: the agent replaces a monitor that stops ticking
            nearest = self.check()
            for incident in list(self.incidents):
                incident.step()
                if incident.phase == "done":
                    self.incidents.remove(incident)
                    if incident.inc is not self.inc:
                        incident.inc.close()
            now = _mono()
            wake = now + (self.poll_interval_ns() if self.inc is not None and self.inc.enforcing else 1_000_000_000)
            if nearest is not None:
                wake = min(wake, nearest)
            for incident in self.incidents:
                wake = min(wake, incident.wake_at())
            fds = [self.chan]
            if self.inc is not None and self.inc.enforcing and self.inc.pidfd is not None:
                fds.append(self.inc.pidfd)
            wfds = []
            if self.nvrx is not None:
                fds += self.nvrx.read_fds()
                wfds = self.nvrx.write_fds()
            timeout = max(wake - _mono(), 1_000_000) / 1e9
            try:
                readable, writable, _ = select.select(fds, wfds, [], timeout)
            except InterruptedError:
                continue
            if self.chan in readable:
                self.read_channel()
            if self.nvrx is not None:
                self.nvrx.service(readable, writable)
        self._stop_held()

    def _stop_held(self) -> None:
        """The agent is gone (or asked us to stop): a hung rank still held is stopped now."""
        for incident in self.incidents:
            if incident.phase in ("flight", "dump", "verdict") and incident.verdict is not False \
                    and not incident.inc.exited():
                incident._signal_group(signal.SIGCONT)
                incident._signal_group(signal.SIGKILL)

    def close(self) -> None:
        if self.nvrx is not None:
            self.nvrx.close()
        for path in (self.shm_path, L.env_file(self.shm_path), L.wake_pipe(self.shm_path)):
            try:
                os.unlink(path)
            except OSError:
                pass


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ft_launcher.rank_monitor.monitor_side.server")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--local-rank", type=int, required=True)
    parser.add_argument("--shm", required=True)
    parser.add_argument("--stack-template", default=None)
    parser.add_argument("--config", default="{}")
    parser.add_argument("--parent-pid", type=int, default=0)
    parser.add_argument("--nvrx-socket", default=None, help="serve NVRx's RankMonitorClient on this Unix socket")
    args = parser.parse_args(argv)

    _set_pdeathsig()
    if args.parent_pid and os.getppid() != args.parent_pid:
        return 1   # the agent died before we could arrange to die with it
    set_title(f"ft_launcher: rank_monitor local_rank={args.local_rank}")
    cfg = FaultToleranceConfig.from_json(args.config)
    logging.basicConfig(stream=sys.stderr, format="[ft_launcher rank_monitor %(levelname)s] %(message)s",
                        level=cfg.log_level)
    for sig in (signal.SIGINT, signal.SIGTERM):   # the agent ends us by closing the channel
        signal.signal(sig, lambda *_: sys.exit(0))
    sock = socket.socket(fileno=args.fd)
    server = Server(sock, args.local_rank, args.shm, args.stack_template, cfg, args.nvrx_socket)
    try:
        server.run()
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
