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
`probe` asks the same question once, by a connect: answered (alive), refused (its process is
dead), or silent (no answer within the probe's time: a slow host, or the network between: no
verdict on its own). `Misses` asks it again and again and says when a node is gone: at the first
refused connect, or once the silent probes in a row span `window` s (keep_alive_interval x
keep_alive_max_attempt, 3 s by default: what TCP keep-alive allows a held connection), never
on one slow answer or one timeout (a network blip shorter than the window drops nobody).
"""
from __future__ import annotations

import socket
import time
from typing import Dict, Optional, Tuple

from ft_launcher.agent.launch_config import LaunchConfig
from ft_launcher.agent.rounds.store_client import configure

ANSWERED, REFUSED, SILENT = "answered", "refused", "silent"   # what a probe gets


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


def probe(host: str, port: int, within: float = 1.0) -> str:
    """What a connect to a node's liveness port gets: ANSWERED (a process holds the port), REFUSED
    (none does: its agent is dead), SILENT (no answer within `within` s, or another error: a slow
    or unreachable host; one is no verdict). A node without a liveness port (an older agent) is
    not judged: ANSWERED."""
    if not port:
        return ANSWERED
    try:
        with socket.create_connection((host, port), timeout=within):
            return ANSWERED
    except (ConnectionRefusedError, ConnectionResetError):
        return REFUSED
    except OSError:
        return SILENT


class Misses:
    """Which probed nodes are gone, from their probes over time (one instance per question: a
    round's missing nodes, a lingering store host's peers). Gone: a refused connect, or silent
    probes in a row (at least two) spanning at least `window` s from the first one's start to the
    last one's end. An answer starts the count again."""

    def __init__(self, window: float, within: float = 1.0):
        self.window = window
        self.within = within
        self._silent: Dict[Tuple[str, int], Tuple[float, int]] = {}   # (host, port) -> (since, count)

    @classmethod
    def of(cls, cfg: LaunchConfig, within: float = 1.0) -> "Misses":
        return cls(cfg.conf("keep_alive_interval") * cfg.conf("keep_alive_max_attempt"), within)

    def gone(self, host: str, port: int) -> bool:
        """Probe `host:port` once more: is that node gone?"""
        start = time.monotonic()
        answer = probe(host, port, self.within)
        if answer == ANSWERED:
            self._silent.pop((host, port), None)
            return False
        if answer == REFUSED:
            return True
        since, count = self._silent.get((host, port), (start, 0))
        self._silent[(host, port)] = (since, count + 1)
        return count + 1 >= 2 and time.monotonic() - since >= self.window
