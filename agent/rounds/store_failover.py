"""Store failover: the job outlives the node that hosts its store.

Every agent remembers, refreshed at each round it joins, what the job needs to go on without the
store: the head of the round's member order (trainers, then spares: the store host and the next
HEAD - 1 nodes, agent.rounds.round_types) and how many members the round had, the nodes that
joined it late, the round number, the restarts used, the simulated faults fired, the version of
the computed timeouts and the store's generation. The nodes at the head also keep the whole member
list, and read, in one call, the policy's history as it stands when the round begins: every key
agent.rounds.store_keys marks CARRIED (the computed timeouts, the nodes excluded, the stragglers,
the recent rounds' interrupts, origins and progress, and the last round with progress).

When the store is lost (RoundWatcher, or any store call failing), every survivor computes alone,
from that memory, the same list of successors: the head of the last round's order and its late
joiners, without the lost host. Candidate k hosts generation g+1+k of the store, where g is the lost
store's generation, on port rdzv_port + g+1+k of its own address. So a job whose rendezvous
port is P uses P, then P+1 after the first failover, P+2 after a second (or when the first
successor is unreachable): open P to P+F on every node, F the failovers to survive.

Each survivor goes down the list: the candidate that is itself hosts at once; any other it tries
to reach until (k + 1) x reach_within seconds after it saw the loss, k the candidate's place, then
takes the next one. The deadlines are the same for every survivor however fast it came down the
list: a candidate that cannot host (its port taken) moves on at once, and still waits for the next
candidate as long as that one waits for it. The successor seeds the
new store (round, restarts used + 1, faults fired, timeouts version, generation: the SEEDED keys),
writes the history it read (the CARRIED keys); the round's end (agent.recovery.round_end, which
the agent hands this failover) ends the lost round there as a store loss (its `interrupt`: the
same-error rule of the restart policy passes over it, the no-progress rule counts it like any
round without progress), and each survivor adds its own progress in that round. What was
written after the round began and is not one survivor's own (a straggler marked, a node excluded
during the lost round) is lost with the store. Everybody joins the
next round there, expecting the other survivors: the round closes as soon as they are all back,
the spares take the lost node's place, and the ranks restart from their checkpoint. When fewer
survivors remain than --nnodes MIN, or the failover would exceed the restart budget, every
survivor ends at once with one line and exit 1, without waiting for a store.

Split brain: a store host that was unreachable (paused, cut off) and comes back finds its peers
silent; before it acts on that, `find_successor` probes the successors' ports for a store of
this job that has already taken over (its first round closed there). If there is one, the old
host stops its ranks and exits 1: two stores never both run the job.
"""
from __future__ import annotations

import dataclasses
import json
import socket
import time
from typing import Callable, Dict, List, Optional, Tuple

from ft_launcher.agent.launch_config import LaunchConfig
from ft_launcher.agent.rounds import store_keys
from ft_launcher.agent.rounds.job_store import JobStore, gone_after, host_store
from ft_launcher.agent.rounds.rendezvous import RoundProtocol
from ft_launcher.agent.rounds.round_types import NodeInfo, Round, StoreLost, StoreReplaced
from ft_launcher.agent.rounds.store_client import StoreClient, StoreError

FENCE_PROBES = 4  # successors a returning host probes for a store that took over


def reach_within(cfg: LaunchConfig) -> float:
    """Seconds a survivor tries one candidate before it falls back to the next: the time every
    survivor needs to notice the loss (a paused host: the keep-alive limit) and a margin."""
    return cfg.conf("keep_alive_interval") * (cfg.conf("keep_alive_max_attempt") + 1) + 2.0


@dataclasses.dataclass
class JobMemory:
    """What this agent knows of the job, refreshed at each round it joins."""
    round: Optional[Round] = None
    late: List[NodeInfo] = dataclasses.field(default_factory=list)  # joined after it closed (RoundWatcher)
    generation: int = 0
    restarts_used: int = 0
    faults_fired: int = 0
    timeouts_version: int = 0
    everyone: List[NodeInfo] = dataclasses.field(default_factory=list)  # all members: kept at the head only
    # the policy's history as it stood when the round began (store_keys.CARRIED): kept at the head only
    carried: Dict[str, bytes] = dataclasses.field(default_factory=dict)
    last_progress: Optional[int] = None   # the last round known to have made progress

    def members(self) -> List[NodeInfo]:
        """The head of the round's order (trainers, then spares), then every node that joined it
        late by infrastructure order: the same list on every agent that saw them."""
        if self.round is None:
            return []
        head = list(self.round.head)
        ids = {n.node_id for n in head}
        late = {n.node_id: n for n in self.late + ([self.round.me] if self.round.late else []) if n.node_id not in ids}
        rest = sorted(late.values(), key=lambda n: (n.order_key is None, n.order_key or 0, n.stable))
        return head + rest

    def survivors(self) -> int:
        """How many nodes the job has without its store host."""
        if self.round is None:
            return 0
        host_in = any(n.hosts_store for n in self.round.head)
        late = {n.node_id for n in self.late} | ({self.round.me.node_id} if self.round.late else set())
        return self.round.members + len(late) - (1 if host_in else 0)


