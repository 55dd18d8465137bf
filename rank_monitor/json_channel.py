"""The control channel between the agent's MonitorHandle and its monitor server: JSON objects,
one per line, over one end of a socketpair each. Reads never block; a send blocks only until the
kernel has taken the line (a few hundred bytes at most). Sends may come from several threads (the
agent's main loop, its flight-recorder thread): one at a time."""
from __future__ import annotations

import json
import socket
import threading
from typing import Callable, List, Optional


class JsonLineChannel:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.setblocking(False)
        self.eof = False
        self._buf = b""
        self._send_lock = threading.Lock()

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, msg: dict) -> None:
        """Send one object; raises OSError if the other side is gone."""
        data = (json.dumps(msg) + "\n").encode()
        with self._send_lock:
            self.sock.setblocking(True)
            try:
                self.sock.sendall(data)
            finally:
                try:
                    self.sock.setblocking(False)
                except OSError:
                    pass

    def receive(self, on_bad_line: Optional[Callable[[bytes, Exception], None]] = None) -> List[dict]:
        """Every complete object received so far; sets `eof` once the other side has closed."""
        while not self.eof:
            try:
                chunk = self.sock.recv(65536)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                self.eof = True
                break
            self._buf += chunk
        out: List[dict] = []
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except ValueError as exc:
                if on_bad_line:
                    on_bad_line(line, exc)
        return out

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
