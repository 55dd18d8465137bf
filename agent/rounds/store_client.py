"""The agents' client of the job's store: torch's TCPStore wire protocol over a socket we own.

The store itself stays torch's `TCPStore` server (libuv backend), hosted by one agent; every
agent talks to it through this client instead of torch's. Owning the socket is what lets an
agent tell a store that is slow from one that is gone, and wait without polling:

- **dead**: the store's process is gone: the connection is refused or reset, or closed (EOF).
  Known at once, from the socket.
- **host gone**: nothing answers at the TCP level (host down, cable cut): TCP keep-alive probes
  and TCP_USER_TIMEOUT end the connection within `gone_after` s (keep_alive_interval x
  (keep_alive_max_attempt + 1), 4 s by default).
- **slow**: the host's kernel holds the connection and acknowledges what we send, but the store
  has not answered yet (a paused, starved or busy process). Never taken for dead: a call waits,
  saying so once, until `unresponsive` s (store_unresponsive_timeout, 20 s by default) have
  passed without a byte from it; only then is it given up as unresponsive.
- **foreign**: a program that is not a store: told by what it answers to the handshake (torch's
  VALIDATE then PING, which a store echoes), not by how long it takes. One that answers nothing:
  on this host, its owner is looked up (a stopped process is a paused store: waited for; a
  running one that accepts our bytes and never answers within HANDSHAKE_LIMIT is not a store);
  on another host it is waited for as a slow store.

Waits block in the store (one WAIT request, the server answers when the key exists): no polling.
While a WAIT is outstanding the client may send PINGs (at most one per `ping_every` s) to learn
that the store still answers; their echo starts with a byte (0xA5) that no wait answer has, so
the stream stays unambiguous. A wait that times out is cancelled (CANCEL_WAIT). Every wait is
cut into local slices that ask `stop` (a signal) without any store traffic.

Calls, payload bytes (keys, values and headers, both ways) and the server's messages are counted
per label when counting is on (`counting(True)`: FT_LAUNCHER_STORE_STATS, bench/).
Free of torch.
"""
from __future__ import annotations

import datetime
import errno
import os
import select
import socket
import struct
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Union

MAGIC = 0x3C85F7CE
(VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT, GETNUMKEYS, DELETE_KEY, APPEND, MULTI_GET, MULTI_SET,
 CANCEL_WAIT, PING) = range(14)
READY = 0
STOP_WAITING, WAIT_CANCELED = 0, 1
KEY_PREFIX = "/"              # what torch's TCPStore client puts before every key
PONG_MARK = 0xA5              # the first byte of every PING nonce we send
SLICE = 0.25                  # seconds between looks at `stop` while a call or a wait is in progress
RETRY = 1.0                   # seconds before an unanswered handshake is tried again on a fresh connection
HANDSHAKE_LIMIT = 4.0         # a running program on this host that has not answered the handshake by then is foreign

_Q = struct.Struct("<Q")
_q = struct.Struct("<q")


class StoreError(Exception):
    """Base of this client's errors."""


class StoreTimeout(StoreError, TimeoutError):
    """A wait's time ran out (the store is fine)."""


class StoreUnreachable(StoreError, ConnectionError):
    """The store is lost: `how` is dead (refused, reset, closed), gone (no TCP answer) or
    unresponsive (the connection holds, but no answer for the unresponsive limit)."""

    def __init__(self, message: str, how: str):
        super().__init__(message)
        self.how = how


class NotAStore(StoreError):
    """The program at the endpoint answered, but not as a store."""


# ---- counting ------------------------------------------------------------------------------
_COUNT = {"on": bool(os.environ.get("FT_LAUNCHER_STORE_STATS"))}
STATS: Dict[str, Dict[str, list]] = {}   # label -> method -> [calls, bytes]
_STATS_LOCK = threading.Lock()


def counting(on: bool) -> None:
    _COUNT["on"] = on