class StoreFailover:
    def __init__(self, cfg: LaunchConfig, store: JobStore, proto: RoundProtocol, me: NodeInfo,
                 say: Callable[[str], None], learner=None):
        self.cfg = cfg
        self.store = store
        self.proto = proto
        self.me = me
        self.say = say
        self.learner = learner
        self.memory = JobMemory()
        # the round's end (agent.recovery.round_end.RoundEnd, set by the agent): how far back the
        # policy reads, and what the lost round's end writes on the new store
        self.round_end = None
        self._marked = 0  # the generation whose take-over this agent has recorded

    @property
    def enabled(self) -> bool:
        return not self.cfg.standalone and self.cfg.rdzv_port > 0 and self.cfg.max_nodes > 1

    def port(self, generation: int) -> int:
        return self.cfg.rdzv_port + generation

    # ---- memory ---------------------------------------------------------------------------
    def remember(self, rnd: Round) -> List[NodeInfo]:
        """Refresh the memory from the round just joined (at the head of its order: the member
        list and what a failover carries); returns the head of its order. After a failover,
        records on the new store that it has taken the job over."""
        mem = self.memory
        mem.round = rnd
        mem.late.clear()
        if self.enabled and any(n.node_id == self.me.node_id for n in rnd.head):   # a successor: seeds the list
            mem.everyone = list(rnd.active) + list(rnd.spares)
            self._read_carried(rnd.number)
            _load_torch_soon()   # a successor hosts torch's store: not seconds of import after the loss
        mem.restarts_used = self.proto.restarts_used()
        if self.cfg.ft.simulate_fault:
            mem.faults_fired = self.proto.faults_fired()
        if self.learner is not None:
            mem.timeouts_version = max(mem.timeouts_version, getattr(self.learner, "version_seen", 0))
        if mem.generation > self._marked:
            self.proto.put(store_keys.took_over(), str(mem.generation))
            self._marked = mem.generation
        return mem.members()

    def _read_carried(self, number: int) -> None:
        """Read what a failover carries while round `number` runs (one read): the job-wide keys,
        those of the round's members, those of the rounds the policy looks back on and of the last
        round with progress."""
        mem = self.memory
        rounds = self.round_end.history_rounds() if self.round_end is not None else store_keys.carry_rounds(0)
        also = [mem.last_progress] if mem.last_progress is not None else []
        names = store_keys.carried_names(number, [n.node_id for n in mem.everyone], rounds, also)
        mem.carried = {name: value for name, value in zip(names, self.proto.get_raw(names)) if value}
        progressed = [r for r in range(number - 1, max(-1, number - rounds - 1), -1)
                      if store_keys.progress(r) in mem.carried]
        if progressed:
            mem.last_progress = progressed[0]

    def successors(self) -> List[NodeInfo]:
        """The candidates in order: the last round's members without the store host."""
        return [n for n in self.memory.members() if not n.hosts_store]

    # ---- the failover ---------------------------------------------------------------------
    def take_over(self, lost: StoreLost) -> Tuple[int, int]:
        """Move this agent to the successor store. Returns the next round's number and how many
        nodes it expects there. Raises StoreReplaced when this agent was the host and has been
        replaced, StoreLost (with the line to print) when the job cannot go on."""
        if self.store.replaced:
            raise StoreReplaced(self.store.replaced)
        mem = self.memory
        if not self.enabled or mem.round is None:
            raise lost
        cands = self.successors()
        survivors = mem.survivors()
        # the head of the order reads the round's late joiners; a node past it may not know them
        # all, so only the head ends the job on the count alone (the others go on to the successor)
        knows_all = mem.round.late or any(n.node_id == self.me.node_id for n in mem.round.head)
        if survivors < self.cfg.min_nodes and knows_all:
            raise StoreLost(
                f"{lost}; the job is below its minimum: {survivors} node(s) of the last round left "
                f"without the store host, --nnodes needs at least {self.cfg.min_nodes} -> exiting 1")
        used = mem.restarts_used + 1
        if used > self.cfg.max_restarts:
            raise StoreLost(f"{lost}; restart budget spent ({mem.restarts_used}/{self.cfg.max_restarts} "
                            f"restarts used) -> exiting 1")
        number = mem.round.number + 1
        old = f"{self.store.host}:{self.store.port}"
        self.say(f"{lost}: failing over (successors in order: "
                 f"{', '.join(n.label() for n in cands)})")
        start, window = time.monotonic(), reach_within(self.cfg)
        for k, cand in enumerate(cands):
            generation = mem.generation + 1 + k
            port = self.port(generation)
            if cand.node_id == self.me.node_id:
                server = self._host(port)
                if server is None:
                    continue
                self.store.adopt(cand.host, port, server)
                self.me.hosts_store = True
                self._seed(number, used, generation, cand)
            else:
                # candidate k is waited for until (k + 1) windows after the loss, whenever this
                # agent came to it: one that skipped a candidate quickly (its own port taken, say)
                # still waits for the next as long as that candidate waits for the one before it
                client = self._reach(cand.host, port, start + (k + 1) * window)
                if client is None:
                    self.say(f"successor {cand.label()} did not answer at {cand.host}:{port} within "
                             f"{time.monotonic() - start:.0f}s of the loss; trying the next")
                    continue
                self.store.adopt(cand.host, port, None, client)
                self.me.hosts_store = False
            mem.generation = generation
            if self.round_end is not None:   # the lost round's end, and this node's progress in it
                self.round_end.end_lost_round(mem.round.number, cand.node_id == self.me.node_id)
            self.say(f"store failover: generation {generation} of the store at {cand.host}:{port}"
                     f"{' (hosted here)' if self.store.is_host else ''} replaces {old}; restarting in "
                     f"cycle {number} (restart {used}/{self.cfg.max_restarts})")
            self.me.hosts_store = cand.node_id == self.me.node_id
            return number, survivors
        raise StoreLost(f"{lost}; no successor store could be reached -> exiting 1")

    def _host(self, port: int):
        try:
            return host_store("0.0.0.0", port, self.cfg.conf("read_timeout"))
        except (OSError, RuntimeError) as exc:   # torch's DistNetworkError is a RuntimeError
            self.say(f"cannot host the successor store on port {port}: {str(exc).splitlines()[0]}")
            return None

    def _seed(self, number: int, used: int, generation: int, me: NodeInfo) -> None:
        """The successor's first writes: the keys a failover seeds and the ones it carries
        (agent.rounds.store_keys); the lost round's end follows (agent.recovery.round_end)."""
        proto, mem = self.proto, self.memory
        if mem.carried:
            proto.put_raw(list(mem.carried), list(mem.carried.values()))
        if mem.everyone:   # who the first joiner checks for when the round does not fill
            expect = [dataclasses.replace(n, hosts_store=n.node_id == me.node_id) for n in mem.everyone + mem.late
                      if not n.hosts_store]
            proto.put(store_keys.expect(number), json.dumps([dataclasses.asdict(n) for n in expect]))
        proto.count(store_keys.restarts_used(), used)
        if mem.faults_fired:
            proto.count(store_keys.faults_fired(), mem.faults_fired)
        if mem.timeouts_version:
            proto.count(store_keys.timeouts_version(), mem.timeouts_version)
        proto.put(store_keys.generation(), str(generation))
        proto.put(store_keys.next_round(), str(number))

    def _reach(self, host: str, port: int, deadline: float) -> Optional[StoreClient]:
        """A client of the store at host:port once something listens there, or None at `deadline`
        (time.monotonic())."""
        while time.monotonic() < deadline:
            self.store.check_stop()
            try:
                with socket.create_connection((host, port), timeout=0.5):
                    pass
            except OSError:
                time.sleep(0.05)
                continue
            client = self._client(host, port, max(0.5, deadline - time.monotonic()), "main")
            if client is not None:
                return client
        return None

    # ---- split brain ----------------------------------------------------------------------
    def find_successor(self) -> Optional[str]:
        """On the store host: a successor store of this job that has taken over, as the line to
        print, else None. Probes each of the first FENCE_PROBES candidates' ports once."""
        mem = self.memory
        prefix = self.store.prefix
        for k, cand in enumerate(self.successors()[:FENCE_PROBES]):
            generation = mem.generation + 1 + k
            port = self.port(generation)
            try:
                with socket.create_connection((cand.host, port), timeout=0.2):
                    pass
            except OSError:
                continue
            client = self._client(cand.host, port, 1.0, "fence")
            if client is None:
                continue
            try:
                if client.check([prefix + store_keys.took_over()]):
                    return (f"this node hosted the rendezvous store but was unreachable, and the other "
                            f"nodes moved the job to generation {generation} of the store at "
                            f"{cand.host}:{port}: stopping this node's ranks -> exiting 1")
            except StoreError:
                continue
            finally:
                client.close()
        return None

    def _client(self, host: str, port: int, within: float, label: str) -> Optional[StoreClient]:
        """A client of the store at host:port, or None when none is made within `within` s (the
        caller moves on to the next candidate)."""
        try:
            client = StoreClient.connect(host, port, within=within,
                                         unresponsive=self.cfg.conf("store_unresponsive_timeout"),
                                         gone_after=gone_after(self.cfg), stop=self.store._stop_check(),
                                         say=self.say, label=label, handshake_limit=within)
        except StoreError:
            return None
        client.default_timeout = self.cfg.conf("read_timeout")
        return client


def _load_torch_soon() -> None:
    """Import torch's store in the background (once), so that this node can host a successor store
    the moment it must."""
    import sys
    import threading

    if "torch.distributed" in sys.modules or _LOADING:
        return
    _LOADING.append(True)

    def load():
        import warnings

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                import torch.distributed  # noqa: F401
        except Exception:  # noqa: BLE001 - only a head start: host_store imports it again and says why
            pass
    threading.Thread(target=load, name="ft-load-torch", daemon=True).start()


_LOADING: list = []
