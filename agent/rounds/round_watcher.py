"""The round watcher: what an agent learns between its own store calls, without polling.

For the round it is given (`watch`), a RoundWatcher
- holds one WAIT on the round's `r<R>/interrupt` (agent.rounds.rendezvous): the agent is woken the
  moment the round is interrupted, whoever wrote it (a decider that died before its verdict too);
- holds one connection to the liveness port of each of the WATCHED_PEERS nodes after this one in
  the round's order (agent.rounds.keepalive): a peer whose process dies is known at once, one
  whose host is gone within gone_after s; a slow peer is never taken for dead;
- accepts the connections of the nodes that watch this one;
- asks the store whether it still answers when nothing else was heard from it for ping_every
  s; a store that is dead or gone is lost at once, one that holds its connection but has not
  answered for store_unresponsive_timeout s is lost then, and never before (slow is not dead);
- at the head of the order (the store's possible successors, at most HEAD nodes), reads every
  keep_alive_interval on a connection of its own whether a node joined the round late, and
  records it (a failover must count it).
On the store host it also fences itself: when a peer dies, or when the watcher itself did not
run for a while (this process was paused), `fence()` looks for a successor store that took the
job over meanwhile; if there is one, `store.replaced` is set.

Watchers run on a WatchLoop: one thread and one selector. An agent has its own; the emulator in
bench/ runs many agents' watchers on one loop. Their cost at the store host is one WAIT per
round and one PING per ping_every s per agent, and one small read a second per head node.
"""
from __future__ import annotations

import os
import selectors
import socket
import sys
import threading
import time
from typing import Callable, Dict, List, Optional

from ft_launcher.agent.launch_config import LaunchConfig
from ft_launcher.agent.rounds import store_keys, store_threads
from ft_launcher.agent.rounds.keepalive import AliveListener, watch_connection
from ft_launcher.agent.rounds.job_store import JobStore, gone_after, ping_every
from ft_launcher.agent.rounds.rendezvous import _node
from ft_launcher.agent.rounds.round_types import NodeInfo, RendezvousError, Round
from ft_launcher.agent.rounds.store_client import StoreUnreachable


class WatchLoop:
    """One thread, one selector, the watchers attached to it."""

    def __init__(self, name: str = "ft-round-watcher"):
        self.sel = selectors.DefaultSelector()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self.sel.register(self._r, selectors.EVENT_READ, None)
        self._todo: List[Callable[[], None]] = []
        self._lock = threading.Lock()
        self.watchers: List["RoundWatcher"] = []
        self.halt = False
        self.gap_limit = 3.0
        self._said: set = set()   # the unexpected errors said once (_guarded)
        self.thread = store_threads.track(threading.Thread(target=self.run, name=name, daemon=True))

    def start(self) -> None:
        if not self.thread.is_alive():
            self.thread.start()

    def call(self, fn: Callable[[], None]) -> None:
        """Run `fn` in the loop's thread, soon."""
        with self._lock:
            self._todo.append(fn)
        try:
            os.write(self._w, b"x")
        except (BlockingIOError, OSError):
            pass

    def stop(self) -> None:
        self.halt = True
        self.call(lambda: None)

    def run(self) -> None:
        try:
            while not self.halt:
                now = time.monotonic()
                timeout = min([w.next_due(now) for w in self.watchers] + [1.0])
                timeout = max(0.0, timeout)
                events = self.sel.select(timeout)
                after = time.monotonic()
                if after - (now + timeout) > self.gap_limit:   # this process did not run: paused
                    for w in list(self.watchers):
                        w.after_gap(after - now)
                with self._lock:
                    todo, self._todo = self._todo, []
                for fn in todo:
                    self._guarded(fn)
                for key, mask in events:
                    if key.data is None:
                        try:
                            os.read(self._r, 4096)
                        except (BlockingIOError, OSError):
                            pass
                    else:
                        self._guarded(key.data, mask)
                for w in list(self.watchers):
                    self._guarded(w.tick, time.monotonic())
        finally:
            for w in list(self.watchers):
                w._detach()
            try:
                self.sel.close()
                os.close(self._r)
                os.close(self._w)
            except OSError:
                pass

    def _guarded(self, fn: Callable, *args) -> None:
        """Run one handler; an error it did not expect is said (once per kind) and the loop goes
        on: a watcher thread that died would leave its agent deaf to a lost store or peer."""
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001
            kind = f"{type(exc).__name__}: {exc}"
            if kind in self._said:
                return
            self._said.add(kind)
            say = self.watchers[0].store.say if self.watchers else None
            line = f"the round watcher hit an unexpected error and goes on watching: {kind}"
            if say is not None:
                say(line)
            else:
                print(f"ft_launcher: {line}", file=sys.stderr, flush=True)

    def register(self, fileobj, events: int, handler) -> None:
        try:
            self.sel.register(fileobj, events, handler)
        except (KeyError, ValueError, OSError):
            try:
                self.sel.modify(fileobj, events, handler)
            except (KeyError, ValueError, OSError):
                pass

    def unregister(self, fileobj) -> None:
        try:
            self.sel.unregister(fileobj)
        except (KeyError, ValueError, OSError):
            pass


