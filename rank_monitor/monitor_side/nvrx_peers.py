"""NVRx's RankMonitorClient, served by the rank's monitor on the socket both NVRx variables name.

The monitor listens on one Unix socket per rank slot (`<record>.nvrx.sock`, mode 0600, made
before the monitor says ready); the agent gives its path to the rank as FT_RANK_MONITOR_IPC_SOCKET
and FT_LAUNCHER_IPC_SOCKET. All of it is non-blocking and runs in the monitor's select loop: a
peer that stops reading or writing never holds the deadline loop, and one whose unsent replies
pass OUT_LIMIT bytes is dropped. Messages are read with rank_monitor.nvrx_wire (a restricted
unpickler: NVRx's message classes only, as plain fields); a refused one is answered ErrorMsg with
its cause and logged in one line, and nothing of it is acted on.

A connection that sends InitMsg becomes the rank's client session (one from a new incarnation
replaces it). From then on the monitor writes the record's client words as the rank's own client
would, with the same section objects (rank_side.sections.bound_section): a SectionMsg opens or
closes its section the moment it arrives, a HeartbeatMsg is a heartbeat, and an UpdateConfigMsg's
calculated timeouts become the record's overrides, enforced no lower than calc_timeout_floor (as
our client's computed ones). So hang detection, the statistics behind computed timeouts and
ft_state.json, the report and status read the same words whichever client the rank runs. The
session's end (shutdown_workload_monitoring, or the rank's exit) turns monitoring off for the
incarnation, as our client's shutdown does. NVRx's answers are kept: OkMsg(cfg=...) with the
timeouts in effect, ErrorMsg "Section 'x' is already open." / "... is not open.".

Timeouts an NVRx client set stay with the monitor across the rank's restarts, as NVRx's server
keeps them in its configuration: the next incarnation's InitMsg gets them back in its
configuration and they are enforced from its attach.

A connection whose first message is `(rank, WorkloadControlRequest)` is NVRx's launcher
connector: the request goes into the record's request words, where the agent reads those of our
own client (agent.recovery.supervisor), and is answered b"ok".

When the rank's own client already writes the record, an NVRx session is answered but not
monitored (one line); when an NVRx session does, our client is a no-op (rank_side.shm_attachment says so).
"""
from __future__ import annotations

import logging
import os
import socket
import struct
import time
from typing import Dict, List, Optional

from ft_launcher.rank_monitor import nvrx_wire as W
from ft_launcher.rank_monitor import shm_layout as L
from ft_launcher.rank_monitor.rank_side.sections import _beat, bound_section
from ft_launcher.rank_monitor.rank_side.shm_attachment import _pid_alive
from ft_launcher.rank_monitor.workload_requests import WorkloadAction

log = logging.getLogger("rank_monitor")
_mono = time.monotonic_ns

OUT_LIMIT = 1 << 20        # unsent reply bytes a peer may leave before it is dropped
READ_BYTES = 1 << 16       # bytes read from one peer per wake-up: the deadline loop comes first
MAX_PEERS = 32             # connections at once (a rank needs one, plus one per workload request)
CLOSE_GRACE_NS = 1_000_000_000   # a refused peer's reply gets this long to go out before its socket closes
DECODED_KEPT = 256         # messages kept decoded by their bytes: a rank repeats the same few pickles


