"""Whether a node lives, told by its kernel, not by a counter in the store.

Each agent listens on a TCP port of its own (`AliveListener`; the port is in its NodeInfo) and
never answers on it. A peer that watches it holds one connection there (RoundWatcher):
- the agent's process dies (killed, crashed): its kernel closes the connection: EOF or reset,
  seen at once;
- its host goes away (power, network): TCP keep-alive probes go unanswered and the connection
  ends within `gone_after` s (keep_alive_interval x (keep_alive_max_attempt + 1), 4 s by default);
- it is alive but slow (paused, starved, busy): its kernel keeps the connection up and answers
  the probes: never taken for dead.
So liveness costs the store host nothing, and a node that lives is never declared lost.
`probe` asks the same question once (a connect: refused means dead).
"""
from __future__ import annotations

import socket
from typing import Optional

from ft_launcher.agent.rounds.store_client import configure


class AliveListener:
    """This agent's liveness port: a listening socket the watchers of this node connect to, and
    the connections it accepted (`conns`: held until their watcher closes them; closing one here
    would tell that watcher this node died)."""

    def __init__(self, host: str = ""):
        self.conns: set = set()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.sock.listen(64)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self) -> Optional[socket.socket]:
        try:
            conn, _ = self.sock.accept()
        except (BlockingIOError, InterruptedError, OSError):
            return None
        conn.setblocking(False)
        self.conns.add(conn)
        return conn

    def drop(self, conn: socket.socket) -> None:
        self.conns.discard(conn)
        try:
            conn.close()
        except OSError:
            pass

    def close(self) -> None:
        for conn in list(self.conns):
            self.drop(conn)
        try:
            self.sock.close()
        except OSError:
            pass


def watch_connection(host: str, port: int, gone_after: float) -> socket.socket:
    """A non-blocking connection (in progress) to a node's liveness port, with the TCP options
    that end it within `gone_after` s once its host stops answering."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    configure(sock, gone_after)
    sock.setblocking(False)
    try:
        sock.connect((host, port))
    except (BlockingIOError, InterruptedError):
        pass
    except OSError:
        pass   # refused at once: the watcher reads the error from the socket
    return sock


def probe(host: str, port: int, within: float = 1.0) -> bool:
    """Does a process still hold that liveness port? A refused or unanswered connect: no."""
    if not port:
        return True   # a node that has no liveness port (an older agent) is not judged
    try:
        with socket.create_connection((host, port), timeout=within):
            return True
    except OSError:
        return False