class RoundWatcher:
    """See the module docstring. `wake()` is called (from the loop's thread) whenever the agent
    should look: interrupted_round, dead_peers, store_lost."""

    def __init__(self, store: JobStore, cfg: LaunchConfig, me: NodeInfo, wake: Callable[[], None],
                 fence: Optional[Callable[[], Optional[str]]] = None,
                 on_late_joiner: Optional[Callable[[NodeInfo], None]] = None,
                 listener: Optional[AliveListener] = None, loop: Optional[WatchLoop] = None):
        self.s = store.new_client(label="watcher", stop=False)
        self.news = None        # the head's connection for late joiners (opened when at the head)
        self._at_head = False   # this node is at the head of the watched round's order
        self._late_seen = 0
        self._next_news = 0.0
        self.news_every = cfg.conf("keep_alive_interval")
        self.store = store
        self.me = me
        self.wake = wake
        self.fence = fence
        self.on_late_joiner = on_late_joiner
        self.listener = listener
        # nodes that joined the watched round after it closed (they wait as spares): a store
        # failover must know them too (agent.rounds.store_failover shares this list)
        self.late_joiners: List[NodeInfo] = []
        self.unresponsive = cfg.conf("store_unresponsive_timeout")
        self.ping_every = ping_every(cfg)
        self.gone_after = gone_after(cfg)
        self._own_loop = loop is None
        self.loop = loop or WatchLoop()
        self.loop.gap_limit = cfg.conf("keep_alive_interval") * cfg.conf("keep_alive_max_attempt")
        self._lock = threading.Lock()
        self._round: Optional[Round] = None
        self._watching: Optional[Round] = None      # the round the loop has set up
        self._peers: Dict[socket.socket, NodeInfo] = {}
        self.interrupted_round: Optional[int] = None
        self.dead_peers: List[NodeInfo] = []
        self._lost: Optional[str] = None
        self._said_slow = False
        self._halted = False
        self.loop.call(self._attach)

    # ---- the agent's side ---------------------------------------------------------------------
    @property
    def store_lost(self) -> Optional[str]:
        """Why the store is lost (dead, gone, unresponsive, or replaced by a successor), else None."""
        return self._lost or self.store.replaced

    def start(self) -> None:
        if self._own_loop:
            self.loop.start()

    def is_alive(self) -> bool:
        return self.loop.thread.is_alive()

    def join(self, timeout: Optional[float] = None) -> None:
        if self._own_loop and self.loop.thread.is_alive() and threading.current_thread() is not self.loop.thread:
            self.loop.thread.join(timeout)

    def watch(self, rnd: Optional[Round]) -> None:
        with self._lock:
            self._round = rnd
            self.dead_peers = []
        self.loop.call(self._rewatch)

    def stop(self, wait: float = 0.0) -> None:
        """Stop watching; with `wait`, give the loop that long to end."""
        self._halted = True
        self.loop.call(self._detach)
        if self._own_loop:
            self.loop.stop()
            if wait:
                self.join(wait)

    # ---- the loop's side ----------------------------------------------------------------------
    def _attach(self) -> None:
        if self._halted:
            return
        self.loop.watchers.append(self)
        self.loop.register(self.s.sock, selectors.EVENT_READ, self._on_store)
        if self.listener is not None:
            self.loop.register(self.listener.sock, selectors.EVENT_READ, self._on_listener)
            for conn in list(self.listener.conns):
                self.loop.register(conn, selectors.EVENT_READ, lambda mask, c=conn: self._on_inbound(c))

    def _detach(self) -> None:
        if self in self.loop.watchers:
            self.loop.watchers.remove(self)
        self.loop.unregister(self.s.sock)
        if self.listener is not None:
            self.loop.unregister(self.listener.sock)
            for conn in list(self.listener.conns):
                self.loop.unregister(conn)
        self._close_peers()
        self.s.close()
        if self.news is not None:
            self.news.close()

    def next_due(self, now: float) -> float:
        """Seconds until this watcher has something to do."""
        if self._lost:
            return 1.0
        oldest = self.s.oldest_ping
        due = [oldest + self.ping_every, oldest + self.unresponsive] if oldest is not None else \
            [self.s.last_heard + self.ping_every]
        if self._at_head:
            due.append(self._next_news)
        return max(0.0, min(due) - now)

    def tick(self, now: float) -> None:
        if self._lost or self._halted:
            return
        if self._at_head and now >= self._next_news:
            self._next_news = now + self.news_every
            # (re)opened only while the store answers the watcher, and briefly: the loop never
            # waits on a slow store for it
            if self.news is not None or (self.s.oldest_ping is None and self._open_news()):
                self._read_late()
        oldest = self.s.oldest_ping
        try:
            if oldest is None:
                if now - self.s.last_heard >= self.ping_every:
                    self.s.ping_async()
            elif now - oldest > self.unresponsive:
                self._store_lost(f"the rendezvous store at {self.store.host}:{self.store.port} has not answered "
                                 f"for {now - oldest:.0f}s (its host still holds the connection: paused or hung; "
                                 f"store_unresponsive_timeout={self.unresponsive:g}s)")
            elif now - oldest > self.ping_every and not self._said_slow:
                self._said_slow = True
                self.store.say(f"the rendezvous store at {self.store.host}:{self.store.port} has not answered for "
                               f"{now - oldest:.0f}s; its host holds the connection (alive: busy or paused): "
                               f"waiting up to store_unresponsive_timeout={self.unresponsive:g}s")
        except StoreUnreachable as exc:
            self._store_lost(f"lost the rendezvous store at {self.store.host}:{self.store.port} ({exc})")

    def after_gap(self, gap: float) -> None:
        """This process did not run for `gap` s (paused): a store host looks for a successor."""
        if self.store.is_host and self.fence is not None and not self._halted:
            self._fence()

    def _store_lost(self, why: str) -> None:
        if self._lost is None:
            self._lost = why
            self.loop.unregister(self.s.sock)
            self.wake()

    def _on_store(self, mask: int) -> None:
        try:
            events = self.s.events()
        except StoreUnreachable as exc:
            self._store_lost(f"lost the rendezvous store at {self.store.host}:{self.store.port} ({exc})")
            return
        if events:
            self._said_slow = False
        if "stop" in events:
            rnd = self._watching
            with self._lock:
                if rnd is not None and self._round is rnd and self.interrupted_round != rnd.number:
                    self.interrupted_round = rnd.number
                    self.wake()

    def _rewatch(self) -> None:
        with self._lock:
            rnd = self._round
        if rnd is self._watching or self._lost or self._halted:
            return
        self._close_peers()
        try:
            if self.s.waiting:
                self.s.cancel_async_wait()
            self._watching = rnd
            if rnd is None:
                return
            self._late_seen = 0
            for peer in rnd.peers:
                if peer.alive_port and peer.node_id != self.me.node_id:
                    sock = watch_connection(peer.host, peer.alive_port, self.gone_after)
                    self._peers[sock] = peer
                    self.loop.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE,
                                       lambda mask, s=sock: self._on_peer(s, mask))
            self.s.begin_wait([self.store.key(store_keys.interrupt(rnd.number))])
        except StoreUnreachable as exc:
            self._store_lost(f"lost the rendezvous store at {self.store.host}:{self.store.port} ({exc})")
            return
        self._at_head = any(n.node_id == self.me.node_id for n in rnd.head)   # the head counts late joiners

    def _open_news(self) -> bool:
        """The head's connection for late joiners; False when it cannot be had now (tried again
        every keep_alive_interval: the watcher's own connection says what a lost store means)."""
        try:
            self.news = self.store.new_client(label="news", within=2 * self.news_every, stop=False)
        except (RendezvousError, StoreUnreachable, OSError):
            self.news = None
            return False
        self.news.unresponsive = 2 * self.news_every   # its reads never hold the loop for long
        return True

    def _read_late(self) -> None:
        """At the head: the nodes that joined the watched round after it closed (once each)."""
        rnd = self._watching
        if rnd is None:
            return
        try:
            count = self.news.add(self.store.key(store_keys.nlate(rnd.number)), 0)
            if count <= self._late_seen:
                return
            raw = self.news.get_now(self.store.key(store_keys.late(rnd.number)))
        except StoreUnreachable:   # the watcher's own connection says what the store's loss means
            self.news.close()
            self.news = None
            return
        self._late_seen = count
        known = {n.node_id for n in self.late_joiners} | {self.me.node_id}
        for line in raw.decode(errors="replace").splitlines():
            try:
                node = _node(line)
            except (ValueError, TypeError):
                continue
            if node.node_id not in known:
                known.add(node.node_id)
                self.late_joiners.append(node)
                if self.on_late_joiner is not None:
                    self.on_late_joiner(node)

    def _on_peer(self, sock: socket.socket, mask: int) -> None:
        peer = self._peers.get(sock)
        if peer is None:
            self.loop.unregister(sock)
            return
        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if not err and mask & selectors.EVENT_READ:
            try:
                if sock.recv(4096):
                    return
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                pass
        elif not err:   # connected: from now on only its end is news
            self.loop.register(sock, selectors.EVENT_READ, lambda m, s=sock: self._on_peer(s, m))
            return
        self._peer_dead(sock, peer)

    def _peer_dead(self, sock: socket.socket, peer: NodeInfo) -> None:
        self._peers.pop(sock, None)
        self.loop.unregister(sock)
        sock.close()
        if self.store.is_host and self.fence is not None and self._fence():
            return
        with self._lock:
            rnd = self._round
            if rnd is not None and rnd is self._watching and not self.dead_peers:
                self.dead_peers = [peer]
                self.wake()

    def _fence(self) -> bool:
        where = self.fence()
        if where:
            self.store.replaced = where
            self.wake()
            return True
        return False

    def _on_listener(self, mask: int) -> None:
        while True:
            conn = self.listener.accept()
            if conn is None:
                return
            self.loop.register(conn, selectors.EVENT_READ, lambda m, c=conn: self._on_inbound(c))

    def _on_inbound(self, conn: socket.socket) -> None:
        try:
            if conn.recv(4096):
                return
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            pass
        self.loop.unregister(conn)
        self.listener.drop(conn)   # its watcher moved on or died

    def _close_peers(self) -> None:
        for sock in list(self._peers):
            self.loop.unregister(sock)
            sock.close()
        self._peers.clear()