class Peer:
    """One connection: its bytes in and out, and what it turned out to be."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.frames = W.Frames()
        self.out = bytearray()
        self.role: Optional[str] = None     # None until its first message: "session" | "connector"
        self.quiet = False                  # its client waits for no reply to sections/heartbeats
        self.monitored = False              # its messages are written into the record
        self.closing = 0                    # monotonic ns by which it is closed (0: open); sooner once its replies are out
        self.closed = False
        try:
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            self.pid = struct.unpack("3i", creds)[0]
        except OSError:
            self.pid = 0

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, data: bytes) -> None:
        if self.closed:
            return
        if not self.out:
            try:
                sent = self.sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError:
                self.close()
                return
            data = data[sent:]
        self.out += data

    def flush(self) -> None:
        try:
            sent = self.sock.send(self.out)
            del self.out[:sent]
        except BlockingIOError:
            pass
        except OSError:
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()


class NvrxPeers:
    """The socket, its peers, and the session's writes into the monitor's record."""

    def __init__(self, server, path: str) -> None:
        self.server = server
        self.path = path
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(path)
            os.chmod(path, 0o600)
            listener.listen(16)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self.listener = listener
        self.peers: List[Peer] = []
        self.session: Optional[Peer] = None
        self.slots: Dict[str, int] = {}
        self.sections: Dict[str, object] = {}
        # Timeouts the NVRx client set (seconds, as it sent them), kept across incarnations:
        # "section:<name>", "out_of_section", "heartbeat:initial", "heartbeat:subsequent".
        self.kept: Dict[str, Optional[float]] = {}
        # Bytes -> Message: the same bytes always decode to the same message, and NVRx's client
        # sends the same few (a section's open and close, a heartbeat) again and again.
        self.decoded: Dict[bytes, W.Message] = {}

    # ---- the select loop's side ----------------------------------------------------------------
    def read_fds(self) -> list:
        return [self.listener] + [p for p in self.peers if not p.closed]

    def write_fds(self) -> list:
        return [p for p in self.peers if p.out and not p.closed]

    def service(self, readable, writable) -> None:
        if self.listener in readable:
            self._accept()
        for peer in list(self.peers):
            if peer in writable:
                peer.flush()
            if peer in readable and not peer.closed:
                self._read(peer)
            if peer.closing and (not peer.out or _mono() >= peer.closing):
                peer.close()
            if not peer.closed and len(peer.out) > OUT_LIMIT:
                self._say(peer, f"dropped: it left {len(peer.out)} bytes of replies unread")
                peer.close()
            if peer.closed:
                self._gone(peer)

    def close(self) -> None:
        for peer in self.peers:
            peer.close()
        self.peers.clear()
        self.listener.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("local_rank=%s: NVRx socket: accept failed: %s", self.server.local_rank, exc)
                return
            if len(self.peers) >= MAX_PEERS:
                log.warning("local_rank=%s: NVRx socket: more than %s connections at once; one refused",
                            self.server.local_rank, MAX_PEERS)
                sock.close()
                continue
            sock.setblocking(False)
            self.peers.append(Peer(sock))

    def _read(self, peer: Peer) -> None:
        try:   # one read per wake-up: the deadline loop runs between (a few hundred messages at most)
            data = peer.sock.recv(READ_BYTES)
        except (BlockingIOError, InterruptedError):
            data = None
        except OSError:
            data = b""
        if data == b"":
            peer.close()
        elif data:
            peer.frames.feed(data)
        while not peer.closing:
            try:
                payload = peer.frames.next()
            except W.ProtocolError as exc:
                self._refuse(peer, str(exc))
                peer.closing = _mono() + CLOSE_GRACE_NS   # the stream is out of step: nothing after it can be read
                break
            if payload is None:
                break
            msg = self.decoded.get(payload)
            try:
                if msg is None:
                    msg = W.decode(payload)
                    if len(self.decoded) < DECODED_KEPT and len(payload) <= 1024:
                        self.decoded[payload] = msg
            except W.ProtocolError as exc:
                self._refuse(peer, str(exc))
                if peer.role != "session":
                    peer.closing = _mono() + CLOSE_GRACE_NS
                continue
            self._handle(peer, msg)

    def _gone(self, peer: Peer) -> None:
        if peer in self.peers:
            self.peers.remove(peer)
        if peer is self.session:
            self.session = None
            w = self.server.words
            if peer.monitored and w[L.H_CLIENT_KIND] == L.CLIENT_NVRX and w[L.H_CLIENT_PID] == peer.pid:
                if self.open_sections():
                    log.debug("local_rank=%s: NVRx client (pid %s) ended its session with section(s) %s open",
                              self.server.local_rank, peer.pid, ", ".join(self.open_sections()))
                w[L.H_CLIENT_STATE] = 2   # monitoring off for this incarnation, as after our client's shutdown

    def _say(self, peer: Peer, what: str) -> None:
        log.warning("local_rank=%s: NVRx socket: pid %s: %s", self.server.local_rank, peer.pid, what)

    def _refuse(self, peer: Peer, cause: str) -> None:
        self._say(peer, cause)
        peer.send(W.error(cause))

    # ---- messages -----------------------------------------------------------------------------
    def _handle(self, peer: Peer, msg: W.Message) -> None:
        kind = msg.kind
        if kind == "request":
            if peer.role not in (None, "connector"):
                return self._refuse(peer, "a workload control request on a client session")
            peer.role = "connector"
            self._request(peer, msg)
            return
        if peer.role == "connector":
            return self._refuse(peer, f"a {kind} message on a workload-request connection")
        peer.role = peer.role or "client"
        if kind == "authkey":
            peer.send(W.OK)
        elif kind == "init":
            self._init(peer, msg)
        elif peer is not self.session:
            self._refuse(peer, f"{kind} before InitMsg")
        elif kind == "heartbeat":
            if peer.monitored:
                _beat(self.server.words)
            if not peer.quiet:
                peer.send(W.OK)
        elif kind == "section":
            cause = self._section(msg.action, msg.section) if peer.monitored else None
            if cause and peer.quiet:
                log.debug("local_rank=%s: NVRx client: %s", self.server.local_rank, cause)
            elif not peer.quiet:
                peer.send(W.error(cause) if cause else W.OK)
        elif kind == "update_config":
            self._timeouts(msg, peer.monitored)
            peer.send(W.OK)

    def _init(self, peer: Peer, msg: W.Message) -> None:
        server, w = self.server, self.server.words
        cfg = server.cfg
        if self.session is not None and self.session is not peer:
            self.session.close()   # a new incarnation's client: the old session is over (service drops it)
        self.session = peer
        peer.role = "session"
        peer.quiet = bool(msg.reads_skip_flag and cfg.skip_section_response)
        owner = w[L.H_CLIENT_PID]
        if w[L.H_CLIENT_STATE] == 1 and w[L.H_CLIENT_KIND] == L.CLIENT_OWN and owner and _pid_alive(owner):
            log.warning("local_rank=%s: NVRx's client (pid %s) connected while ft_launcher's own client (pid %s) "
                        "writes this rank's record: its sections and heartbeats are answered but not monitored",
                        server.local_rank, peer.pid, owner)
            peer.monitored = False
        else:
            L.clear_client_state(w)
            w[L.H_ATTACH_NS] = _mono()
            self.slots.clear()
            self.sections.clear()
            w[L.H_CLIENT_KIND] = L.CLIENT_NVRX
            w[L.H_CLIENT_PID] = peer.pid
            w[L.H_CLIENT_STATE] = 1
            peer.monitored = True
            self._enforce(self.kept)
            log.debug("local_rank=%s: NVRx client attached: rank %s pid %s%s", server.local_rank, msg.rank, peer.pid,
                      f", its timeouts kept from before: {_show(self.kept)}" if self.kept else "")
        timeouts = {"rank_section_timeouts": {**cfg.rank_section_timeouts,
                                              **{k[8:]: v for k, v in self.kept.items() if k.startswith("section:")}}}
        for key, field in (("out_of_section", "rank_out_of_section_timeout"),
                           ("heartbeat:initial", "initial_rank_heartbeat_timeout"),
                           ("heartbeat:subsequent", "rank_heartbeat_timeout")):
            if key in self.kept:
                timeouts[field] = self.kept[key]
        peer.send(W.ok(cfg=W.config(cfg, timeouts, peer.quiet)))

    def _slot(self, name: str) -> Optional[object]:
        sec = self.sections.get(name)
        if sec is not None:
            return sec
        data = name.encode("utf-8", "replace")
        if len(data) > L.NAME_BYTES:
            return None
        w = self.server.words
        idx = L.add_slot(self.server.mm, w, data)
        if idx is None:
            return None
        self.slots[name] = idx
        key = f"section:{name}"
        if key in self.kept:
            w[L.slot_base(idx) + L.S_TIMEOUT] = self._encode(self.kept[key])
        sec = self.sections[name] = bound_section(name, w, idx, self.slots)
        return sec

    def open_sections(self) -> List[str]:
        w = self.server.words
        return [n for n, i in self.slots.items() if w[L.slot_base(i) + L.S_OPEN]]

    def _section(self, action: str, name: Optional[str]) -> Optional[str]:
        """Open / close / close every section; NVRx's cause when it refuses, else None."""
        w = self.server.words
        if action == "close_all":
            for sec in self.sections.values():
                if w[sec._b + L.S_OPEN]:
                    sec.__exit__(None, None, None)
            return None
        sec = self._slot(name)
        if sec is None:
            return f"Section '{name[:40]}' cannot be monitored (a name of at most {L.NAME_BYTES} bytes, " \
                   f"at most {L.MAX_SLOTS} names)"
        is_open = bool(w[sec._b + L.S_OPEN])
        if action == "open":
            if is_open:
                return f"Section '{name}' is already open."
            sec.__enter__()
        else:
            if not is_open:
                return f"Section '{name}' is not open."
            sec.__exit__(None, None, None)
        return None

    def _timeouts(self, msg: W.Message, monitored: bool) -> None:
        """An UpdateConfigMsg: its calculated values (NVRx marks them) become the overrides."""
        new: Dict[str, Optional[float]] = {}
        hb = msg.heartbeat
        if hb is not None and hb["were_calculated"]:
            new["heartbeat:initial"], new["heartbeat:subsequent"] = hb["initial"], hb["subsequent"]
        sec = msg.sections
        if sec is not None:
            for name in sec["calculated"]:
                if name in sec["section"]:
                    new[f"section:{name}"] = sec["section"][name]
            if sec["out_of_section_calculated"]:
                new["out_of_section"] = sec["out_of_section"]
        if not new:
            return
        self.kept.update(new)
        if monitored:
            self._enforce(new)
            log.debug("local_rank=%s: NVRx client set timeouts: %s", self.server.local_rank, _show(new))

    def _encode(self, seconds: Optional[float]) -> int:
        if seconds is None:
            return L.TIMEOUT_NONE
        return L.encode_timeout(max(seconds, float(self.server.cfg.calc_timeout_floor or 0.0)))

    def _enforce(self, timeouts: Dict[str, Optional[float]]) -> None:
        w = self.server.words
        for key, seconds in timeouts.items():
            if key.startswith("section:"):
                if self._slot(key[8:]) is not None:
                    w[L.slot_base(self.slots[key[8:]]) + L.S_TIMEOUT] = self._encode(seconds)
            else:
                word = {"out_of_section": L.H_TO_OOS, "heartbeat:initial": L.H_TO_HB_INIT,
                        "heartbeat:subsequent": L.H_TO_HB_SUB}[key]
                w[word] = self._encode(seconds)

    def _request(self, peer: Peer, msg: W.Message) -> None:
        L.write_request(self.server.mm, self.server.words, WorkloadAction[msg.action].value, msg.description)
        log.debug("local_rank=%s: NVRx client (rank %s) sent %s (%s)", self.server.local_rank, msg.rank, msg.action,
                  msg.description)
        peer.send(W.LAUNCHER_OK)
        peer.closing = _mono() + CLOSE_GRACE_NS


def _show(timeouts: Dict[str, Optional[float]]) -> str:
    return ", ".join(f"{k.split(':', 1)[-1]} {'none' if v is None else f'{v:g} s'}" for k, v in sorted(timeouts.items()))
