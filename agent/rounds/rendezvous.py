"""Rendezvous: the round protocol the agents run on the job's store.

The store is torch's `TCPStore` (libuv backend), hosted by one agent at the rendezvous endpoint and
reached by every agent through its own client (agent.rounds.job_store: hosting, connecting, waits
that a signal ends). All keys live under `ft/<run_id>/`. A *round* is one training cycle; what it
costs the store host is O(N) bytes in all (O(1) per agent). Every key, its shape, writer and
readers, and what a store failover does with it, is declared in agent.rounds.store_keys; a round's are `r<R>/...`: the joiners' records and sequence numbers
(`records`, `joined`), the closer's assignments (`closed`, `at/<node>`, `info`, `members`,
`assigned`), late joiners (`late`, `nlate`), the workers' store, the round's end (`interrupt`,
`verdict`, `origin`, `target`, `expect`) and its barriers (`done`, `left`).

Joining: an agent appends its record, adds 1 to `joined` (one round trip: append has no answer)
and, when its number completes the round (the maximum, or the target of a restart round), closes
it: it reads the records once, orders them, and publishes every assignment in one multi_set. The
joiner that brings the round to its minimum keeps the last-call timer (`--nnodes MIN:MAX`). Each
agent's watcher holds one WAIT on `r<R>/interrupt` while the round runs.
Everybody else blocks on `r<R>/assigned`: no polling. A waiting agent says every PROGRESS_EVERY s
who joined (in a job of more than NAMES_UP_TO nodes, only the first joiner reads that; the others
make no store call while they wait but a PING every ping_every s), and the first joiner of a
restart round checks then whether a node it waits for is still alive (agent.rounds.keepalive).

Ranks are assigned in infrastructure order (SLURM_PROCID / node rank / GROUP_RANK when known,
then the order agents first reached the store, kept for the job's life), never purely by who
joined first. With `--nnodes MIN:MAX`, the first MIN nodes in that order train and the others
wait as hot spares for the next round.

Every wait asks the agent's `stop` callable between local slices (agent.rounds.job_store), so a
signal ends any wait within a second with `Stopped`. A signal while a round is being joined is
written to that round as a shutdown: the other joiners stop too.

A lost store host (agent.rounds.store_client tells dead, gone and unresponsive from slow) is
noticed by the RoundWatcher (agent.rounds.round_watcher) or by any store call;
agent.rounds.store_failover takes it from there.

With FT_LAUNCHER_STORE_STATS=<dir> every store call is counted (calls and bytes per method and
per connection) and written to <dir>/<pid>.json at exit (bench/rendezvous_scale.py).
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import os
import secrets
import time
from typing import Callable, Dict, List, Optional, Tuple

from ft_launcher.agent.rounds import segments, store_client, store_keys
from ft_launcher.agent.rounds.elastic import Elastic
from ft_launcher.agent.rounds.job_store import JobStore
from ft_launcher.agent.rounds.keepalive import Misses
from ft_launcher.agent.rounds.store_client import StoreClient, StoreTimeout, StoreUnreachable
from ft_launcher.agent.launch_config import LaunchConfig
from ft_launcher.agent.rounds.round_types import (HEAD, NodeInfo, NoRestart, RendezvousError, Round, Stopped,
                                                  StoreLost, StoreReplaced, Verdict)

PROGRESS_EVERY = 5.0  # seconds between "still waiting for ..." lines
WATCHED_PEERS = 2     # nodes each agent watches: the next ones in the round's order
ELASTIC_LOOK = 0.1    # seconds between looks at the missing nodes of an elastic restart round
NAMES_UP_TO = 32      # a "waiting for nodes" line names the nodes while no more have joined


def _record(node: NodeInfo) -> str:
    return json.dumps(dataclasses.asdict(node), separators=(",", ":"))


def _node(data) -> NodeInfo:
    if isinstance(data, (bytes, str)):
        data = json.loads(data)
    names = {f.name for f in dataclasses.fields(NodeInfo)}
    return NodeInfo(**{k: v for k, v in data.items() if k in names})


def order(nodes: List[NodeInfo]) -> List[NodeInfo]:
    """Infrastructure order: order key, then the order agents first reached the store."""
    return sorted(nodes, key=lambda n: (n.order_key is None, n.order_key or 0, n.stable))


def _lines(raw: bytes) -> List[NodeInfo]:
    """The records of a blob of JSON lines, the first of each node id kept."""
    out: Dict[str, NodeInfo] = {}
    for line in raw.decode().splitlines():
        if line.strip():
            node = _node(line)
            out.setdefault(node.node_id, node)
    return list(out.values())


class RoundProtocol:
    """One agent's side of the round protocol (see the module docstring)."""

    def __init__(self, store: JobStore, cfg: LaunchConfig, me: NodeInfo):
        self.store = store
        self.cfg = cfg
        self.elastic_rules = Elastic.of(cfg)   # --nnodes MIN:MAX and --elastic (agent.rounds.elastic)
        self.me = me
        self._last_call = cfg.conf("last_call_timeout")
        # why too few nodes can remain once `excluded` have left, or None: the restart policy's,
        # set by the round's end (agent.recovery.round_end); a joiner asks it
        self.too_few_left: Callable[[int], Optional[str]] = lambda excluded: None
        self.token = secrets.token_hex(8)   # this agent, in the interrupts it writes
        self._members: tuple = (None, None)   # (round, its member lists) once read
        self._misses: tuple = (None, None)    # (round, Misses of its missing nodes) once probed
        if not me.stable:
            me.stable = self._call(self.s.add, self.k(store_keys.agents()), 1)

    @property
    def s(self) -> StoreClient:
        """The store's client: a failover swaps the store under this protocol (JobStore.adopt)."""
        return self.store.client

    def k(self, name: str) -> str:
        return self.store.key(name)

    def _call(self, fn, *args):
        if self.store.replaced:
            raise StoreReplaced(self.store.replaced)
        try:
            return fn(*args)
        except StoreUnreachable as exc:
            raise StoreLost(f"lost the rendezvous store at {self.store.host}:{self.store.port} ({exc})") from None

    # -- plain job-wide values (under the run's prefix) --------------------------------------
    def put(self, name: str, value: str) -> None:
        self._call(self.s.set, self.k(name), value)

    def get(self, name: str) -> str:
        try:
            return self._call(self.s.get, self.k(name), self.cfg.conf("read_timeout")).decode()
        except StoreTimeout:
            raise RendezvousError(f"the store has no {name!r} after read_timeout="
                                  f"{self.cfg.conf('read_timeout'):g}s") from None

    def get_raw(self, names: List[str]) -> List[bytes]:
        """The values of `names` as stored, b"" for those that do not exist (one read)."""
        return self._call(self.s.multi_get_now, [self.k(n) for n in names]) if names else []

    def put_raw(self, names: List[str], values: List[bytes]) -> None:
        """Set every name to its value (one write)."""
        if names:
            self._call(self.s.multi_set, [self.k(n) for n in names], values)

    def get_many(self, names: List[str]) -> List[str]:
        return [v.decode() for v in self._call(self.s.multi_get_now, [self.k(n) for n in names])] if names else []

    def exists(self, name: str) -> bool:
        return bool(self._call(self.s.check, [self.k(name)]))

    def count(self, name: str, increment: int = 0) -> int:
        return int(self._call(self.s.add, self.k(name), increment))

    def current_round(self) -> int:
        value = self._call(self.s.compare_set, self.k(store_keys.next_round()), "", "0")
        return int(value)

    # -- joining -----------------------------------------------------------------------------
    def join(self, number: int, target: Optional[int] = None) -> Round:
        """Join round `number`; returns once it is closed and this agent knows its place.
        `target`: how many nodes a restart round expects back (a failover's survivors); else the
        target the verdict of the previous round left in the store, if any."""
        try:
            return self._join(number, target)
        except Stopped as exc:   # our signal anywhere in the join (its first call included) stops the others too
            if not exc.by_peer:
                self.abandon(number, exc.signum)
            raise

    def _join(self, number: int, target: Optional[int]) -> Round:
        me = dataclasses.replace(self.me)
        me.seq, raw = self._call(self.s.join_step, self.k(store_keys.records(number)), _record(me) + "\n",
                                 self.k(store_keys.joined(number)), self.k(store_keys.target(number)))   # one round trip
        _mark("joined_at")
        if target is None:
            target = int(raw) if raw else None
        need = self.needed_nodes
        start = time.monotonic()
        timer = None   # the last-call deadline, kept by the joiner that brought the round to its minimum
        # --elastic, a restart round: the nodes still missing are looked at every ELASTIC_LOOK s (dead,
        # agent.rounds.keepalive.Misses: refused, or unanswered over a window: the round closes on
        # those there, at once; too few left: one line, exit 1)
        elastic = self.elastic_rules.closes_on_the_living(target)
        if me.seq >= self.cfg.max_nodes or (target and me.seq >= max(target, need)):
            self._close(number, me.seq)
        elif elastic and self._elastic_close_due(number, me.seq, target):
            self._close(number, me.seq)
        elif me.seq == need:
            timer = start + self._last_call
        next_progress = start + 1.0  # the first line soon, then every PROGRESS_EVERY s
        join_timeout = self.cfg.conf("join_timeout")
        assigned = self.k(store_keys.assigned(number))
        closed_seen = False
        # at scale only the first joiner reads who joined for its lines; the others say theirs
        # between the slices of one wait, without a store call
        reads = self.cfg.max_nodes <= NAMES_UP_TO or me.seq == 1
        said = [start + 1.0]

        def line() -> None:
            now = time.monotonic()
            if now >= said[0]:
                said[0] = now + PROGRESS_EVERY
                self.store.say(f"rendezvous round {number}: waiting for nodes: joined as node {me.seq} of "
                               f"{self.cfg.min_nodes} needed [{now - start:.0f}s of join_timeout {join_timeout:g}s]")
        next_look = start + ELASTIC_LOOK
        while True:
            deadline = min(next_progress if reads else float("inf"), start + join_timeout, timer or float("inf"),
                           next_look if elastic else float("inf"))
            try:
                self._call(self.s.wait, [assigned], max(0.0, deadline - time.monotonic()), None if reads else line)
                break
            except StoreTimeout:
                pass
            now = time.monotonic()
            if elastic and now >= next_look:
                next_look = now + ELASTIC_LOOK
                joined = self._call(self.s.add, self.k(store_keys.joined(number)), 0)
                if self._elastic_close_due(number, joined, target):
                    self._close(number, joined)
                    continue
            if timer is not None and now >= timer:
                timer = None
                self._close(number, self._call(self.s.add, self.k(store_keys.joined(number)), 0))
                continue
            if reads and now >= next_progress:
                next_progress = now + PROGRESS_EVERY
                joined = self._call(self.s.add, self.k(store_keys.joined(number)), 0)
                self._check_join_stop(number)
                if self._call(self.s.check, [self.k(store_keys.closed(number))]):
                    if closed_seen:   # closed a tick ago and still not published: its closer died
                        self._publish(number)
                        continue
                    closed_seen = True
                self.store.say(self._join_progress(number, joined, target, now - start))
                if self._late_close_due(number, me.seq, joined, target, now - start):
                    self._close(number, joined)
                    continue
            if now - start > join_timeout:
                joined = self._call(self.s.add, self.k(store_keys.joined(number)), 0)
                nodes = self._records(number) if joined <= NAMES_UP_TO else []
                names = f" ({', '.join(n.label() for n in nodes)})" if nodes else ""
                raise RendezvousError(
                    f"rendezvous round {number} timed out after {join_timeout:g}s: "
                    f"{joined} of {self.cfg.min_nodes} needed nodes joined{names}; "
                    f"{self.cfg.min_nodes - joined} missing")
        return self._my_round(number, me)

    def _elastic_close_due(self, number: int, joined: int, target: int) -> bool:
        """--elastic, restart round `number` (expecting `target` nodes back) with `joined` in: True when
        at least the minimum joined and every node still missing is dead (the round goes on without
        them, at once); raises RendezvousError (exit 1) when the nodes alive are fewer than the
        minimum (--nnodes MIN): the job cannot go on."""
        expected = self._expected(number)
        if not expected:
            return False
        alive = self._alive(number, expected)
        need = self.needed_nodes
        if alive < need:
            self.abandon_with(number, {"kind": "stop", "what": f"too few nodes left: {alive} of the {need} needed"})
            raise RendezvousError(self.elastic_rules.too_few_to_go_on(alive, need))
        return joined >= need and alive <= joined

    def _late_close_due(self, number: int, seq: int, joined: int, target: Optional[int], waited: float) -> bool:
        """A round that nobody closed in time: the first joiner of a restart round finds that
        the nodes still missing are dead; or the minimum is there and the last-call timer's
        keeper is gone (any agent, after twice the last call)."""
        if joined < self.needed_nodes:
            return False
        expected = self._expected(number) if target and seq == 1 and joined < target else []
        if expected:
            return self._alive(number, expected) <= joined
        return waited > 2 * self._last_call + PROGRESS_EVERY

    def _alive(self, number: int, expected: List[NodeInfo]) -> int:
        """How many of the nodes restart round `number` expects are alive: those that joined, and
        those still missing that are not gone (agent.rounds.keepalive.Misses: a refused connect
        to their liveness port, or silent probes over a window; one slow answer is not enough)."""
        if self._misses[0] != number:
            self._misses = (number, Misses.of(self.cfg))
        misses = self._misses[1]
        joined = {n.node_id for n in self._records(number)}
        return len(expected) - sum(1 for n in expected if n.node_id not in joined and misses.gone(n.host, n.alive_port))

    def _expected(self, number: int) -> List[NodeInfo]:
        raw = self._call(self.s.get_now, self.k(store_keys.expect(number)))
        return [_node(d) for d in json.loads(raw)] if raw else []

    def _close(self, number: int, count: int) -> bool:
        """Close round `number` with `count` joiners (first closer wins) and publish every
        assignment. True when this agent closed it."""
        mine = f"{count}:{self.token}"
        if self._call(self.s.compare_set, self.k(store_keys.closed(number)), "", mine).decode() != mine:
            return False
        self._publish(number)
        return True

    def _publish(self, number: int) -> None:
        """Every assignment of closed round `number`, then `assigned` (idempotent: a closer that
        died before publishing is stood in for by whoever notices, from the same records)."""
        nodes = order(self._records(number))
        train = self.training_nodes
        active, spares = nodes[:train], nodes[train:]
        if self.cfg.ft.segment:   # whole NVLink-domain segments train (agent.rounds.segments)
            chosen = segments.split(nodes, train, self.cfg.ft.segment)
            if chosen is None:
                self.abandon_with(number, {"kind": "stop", "what": f"rendezvous round {number}: segment "
                                           f"{self.cfg.ft.segment}: " + segments.shortfall(nodes, train,
                                                                                            self.cfg.ft.segment)})
                return
            active, spares = chosen
        members = active + spares
        records = [dataclasses.asdict(n) for n in members]
        keys, values = [], []
        offset = 0
        for i, node in enumerate(members):
            peers = [records[(i + step) % len(members)] for step in range(1, min(WATCHED_PEERS, len(members) - 1) + 1)]
            place = {"g": i if i < len(active) else None, "o": offset, "p": peers}
            if i < len(active):
                offset += node.nproc
            keys.append(self.k(store_keys.place(number, node.node_id)))
            values.append(json.dumps(place, separators=(",", ":")))
        info = {"world": sum(n.nproc for n in active), "nnodes": len(active), "nspares": len(spares),
                "head": records[:HEAD]}
        keys += [self.k(store_keys.info(number)), self.k(store_keys.members(number))]
        values += [json.dumps(info, separators=(",", ":")),
                   json.dumps({"active": records[:len(active)], "spares": records[len(active):]}, separators=(",", ":"))]
        self._call(self.s.multi_set, keys, values)
        self._call(self.s.set, self.k(store_keys.assigned(number)), "ok")

    def abandon_with(self, number: int, reason: dict) -> None:
        """End round `number` before it trains: `reason` as its interrupt and verdict, and the
        joiners woken."""
        if self.claim_interrupt(number, reason) is not None:
            verdict = Verdict.from_report(reason)   # a shutdown or a stop: no decision to make
            verdict.next_round = number + 1
            self._call(self.s.set, self.k(store_keys.verdict(number)), verdict.to_json())
        self._call(self.s.set, self.k(store_keys.assigned(number)), "abandoned")

    def _my_round(self, number: int, me: NodeInfo) -> Round:
        """This agent's place in closed round `number`: one read of its assignment and the shape."""
        state, place, info = self._call(self.s.multi_get_now, [self.k(store_keys.assigned(number)),
                                                               self.k(store_keys.place(number, me.node_id)),
                                                               self.k(store_keys.info(number))])
        if state == b"abandoned":
            self._check_join_stop(number)
            raise RendezvousError(f"rendezvous round {number} was abandoned")
        info = json.loads(info)
        head = [_node(d) for d in info["head"]]

        def loader() -> Tuple[List[NodeInfo], List[NodeInfo]]:
            return self.members(number)

        if not place:   # joined after the round closed: a spare until the next round; the others hear of it
            self._call(self.s.append, self.k(store_keys.late(number)), _record(me) + "\n")
            self._call(self.s.add, self.k(store_keys.nlate(number)), 1)   # the head's watchers hear of it
            rnd = Round.assigned(number, me, None, 0, info["world"], info["nnodes"], info["nspares"],
                                 head[:WATCHED_PEERS], head, loader)
            rnd.late = True
        else:
            place = json.loads(place)
            rnd = Round.assigned(number, me, place["g"], place["o"], info["world"], info["nnodes"], info["nspares"],
                                 [_node(d) for d in place["p"]], head, loader)
        _mark("round_known_at")
        return rnd

    def members(self, number: int) -> Tuple[List[NodeInfo], List[NodeInfo]]:
        """Round `number`'s trainers and spares, in order (O(N): where a part needs the list; read
        once per round)."""
        if self._members[0] != number:
            # published before anyone knows its place
            raw = self._call(self.s.get_now, self.k(store_keys.members(number)))
            if not raw:
                raise RendezvousError(f"round {number} has no member list in the store")
            data = json.loads(raw)
            self._members = (number, ([_node(d) for d in data["active"]], [_node(d) for d in data["spares"]]))
        active, spares = self._members[1]
        return list(active), list(spares)

    def late_joiners(self, number: int) -> List[NodeInfo]:
        return _lines(self._call(self.s.get_now, self.k(store_keys.late(number))))

    def _records(self, number: int) -> List[NodeInfo]:
        return _lines(self._call(self.s.get_now, self.k(store_keys.records(number))))

    def _nodes(self, number: int, count: int = 0) -> List[NodeInfo]:
        """The nodes that joined round `number` (agent.recovery.no_restart)."""
        return self._records(number)

    @property
    def training_nodes(self) -> int:
        """How many nodes train in a round (the first in order); the others wait as hot spares.
        `--nnodes MIN:MAX`: MIN; with active_world_size: that many ranks' worth of nodes, the rest
        of the job's nodes being warm reserve nodes; --elastic: up to MAX."""
        fixed = min(self.cfg.active_nodes, self.cfg.min_nodes) if self.cfg.active_nodes else self.cfg.min_nodes
        return self.elastic_rules.trainers(fixed)

    @property
    def needed_nodes(self) -> int:
        """How many nodes a round needs before it may close: the training nodes, or with --elastic
        MIN (a round closes on fewer than MAX after the last call, or once the missing are dead)."""
        return self.elastic_rules.needed(self.training_nodes)

    def _check_join_stop(self, number: int) -> None:
        """Stopped if another joiner's signal abandoned the round; NoRestart if too few nodes can remain."""
        short = self.too_few_left(self.count(store_keys.excluded()))
        if short:
            raise NoRestart(f"the job cannot go on: {short}")
        if self._call(self.s.check, [self.k(store_keys.interrupt(number))]):
            verdict = self.verdict(number)
            if verdict.kind == "shutdown":
                self.mark_left(number)
                raise Stopped(int(verdict.signal or 15), by_peer=True)
            if verdict.kind == "stop":
                raise RendezvousError(verdict.what)

    def abandon(self, number: int, sig: int) -> None:
        """Stop joining round `number`: record a shutdown there so that the other joiners stop
        too; if this agent hosts the store, keep it up (at most 1 s) until they have read it."""
        reason = {"kind": "shutdown", "signal": sig, "node_id": self.me.node_id}
        try:   # a fresh connection: the signal ended a wait on the old one, whose state is suspect
            fresh = self.store.new_client("main", within=5.0, stop=False)
        except RendezvousError:
            fresh = None
        if fresh is not None:
            self.store.client.close()
            self.store.client = fresh
        client = self.s
        stop, client.stop = client.stop, None   # the signal being acted on ends none of these calls
        try:
            self.abandon_with(number, reason)
            self.mark_left(number)
            self.store.linger(lambda: self.left_count(number) >= self.count(store_keys.joined(number)), 1.0)
        except (RendezvousError, Stopped):
            pass
        finally:
            client.stop = stop

    def _join_progress(self, number: int, joined: int, target: Optional[int], waited: float) -> str:
        """One line: who joined round `number`, who is missing, how long it has waited (the
        names while few have joined: reading them is O(N))."""
        nodes = self._records(number) if joined <= NAMES_UP_TO else []
        need = self.cfg.min_nodes
        missing = ""
        expected = self._expected(number) if target and joined <= NAMES_UP_TO else []
        if expected:
            ids = {n.node_id for n in nodes}
            gone = [n.label() for n in expected if n.node_id not in ids]
            missing = f"; missing: {', '.join(gone)}" if gone else ""
        elif nodes and all(n.order_key is not None for n in nodes):
            have = {n.order_key for n in nodes}
            absent = [str(i) for i in range(need) if i not in have]
            missing = f"; missing: node rank {', '.join(absent)}" if absent else ""
        if not missing and joined < need:
            missing = f"; {need - joined} more needed"
        if not missing and target and joined < target:
            missing = f"; {target - joined} more expected back"
        names = f" ({', '.join(n.label() for n in nodes)})" if nodes else ""
        return (f"rendezvous round {number}: waiting for nodes: {joined} of {need} joined{names}{missing} "
                f"[{waited:.0f}s of join_timeout {self.cfg.conf('join_timeout'):g}s]")

    # -- the workers' store address --------------------------------------------------------
    def publish_worker_store(self, number: int, addr: str, port: int) -> None:
        self._call(self.s.set, self.k(store_keys.worker_store(number)), f"{addr}:{port}")

    def worker_store(self, number: int) -> tuple:
        key = self.k(store_keys.worker_store(number))
        if not self.store.wait_key(self.s, key, self.cfg.conf("read_timeout")):
            raise RendezvousError(f"round {number}: node 0 never published the workers' store")
        host, _, port = self._call(self.s.get_now, key).decode().rpartition(":")
        return host, int(port)

    # -- ending a round (the decision: agent.recovery.round_end) ----------------------------
    def claim_interrupt(self, number: int, reason: dict) -> Optional[dict]:
        """Report the end of round `number` (compare-and-set on its interrupt: the first report
        wins); the report as written when this one won, else None. The reporter's token makes the
        text unique: two agents with the same report (the same silent peer) must not both win."""
        report = dict(reason, reporter=self.token)
        text = json.dumps(report, sort_keys=True)
        won = self._call(self.s.compare_set, self.k(store_keys.interrupt(number)), "", text).decode() == text
        return report if won else None

    def declare_restartable(self, number: int) -> None:
        """This node's ranks all run under ft.restartable in round `number` (once per node)."""
        self.count(store_keys.restartable(number), 1)

    def verdict(self, number: int) -> Verdict:
        """The verdict of interrupted round `number`. Its decider writes it just after winning
        the interrupt; if that node dies in between, the wait ends after close_timeout with one
        line naming it (RendezvousError: exit 1)."""
        key = self.k(store_keys.verdict(number))
        timeout = self.cfg.conf("close_timeout")
        known = self._call(self.s.get_now, key)   # there already, when the interrupt woke us
        if known:
            return Verdict.from_json(known)
        if not self.store.wait_key(self.s, key, timeout):
            try:
                who = json.loads(self._call(self.s.get_now, self.k(store_keys.interrupt(number)))).get("node_id") \
                    or "another node"
            except (RendezvousError, ValueError, AttributeError):
                who = "another node"
            raise RendezvousError(
                f"round {number} was interrupted by {who}, but its verdict did not come within "
                f"close_timeout={timeout:g}s (the deciding node died before writing it?) -> exiting 1")
        return Verdict.from_json(self._call(self.s.get_now, key))

    def interrupted(self, number: int) -> bool:
        return bool(self._call(self.s.check, [self.k(store_keys.interrupt(number))]))

    def claim_fault(self) -> int:
        """Count one more simulated fault for the job; returns the new total."""
        return self.count(store_keys.faults_fired(), 1)

    def faults_fired(self) -> int:
        return self.count(store_keys.faults_fired())

    def restarts_used(self) -> int:
        return self.count(store_keys.restarts_used())

    def mark_done(self, number: int) -> int:
        return self.count(store_keys.done(number), 1)

    def mark_left(self, number: int) -> int:
        return self.count(store_keys.left(number), 1)

    def left_count(self, number: int) -> int:
        return self.count(store_keys.left(number))


# ---- optional call counting (bench/rendezvous_scale.py) ---------------------------------------
_STATS_DIR = os.environ.get("FT_LAUNCHER_STORE_STATS")
_MARKS: Dict[str, float] = {}


def mark(name: str, when: Optional[float] = None) -> None:
    """Remember when `name` first happened in this agent (only with FT_LAUNCHER_STORE_STATS)."""
    if _STATS_DIR:
        _MARKS.setdefault(name, time.time() if when is None else when)


_mark = mark


def _write_stats() -> None:
    _MARKS["exit_at"] = time.time()
    try:
        os.makedirs(_STATS_DIR, exist_ok=True)
        with open(os.path.join(_STATS_DIR, f"{os.getpid()}.json"), "w") as fh:
            json.dump({"calls": store_client.STATS, "marks": _MARKS}, fh)
    except OSError:
        pass


if _STATS_DIR:
    store_client.counting(True)
    atexit.register(_write_stats)