def _count(label: str, method: str, nbytes: int, calls: int = 1) -> None:
    if _COUNT["on"]:
        with _STATS_LOCK:
            row = STATS.setdefault(label, {}).setdefault(method, [0, 0])
            row[0] += calls
            row[1] += nbytes


def _b(value: Union[str, bytes]) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _vec(value: Union[str, bytes]) -> bytes:
    data = _b(value)
    return _Q.pack(len(data)) + data


def _key(key: str) -> bytes:
    """A key on the wire: torch's client puts "/" before every key, so ours does too (both see
    the same keys)."""
    return _vec(KEY_PREFIX + key)


def _seconds(timeout) -> float:
    return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)


def _how(exc: OSError) -> str:
    return "gone" if exc.errno in (errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN) else "dead"


def configure(sock: socket.socket, gone_after: float) -> None:
    """TCP options that end a connection whose peer host stops answering within `gone_after` s
    (keep-alive probes while idle, TCP_USER_TIMEOUT while data is unacknowledged), and no Nagle."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    interval = max(1, int(round(gone_after / 4)))
    for name, value in (("TCP_KEEPIDLE", interval), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", 3),
                        ("TCP_USER_TIMEOUT", int(gone_after * 1000))):
        opt = getattr(socket, name, None)
        if opt is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, opt, value)
            except OSError:
                pass


def listener_state(port: int) -> Optional[str]:
    """The state letter (/proc/PID/stat: R, S, T ...) of the process on this host that listens on
    `port`, or None when it cannot be told (not Linux, not ours to see, nobody)."""
    from ft_launcher.rank_monitor.peer_sockets import tcp_table

    inodes = {f"socket:[{inode}]" for local, _, inode in tcp_table("0A") if int(local.rsplit(":", 1)[1], 16) == port}
    if not inodes:
        return None
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    with open(f"/proc/{pid}/stat") as fh:
                        return fh.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
    return None


class StoreClient:
    """One connection to the store (see the module docstring). One call at a time (a lock).

    `stop()` (optional) raises to end a call or wait between slices (the agent's signals);
    `say(line)` (optional) is told once per slow spell that the store has not answered yet."""

    def __init__(self, sock: socket.socket, host: str, port: int, *, unresponsive: float = 20.0,
                 ping_every: float = 5.0, stop: Optional[Callable[[], None]] = None,
                 say: Optional[Callable[[str], None]] = None, label: str = "other"):
        self.sock = sock
        self.host, self.port = host, port
        self.unresponsive = unresponsive
        self.ping_every = ping_every
        self.stop = stop
        self.say = say
        self.label = label
        self._poll_in, self._poll_out = select.poll(), select.poll()
        self._poll_in.register(sock, select.POLLIN)
        self._poll_out.register(sock, select.POLLOUT)
        self.default_timeout: Optional[float] = None   # torch's store timeout, for get and multi_get
        self._buf = bytearray()
        self._rx = 0                        # bytes received in all (for counting)
        self._lock = threading.RLock()
        self._closed = False
        self._broken: Optional[StoreUnreachable] = None
        self._pings: List[float] = []       # send times of PINGs not yet echoed
        self._nonce = 0
        self._waiting = False               # a WAIT is outstanding (async use: begin_wait)
        self._expect: List[str] = []        # answers due in order after a get_async ("get", "pong")
        self._tick: Optional[Callable[[], None]] = None   # called between a wait's slices
        self._said_slow = False
        self._owed: List[Callable[[], object]] = []   # answers of calls a stop ended, still to come
        self._journal: Optional[bytearray] = None     # what an answer being read has taken so far
        self.last_heard = time.monotonic()  # when the store last sent us a byte (or we connected)
        self._sent_at = 0.0                 # when we last sent it a request

    # ---- connecting --------------------------------------------------------------------------
    @classmethod
    def connect(cls, host: str, port: int, *, within: float = 60.0, unresponsive: float = 20.0,
                gone_after: float = 4.0, ping_every: float = 5.0, stop: Optional[Callable[[], None]] = None,
                say: Optional[Callable[[str], None]] = None, label: str = "other",
                local: Optional[bool] = None, handshake_limit: Optional[float] = None) -> "StoreClient":
        """Connect and shake hands. Raises StoreUnreachable (refused: dead; no TCP answer: gone;
        a paused or silent store past `within` s: unresponsive) or NotAStore.

        A connection whose handshake is not answered within RETRY s is replaced by a fresh one
        (torch's libuv server now and then leaves one new connection unserved for ~5 s while it
        serves the next at once); a program that answers none of them is judged as above."""
        limit = HANDSHAKE_LIMIT if handshake_limit is None else handshake_limit
        start = time.monotonic()
        told = False
        while True:
            client = cls._open(host, port, within, unresponsive, gone_after, ping_every, stop, say, label)
            try:
                if client._handshake(min(RETRY, limit, within)):
                    return client
            except BaseException:
                client.close()
                raise
            client.close()
            waited = time.monotonic() - start
            if waited >= limit and not told:
                told = True
                state = listener_state(port) if (local if local is not None else _is_loopback(host)) else None
                if state is not None and state not in ("T", "t"):
                    raise NotAStore(f"accepted the connection but did not answer a store's handshake within "
                                    f"{limit:g}s (its process is running)")
                if say is not None:
                    why = ("its process is stopped (paused): waiting for it" if state in ("T", "t") else
                           "a paused or busy store, or a program that is not one: waiting")
                    say(f"the program at {host}:{port} accepted the connection but has not answered the store "
                        f"handshake for {waited:.0f}s ({why}, up to {within:g}s)")
            if waited >= within:
                raise StoreUnreachable(f"the program at {host}:{port} accepted the connection but did not "
                                       f"answer the store handshake within {within:g}s", "unresponsive")

    @classmethod
    def _open(cls, host, port, within, unresponsive, gone_after, ping_every, stop, say, label) -> "StoreClient":
        try:
            sock = socket.create_connection((host, port), timeout=min(max(gone_after, 1.0), within))
        except socket.timeout:
            raise StoreUnreachable(f"no answer from {host}:{port} at the TCP level", "gone") from None
        except OSError as exc:
            raise StoreUnreachable(f"cannot connect to {host}:{port}: {exc.strerror or exc}", _how(exc)) from None
        sock.setblocking(False)
        configure(sock, gone_after)
        return cls(sock, host, port, unresponsive=unresponsive, ping_every=ping_every, stop=stop, say=say,
                   label=label)

    def _handshake(self, within: float) -> bool:
        """VALIDATE, then a PING the store must echo: True when it did within `within` s, False
        when nothing came; NotAStore for any other answer (or a closed connection)."""
        nonce = self._next_nonce()
        self._send(bytes([VALIDATE]) + struct.pack("<I", MAGIC) + bytes([PING]) + nonce, "handshake")
        start = time.monotonic()
        while len(self._buf) < 4:
            if self._buf and self._buf[0] != PONG_MARK:
                raise NotAStore(f"answered {bytes(self._buf[:16])!r} instead of a store's handshake")
            if self.stop is not None:
                self.stop()
            left = within - (time.monotonic() - start)
            if left <= 0:
                return False
            try:
                self._fill(min(SLICE, left), "handshake")
            except StoreUnreachable as exc:
                if exc.how == "dead":
                    raise NotAStore("closed the connection instead of answering a store's handshake") from None
                raise
        if bytes(self._buf[:4]) != nonce:
            raise NotAStore(f"answered {bytes(self._buf[:4])!r} instead of echoing the handshake")
        del self._buf[:4]
        self._count_msg("handshake", 9 + 5 + 4)
        return True

    # ---- low level ---------------------------------------------------------------------------
    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self._closed = True
        try:
            self.sock.close()
        except OSError:
            pass

    def __del__(self):
        try:
            self.sock.close()
        except Exception:  # noqa: BLE001
            pass

    def _next_nonce(self) -> bytes:
        self._nonce = (self._nonce + 1) & 0xFFFFFF
        return bytes([PONG_MARK]) + self._nonce.to_bytes(3, "little")

    def _lost(self, message: str, how: str) -> StoreUnreachable:
        self._broken = StoreUnreachable(f"{message} ({self.host}:{self.port})", how)
        return self._broken

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise self._broken
        if self._closed:
            raise StoreUnreachable(f"connection to {self.host}:{self.port} closed", "dead")

    def _send(self, data: bytes, what: str) -> None:
        """Send all of `data`; a store that does not take it is slow (waited for) until unresponsive."""
        view = memoryview(data)
        since = self._sent_at = time.monotonic()
        while view:
            try:
                sent = self.sock.send(view)
                view = view[sent:]
                since = time.monotonic()
                continue
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as exc:
                raise self._lost(f"the store's connection failed: {exc.strerror or exc}", _how(exc)) from None
            if self.stop is not None and len(view) == len(data):   # never a request half sent
                self.stop()
            if time.monotonic() - since > self.unresponsive:
                raise self._lost(f"the store has not taken our {what} for {self.unresponsive:g}s", "unresponsive")
            self._poll_out.poll(int(SLICE * 1000))

    def _fill(self, timeout: float, what: str) -> bool:
        """Read what has arrived, waiting up to `timeout` s; True when bytes came. EOF and socket
        errors raise StoreUnreachable (dead or gone)."""
        try:
            ready = self._poll_in.poll(max(0, int(timeout * 1000)))   # poll, not select: no limit on fd numbers
        except (OSError, ValueError):
            raise self._lost("the store's connection is closed", "dead") from None
        if not ready:
            return False
        try:
            data = self.sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            raise self._lost(f"the store's connection failed: {exc.strerror or exc}", _how(exc)) from None
        if not data:
            raise self._lost("the store closed the connection", "dead")
        self._buf += data
        self._rx += len(data)
        self.last_heard = time.monotonic()
        self._said_slow = False
        return True

    def _need(self, n: int, what: str) -> None:
        """Wait until `n` bytes are buffered: slow is waited for (stop asked between slices), up to
        `unresponsive` s without a byte."""
        while len(self._buf) < n:
            since = max(self.last_heard, self._sent_at)   # an idle connection is not a silent store
            if self.stop is not None:
                self.stop()
            quiet = time.monotonic() - since
            if quiet > self.unresponsive and not self._fill(0, what):   # read first: a starved client is not a silent store
                raise self._lost(f"the store has not answered for {quiet:.0f}s (its host still holds the "
                                 f"connection: a paused or hung store)", "unresponsive")
            if quiet > self.ping_every and not self._said_slow and self.say is not None:
                self._said_slow = True
                self.say(f"the rendezvous store at {self.host}:{self.port} has not answered our {what} for "
                         f"{quiet:.0f}s; its host holds the connection (alive: busy or paused): waiting up to "
                         f"{self.unresponsive:g}s")
            self._fill(SLICE, what)

    def _take(self, n: int, what: str) -> bytes:
        self._need(n, what)
        out = bytes(self._buf[:n])
        del self._buf[:n]
        if self._journal is not None:
            self._journal += out
        return out

    def _take_vec(self, what: str) -> bytes:
        size = _Q.unpack(self._take(8, what))[0]
        return self._take(size, what)

    def _count_msg(self, method: str, nbytes: int) -> None:
        _count(self.label, method, nbytes)

    def _drain_pings(self, what: str) -> None:
        """Read the echoes of PINGs sent during a wait (they come in order, after its answer)."""
        while self._pings:
            mark = self._take(4, what)
            if mark[0] != PONG_MARK:
                raise self._lost(f"unexpected bytes {mark!r} from the store", "dead")
            self._pings.pop(0)

    def _call(self, method: str, request: bytes, read: Optional[Callable[[], object]] = None):
        with self._lock:
            self._check_usable()
            if self._waiting:
                raise StoreError("a wait is outstanding on this connection")
            self._settle_owed()
            self._drain_pings(method)
            self._send(request, method)
            nbytes = len(request)
            if read is None:
                self._count_msg(method, nbytes)
                return None
            before = self._rx - len(self._buf)
            result = self._answer(read)
            self._count_msg(method, nbytes + self._rx - len(self._buf) - before)
            return result

    def _answer(self, read: Callable[[], object], front: bool = False):
        """`read()` the answer of a request sent. A stop (a signal) that ends it midway puts back
        what it had taken and leaves the answer owed: the next call reads it first, so that it
        never takes another call's answer for its own (the signal still ends this call at once)."""
        self._journal = bytearray()
        try:
            return read()
        except StoreUnreachable:
            raise
        except BaseException:
            self._buf[:0] = self._journal
            if front:
                self._owed.insert(0, read)
            else:
                self._owed.append(read)
            raise
        finally:
            self._journal = None

    def _settle_owed(self) -> None:
        """Read (and drop) the answers of calls a stop ended, oldest first."""
        while self._owed:
            self._answer(self._owed.pop(0), front=True)

    # ---- torch's TCPStore API --------------------------------------------------------------
    def set(self, key: str, value) -> None:
        self._call("set", bytes([SET]) + _key(key) + _vec(value))

    def multi_set(self, keys: Sequence[str], values: Sequence) -> None:
        parts = [bytes([MULTI_SET]), _Q.pack(len(keys))]
        for k, v in zip(keys, values):
            parts += [_key(k), _vec(v)]
        self._call("multi_set", b"".join(parts))

    def append(self, key: str, value) -> None:
        self._call("append", bytes([APPEND]) + _key(key) + _vec(value))

    def add(self, key: str, amount: int) -> int:
        return self._call("add", bytes([ADD]) + _key(key) + _q.pack(int(amount)),
                          lambda: _q.unpack(self._take(8, "add"))[0])

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._call("compare_set", bytes([COMPARE_SET]) + _key(key) + _vec(expected) + _vec(desired),
                          lambda: self._take_vec("compare_set"))

    def check(self, keys: Sequence[str]) -> bool:
        return self._call("check", bytes([CHECK]) + _Q.pack(len(keys)) + b"".join(_key(k) for k in keys),
                          lambda: self._take(1, "check")[0] == READY)

    def get_now(self, key: str) -> bytes:
        """The value of `key`, b"" when it does not exist (no wait)."""
        return self._call("get", bytes([GET]) + _key(key), lambda: self._take_vec("get"))

    def multi_get_now(self, keys: Sequence[str]) -> List[bytes]:
        """The values of `keys`, b"" for those that do not exist (no wait)."""
        if not keys:
            return []
        return self._call("multi_get", bytes([MULTI_GET]) + _Q.pack(len(keys)) + b"".join(_key(k) for k in keys),
                          lambda: [self._take_vec("multi_get") for _ in keys])

    def join_step(self, append_key: str, record, add_key: str, get_key: str) -> tuple:
        """append(append_key, record), add(add_key, 1), get_now(get_key) in one round trip:
        (the added counter, the value, b"" when missing). The round protocol's join."""
        request = (bytes([APPEND]) + _key(append_key) + _vec(record) + bytes([ADD]) + _key(add_key) + _q.pack(1)
                   + bytes([GET]) + _key(get_key))
        return self._call("join_step", request,
                          lambda: (_q.unpack(self._take(8, "add"))[0], self._take_vec("get")))

    def get(self, key: str, timeout: Optional[float] = None) -> bytes:
        """torch's `get`: waits for the key (up to `timeout` s, else the client's default_timeout;
        StoreTimeout), then reads it."""
        self.wait([key], self.default_timeout if timeout is None else timeout)
        return self.get_now(key)

    def multi_get(self, keys: Sequence[str], timeout: Optional[float] = None) -> List[bytes]:
        if keys:
            self.wait(list(keys), self.default_timeout if timeout is None else timeout)
        return self.multi_get_now(keys)

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete_key", bytes([DELETE_KEY]) + _key(key),
                               lambda: _q.unpack(self._take(8, "delete_key"))[0]))

    def num_keys(self) -> int:
        return self._call("num_keys", bytes([GETNUMKEYS]), lambda: _q.unpack(self._take(8, "num_keys"))[0])

    def ping(self) -> float:
        """One round trip; its seconds."""
        start = time.monotonic()
        nonce = self._next_nonce()

        def read():
            if self._take(4, "ping") != nonce:
                raise self._lost("the store echoed a wrong nonce", "dead")
        self._call("ping", bytes([PING]) + nonce, read)
        return time.monotonic() - start

    def wait(self, keys: Sequence[str], timeout=None, tick: Optional[Callable[[], None]] = None) -> None:
        """Block until every key in `keys` exists: one WAIT request, answered by the store when
        they do. StoreTimeout after `timeout` s (None: no limit; the wait is then cancelled);
        PINGs every `ping_every` s learn whether the store still answers. `tick()` is called
        between the local slices (a line to say), without any store traffic."""
        limit = None if timeout is None else _seconds(timeout)
        request = bytes([WAIT]) + _Q.pack(len(keys)) + b"".join(_key(k) for k in keys)
        with self._lock:
            self._check_usable()
            self._settle_owed()
            self._drain_pings("wait")
            self._send(request, "wait")
            nbytes = len(request) + 1
            start = time.monotonic()
            self._tick = tick
            try:
                try:
                    event = self._next_event(start, limit)
                except StoreUnreachable:
                    raise
                except BaseException:   # a signal (stop) while waiting: leave the connection clean
                    self._quiet_cancel()
                    raise
                if event == "timeout":
                    nbytes += 1
                    if not self._cancel():
                        raise StoreTimeout(f"wait for {list(keys)[:3]} timed out after {limit:g}s")
                self._drain_pings("wait")
            finally:
                self._tick = None
                self._count_msg("wait", nbytes)

    def _quiet_cancel(self) -> None:
        """Cancel the outstanding WAIT without asking `stop` (it just raised)."""
        stop, self.stop = self.stop, None
        try:
            self._cancel()
            self._drain_pings("wait")
        except StoreUnreachable:
            pass
        finally:
            self.stop = stop

    def _next_event(self, start: float, limit: Optional[float]) -> str:
        """During a wait: 'stop' (the keys exist), 'timeout', after echoes of our PINGs."""
        while True:
            while self._buf:
                first = self._buf[0]
                if first == STOP_WAITING:
                    del self._buf[:1]
                    return "stop"
                if first == PONG_MARK:
                    if len(self._buf) < 4:
                        break
                    del self._buf[:4]
                    if self._pings:
                        self._pings.pop(0)
                    continue
                raise self._lost(f"unexpected byte {first} from the store during a wait", "dead")
            now = time.monotonic()
            if limit is not None and now - start >= limit:
                return "timeout"
            if self.stop is not None:
                self.stop()
            if self._tick is not None:
                self._tick()
            if self._pings and now - self._pings[0] > self.unresponsive and not self._fill(0, "wait"):
                raise self._lost(f"the store has not answered for {now - self._pings[0]:.0f}s (its host still "
                                 f"holds the connection: a paused or hung store)", "unresponsive")
            if self._pings and now - self._pings[0] > self.ping_every and not self._said_slow and self.say:
                self._said_slow = True
                self.say(f"the rendezvous store at {self.host}:{self.port} has not answered for "
                         f"{now - self._pings[0]:.0f}s; its host holds the connection (alive: busy or paused): "
                         f"waiting up to {self.unresponsive:g}s")
            if not self._pings and now - self.last_heard >= self.ping_every:
                self._ping_async()
            span = SLICE if limit is None else min(SLICE, max(0.001, start + limit - now))
            self._fill(span, "wait")

    def _ping_async(self) -> None:
        self._pings.append(time.monotonic())
        if self._expect:
            self._expect.append("pong")
        self._send(bytes([PING]) + self._next_nonce(), "ping")
        self._count_msg("ping", 5)

    def _cancel(self) -> bool:
        """Cancel the outstanding WAIT; True when the keys came first (the wait succeeded)."""
        self._send(bytes([CANCEL_WAIT]), "cancel_wait")
        came = False
        while True:
            self._need(1, "cancel_wait")
            first = self._buf[0]
            if first == STOP_WAITING:
                del self._buf[:1]
                came = True
            elif first == WAIT_CANCELED:
                del self._buf[:1]
                return came
            elif first == PONG_MARK:
                self._need(4, "cancel_wait")
                del self._buf[:4]
                if self._pings:
                    self._pings.pop(0)
            else:
                raise self._lost(f"unexpected byte {first} from the store", "dead")

    # ---- asynchronous use (one event loop watches many connections: RoundWatcher) ----------
    def begin_wait(self, keys: Sequence[str]) -> None:
        """Send a WAIT and return; `events()` reports its end. The connection takes no other
        call until then, except `ping_async`."""
        with self._lock:
            self._check_usable()
            self._settle_owed()
            self._drain_pings("wait")
            request = bytes([WAIT]) + _Q.pack(len(keys)) + b"".join(_key(k) for k in keys)
            self._send(request, "wait")
            self._count_msg("wait", len(request) + 1)
            self._waiting = True

    def cancel_async_wait(self) -> None:
        """End the WAIT sent by `begin_wait` that has not ended yet (blocking, bounded by the
        unresponsive limit)."""
        with self._lock:
            self._check_usable()
            if self._waiting:
                self._waiting = False
                stop, self.stop = self.stop, None
                try:
                    self._cancel()
                finally:
                    self.stop = stop
                self._count_msg("cancel_wait", 2)

    def ping_async(self) -> None:
        """Send a PING without waiting for its echo (`events()` consumes it)."""
        with self._lock:
            self._check_usable()
            self._ping_async()

    def get_async(self, key: str) -> None:
        """Send a GET without waiting for its answer: `events()` returns ("value", bytes) for it.
        Not while a WAIT is outstanding."""
        with self._lock:
            self._check_usable()
            if self._waiting:
                raise StoreError("a wait is outstanding on this connection")
            self._settle_owed()
            request = bytes([GET]) + _key(key)
            self._send(request, "get")
            self._count_msg("get", len(request))
            self._expect.append("get")

    def events(self) -> list:
        """Read what is there (non-blocking) and return the events: "stop" (the outstanding wait
        ended), "pong", ("value", bytes) for a `get_async`. StoreUnreachable when the connection
        is dead or gone."""
        out: list = []
        with self._lock:
            self._check_usable()
            self._fill(0, "wait")
            while self._buf:
                first = self._buf[0]
                if first == STOP_WAITING and self._waiting:
                    del self._buf[:1]
                    self._waiting = False
                    out.append("stop")
                elif self._expect and self._expect[0] == "get":
                    if len(self._buf) < 8:
                        break
                    size = _Q.unpack(bytes(self._buf[:8]))[0]
                    if len(self._buf) < 8 + size:
                        break
                    value = bytes(self._buf[8:8 + size])
                    del self._buf[:8 + size]
                    self._expect.pop(0)
                    self._count_msg("get", 8 + size)
                    out.append(("value", value))
                elif first == PONG_MARK and len(self._buf) >= 4:
                    del self._buf[:4]
                    if self._pings:
                        self._pings.pop(0)
                    if self._expect and self._expect[0] == "pong":
                        self._expect.pop(0)
                    out.append("pong")
                elif first == PONG_MARK:
                    break
                else:
                    raise self._lost(f"unexpected byte {first} from the store", "dead")
        return out

    @property
    def oldest_ping(self) -> Optional[float]:
        """When the oldest PING still unanswered was sent, or None."""
        return self._pings[0] if self._pings else None

    @property
    def waiting(self) -> bool:
        return self._waiting


def _is_loopback(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    import ipaddress
    for *_, addr in infos:
        try:
            if not ipaddress.ip_address(addr[0]).is_loopback:
                return False
        except ValueError:
            return False
    return bool(infos)
