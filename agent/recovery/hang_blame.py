"""Hang blame: which rank hung (the culprit) and which only waited on it (the victims).

When one rank hangs inside a step, its peers block in the same collective and their monitors'
timers run out too. With hang blame on (the agent sets rank_monitor.shm_layout.ENV_HANG_VERDICT for
its monitors), a monitor that finds a hang reports it, dumps the stack and holds the rank for a
verdict (at most rank_monitor.monitor_side.server.VERDICT_HOLD seconds after the hang, then it stops the rank
regardless; also when its agent is gone). The agents decide from evidence, in this order:

1. the flight recorder (agent.recovery.flight_recorder gathers every rank's dump in the store): per
   process group, a rank waiting in a collective (not retired) waits on the group's members that
   never entered it; the culprits are the ranks these waits lead to that wait on nobody (HSDP: a
   replica peer waits on a rank that waits in the shard group on the rank that hung); a rank that
   could not dump (stopped, holding the GIL) never entered anything;
2. else the stack dumps: a hung rank whose main thread waits inside `torch.distributed` (or in a
   backward pass, where DDP's reducer waits for its all-reduce) is a victim, any other a culprit;
3. else (no evidence, or it blames nobody): every rank whose monitor fired is stopped, as before.

The judgement is the restart policy's (agent.recovery.restart_policy.judge_hang: pure, tested
without a store); this module gathers its evidence and carries it out. One agent runs it per
cycle: the first to report a hang claims `r<c>/blame/decider`, asks it until it answers (at the
latest BLAME_WAIT seconds after its report; at once when the evidence is complete) and writes
`r<c>/blame/verdict`; every agent with a hung rank reads it and tells its monitors: stop the
culprits, release the victims (they then restart in place like the healthy ranks of a kill, and
their monitors leave them alone). A culprit whose own monitor has not fired yet is killed by its
agent when it is on the deciding node; a culprit elsewhere must have reported its hang by the
deadline, else the verdict falls back to 3 (so a released victim never waits on a culprit nobody
stops). A cycle that cannot restart in place (agent.recovery.restart_policy) is decided at once: every hung
rank is stopped, as before. One `hang_blame` event (and line) says which evidence decided.

Evidence in the store, per cycle: `r<c>/blame/hung` ("rank;" per hang report) and
`r<c>/blame/stacks` ("rank:wait|run|?;" per stack dump). Everything runs in the agent's main
loop (`tick`), with non-blocking store calls only.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time
from typing import Callable, Dict, List, Optional, Set, Tuple

from ft_launcher.agent.rounds import store_keys
from ft_launcher.agent.recovery.restart_policy import HangEvidence, evidence_words, judge_hang, waiting_words
from ft_launcher.rank_monitor import flight_recorder as FR

BLAME_WAIT = 0.6    # seconds after the deciding agent's first hang report until it decides regardless
STACK_WAIT = 0.4    # seconds a late hang report (stack evidence) waits for its rank's stack
POLL = 0.005        # seconds between looks at the evidence while a verdict is pending
GIVE_UP = 3.0       # seconds after which nobody polls any more (the monitors have long stopped their ranks)

_FRAME = re.compile(r'File "([^"]+)", line \d+ in (\S+)')


def stack_waits(stack: Optional[str]) -> Optional[bool]:
    """Does a faulthandler dump show the rank's main thread (the "Current thread", which took
    the dump signal) waiting inside a collective? None when the dump says nothing."""
    if not stack or "Current thread" not in stack:
        return None
    block = stack.split("Current thread", 1)[1].split("\n\n", 1)[0]
    frames = _FRAME.findall(block)
    if not frames:
        return None
    path, func = frames[0]   # most recent call first
    path = path.replace(os.sep, "/")
    return "/torch/distributed/" in path or func == "_engine_run_backward"


def _group_members(config: dict, name: str, desc: str, world: int) -> Optional[Tuple[int, ...]]:
    """The global ranks of group `name` by one rank's pg_config (None: it does not say)."""
    entry = config.get(name)
    ranks = entry.get("ranks") if isinstance(entry, dict) else None
    if ranks:
        try:
            members = tuple(sorted(int(r) for r in json.loads(ranks)))
            if members:
                return members
        except (TypeError, ValueError):
            pass
    if desc == "default_pg":
        return tuple(range(world))
    return None


def from_flight_recorder(dumps: Dict[int, bytes], world: int) -> Optional[dict]:
    """The culprits by the flight recorder (see below), or None when the dumps show no collective
    that some rank never joined, or do not lead to a rank that waits on nobody.

    Sequence numbers count per process group, so they are compared only within one: a group is
    its name and members (torch's split_group gives groups of different ranks one name). In each
    group, a rank waits on the members that never entered its oldest collective there that has not
    completed (a rank without a dump entered nothing). The culprits are the ranks these waits lead
    to that themselves wait on nobody (HSDP: a replica peer waits in the replicate all_reduce on a
    rank that waits in the shard reduce_scatter on the rank that hung); the victims are the ranks
    that wait. A cycle of waits blames nobody."""
    configs: Dict[int, dict] = {}
    traces: Dict[int, dict] = {}
    for rank, data in dumps.items():
        trace = FR.load_trace(data)
        if trace is None:
            continue   # a dump we cannot read is no evidence (that rank counts as having entered nothing)
        traces[rank] = trace
        configs[rank] = trace.get("pg_config") if isinstance(trace.get("pg_config"), dict) else {}
    named: Dict[str, Set[int]] = {}   # group name -> ranks that recorded it (members when no config says)
    for rank, trace in traces.items():
        for e in trace.get("entries") or []:
            if isinstance(e, dict) and e.get("process_group"):
                named.setdefault(str(tuple(e["process_group"])[0]), set()).add(rank)

    def group_of(rank: int, pg: tuple) -> Tuple[str, Tuple[int, ...]]:
        name, desc = (str(pg[0]), str(pg[1]) if len(pg) > 1 else "")
        members = _group_members(configs.get(rank, {}), name, desc, world)
        if members is None:   # another dump that names it with this rank in it, else who recorded it
            members = next((m for other in configs.values() for m in [_group_members(other, name, desc, world)]
                            if m and rank in m), None) or tuple(sorted(named.get(name, {rank})))
        return name, members

    entered: Dict[int, Dict[tuple, int]] = {}
    oldest: Dict[int, Dict[tuple, dict]] = {}   # rank -> group -> its oldest collective not completed
    descs: Dict[tuple, str] = {}
    for rank, trace in traces.items():
        mine, waits = entered.setdefault(rank, {}), oldest.setdefault(rank, {})
        ids: Dict[str, tuple] = {}
        first: Dict[tuple, int] = {}   # group -> its lowest sequence in this dump
        for e in trace.get("entries") or []:
            if not isinstance(e, dict) or e.get("is_p2p") or not e.get("process_group"):
                continue
            pg = tuple(e["process_group"])
            group = group_of(rank, pg)
            descs[group] = str(pg[1]) if len(pg) > 1 else ""
            ids[str(e.get("pg_id"))] = group
            try:
                seq = int(e.get("collective_seq_id") or 0)
            except (TypeError, ValueError):
                continue
            mine[group] = max(mine.get(group, 0), seq)
            first[group] = min(first.get(group, seq), seq)
            if not e.get("retired") and e.get("state") != "completed":
                if group not in waits or seq < waits[group]["seq"]:
                    waits[group] = {"seq": seq, "name": str(e.get("profiling_name") or "?"),
                                    "created": e.get("time_created_ns") or 0}
        # entries the ring buffer dropped: only there (the group's oldest entry is not its first), since
        # the status counts in its own numbering (a LiveState heal's sends and receives count there,
        # not in the entries' collective sequence: a 1 x 3 job's healer showed 30 beside its 17)
        for pg_id, status in (trace.get("pg_status") or {}).items():
            if str(pg_id) in ids and isinstance(status, dict) and first.get(ids[str(pg_id)], 1) > 1:
                try:
                    last = int(status.get("last_enqueued_collective", 0))
                except (TypeError, ValueError):
                    continue
                mine[ids[str(pg_id)]] = max(mine.get(ids[str(pg_id)], 0), last)
    on: Dict[int, Set[int]] = {}      # rank -> the ranks it waits on
    why: Dict[Tuple[int, int], tuple] = {}   # (waiter, absent) -> (group, its wait)
    for rank, waits in oldest.items():
        for group, wait in waits.items():
            for member in group[1]:
                if member != rank and entered.get(member, {}).get(group, 0) < wait["seq"]:
                    on.setdefault(rank, set()).add(member)
                    why.setdefault((rank, member), (group, wait))
    if not on:
        return None
    culprits: Set[int] = set()
    for victim in on:   # follow the waits to the ranks that wait on nobody
        seen, todo, ends = {victim}, [victim], set()
        while todo:
            for nxt in on.get(todo.pop(), ()):
                if nxt in seen:
                    continue
                seen.add(nxt)
                if nxt in on:
                    todo.append(nxt)
                else:
                    ends.add(nxt)
        if not ends:
            return None   # waits in a circle: no rank of them is the cause by this evidence
        culprits |= ends
    direct = sorted(((wait["created"], waiter, group, wait) for (waiter, absent), (group, wait) in why.items()
                     if absent in culprits), key=lambda item: (item[0], item[1]))
    _, _, group, wait = direct[0]
    return {"evidence": "flight recorder", "culprits": sorted(culprits), "victims": sorted(on),
            "collective": wait["name"], "sequence": wait["seq"],
            "group": f"{group[0]}:{descs.get(group, '')}"}


def _items(raw: Optional[bytes]) -> List[str]:
    return [x for x in (raw or b"").decode().split(";") if x]


class HangBlame:
    """One agent's part (see the module docstring); `events` is the agent's EventLog."""

    def __init__(self, events):
        self.events = events
        self.number: Optional[int] = None

    def start_cycle(self, store, number: int, world: int, node_id: str, flight_recorder: bool,
                    in_place_possible: Callable[[], bool], local_ranks: Callable[[], List[int]]) -> None:
        self.store, self.number, self.world, self.node_id = store, number, world, node_id
        self.flight_recorder = flight_recorder
        self.in_place_possible = in_place_possible
        self.local_ranks = local_ranks           # this node's global ranks
        self.first: Optional[float] = None       # when this node saw its first hang report
        self.decider = False
        self.verdict: Optional[dict] = None
        self.hung: Dict[int, dict] = {}          # local rank -> its hang report
        self.told: Dict[int, bool] = {}          # local rank -> what its monitor was told (kill)
        self.stacks: Dict[int, Optional[bool]] = {}   # global rank -> stack_waits (this node's)
        self.killed: Set[int] = set()            # local ranks this agent killed as culprits
        self.fr: Optional[dict] = None           # the flight recorder's finding, {} when undecided
        self.fr_complete = False                 # every rank's dump was in when it was read

    def end_cycle(self) -> None:
        self.number = None

    # ---- evidence from this node's monitors ---------------------------------------------------
    def _k(self, name: str) -> str:
        return self.store.key(store_keys.blame(self.number, name))

    def on_hang(self, local_rank: int, report: dict) -> None:
        if self.number is None or report.get("cycle") != self.number or local_rank in self.hung:
            return
        self.hung[local_rank] = dict(report, seen=time.monotonic())
        try:
            self.store.client.append(self._k("hung"), f"{report.get('rank')};")
            if self.first is None:
                self.first = time.monotonic()
                won = self.store.client.compare_set(self._k("decider"), "", self.node_id).decode()
                self.decider = won == self.node_id
        except Exception:  # noqa: BLE001 - no store, no blame: the monitors' hold ends the hang
            self.first = self.first or time.monotonic()

    def on_stack(self, report: dict) -> None:
        if self.number is None or report.get("cycle") != self.number:
            return
        waits = stack_waits(report.get("stack") if report.get("complete") else None)
        self.stacks[report.get("rank")] = waits
        try:
            self.store.client.append(self._k("stacks"), f"{report.get('rank')}:"
                                     f"{'?' if waits is None else 'wait' if waits else 'run'};")
        except Exception:  # noqa: BLE001
            pass

    # ---- the verdict ------------------------------------------------------------------------
    @property
    def pending(self) -> bool:
        """A verdict is awaited, or known but not yet told to a monitor: poll every POLL s."""
        return (self.number is not None and self.first is not None and time.monotonic() < self.first + GIVE_UP
                and (self.verdict is None or len(self.told) < len(self.hung)))

    def tick(self, monitors, ranks, final: bool = False) -> None:
        """Decide (the deciding agent) or read the verdict, and tell this node's monitors.
        `final`: the cycle is ending: decide now with what is known."""
        if self.number is None or self.first is None:
            return
        if self.verdict is None:
            try:
                if self.decider:
                    self._decide(final)
                if self.verdict is None and self.store.client.check([self._k("verdict")]):
                    self.verdict = json.loads(self.store.client.get(self._k("verdict")))
            except Exception:  # noqa: BLE001 - a lost store: the monitors' hold ends the hang
                return
        if self.verdict is None:
            return
        for local_rank, report in self.hung.items():
            if local_rank in self.told:
                continue
            kill = self._kill(report, final)
            if kill is None:
                continue
            self.told[local_rank] = kill
            monitors[local_rank].hang_verdict(report.get("pid"), kill)
        for rank in ranks:   # a culprit here whose monitor has not fired
            if (rank.rank in self.verdict.get("culprits", []) and rank.local_rank not in self.hung
                    and rank.local_rank not in self.killed and rank.exitcode is None):
                self.killed.add(rank.local_rank)
                try:
                    os.killpg(rank.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def _kill(self, report: dict, final: bool) -> Optional[bool]:
        v, rank = self.verdict, report.get("rank")
        if rank in v.get("culprits", []):
            return True
        if rank in v.get("victims", []):
            return False
        if v.get("evidence") == "stacks":   # a rank that fired after the verdict: its own stack decides
            if rank not in self.stacks:
                waited = time.monotonic() - float(report.get("seen", 0) or 0)
                return None if not final and waited < STACK_WAIT else True
            return self.stacks[rank] is not True
        return True

    def settle(self, monitor_set, ranks, cycle: int) -> Set[int]:
        """The cycle ends: the hang reports its monitors hold that the agent has not read yet go in,
        the blame decides (final), and the answer is the local ranks stopped as hung (their monitor
        found them hung and the blame did not release them): the verdict replaces them."""
        for local_rank, report in monitor_set.unread_hangs(cycle):
            self.on_hang(local_rank, report)
        self.tick(monitor_set.handles, ranks, final=True)
        return monitor_set.hung(cycle) - self.released()

    def released(self) -> Set[int]:
        """Local ranks whose monitors were told to release them (victims: they restart in place)."""
        return {lr for lr, kill in self.told.items() if not kill} if self.number is not None else set()

    def blamed(self, local_rank: int) -> bool:
        return self.number is not None and local_rank in self.killed

    def words(self, rank: int) -> str:
        """For the culprit's failure line: who waited on it, and the evidence."""
        v = self.verdict if self.number is not None else None
        if not v or rank not in v.get("culprits", []):
            return ""
        return waiting_words(v)

    # ---- the deciding agent -------------------------------------------------------------------
    def _decide(self, final: bool) -> None:
        """Gather the evidence from the store and ask the policy's judgement (judge_hang)."""
        ev = HangEvidence(world=self.world, late=final or time.monotonic() >= self.first + BLAME_WAIT,
                          in_place=self.in_place_possible(), mine=set(self.local_ranks()),
                          flight_recorder=self.flight_recorder)
        if ev.in_place:
            c = self.store.client
            ev.hung = {int(x) for x in _items(c.get(self._k("hung")) if c.check([self._k("hung")]) else b"")}
            if self.flight_recorder and self.fr is None:
                complete = bool(c.check([self.store.key(store_keys.flight(self.number, "all_done"))]))
                if complete or ev.late:
                    dump = {r: self.store.key(store_keys.flight_dump(self.number, r)) for r in range(self.world)}
                    dumps = {r: c.get(dump[r]) for r in range(self.world) if c.check([dump[r]])}
                    self.fr = (from_flight_recorder(dumps, self.world) or {}) if dumps else {}
                    self.fr_complete = complete
            ev.fr, ev.fr_complete = self.fr, self.fr_complete
            if not ev.sure_fr():   # the stacks are read only where the flight recorder cannot decide
                for item in _items(c.get(self._k("stacks")) if c.check([self._k("stacks")]) else b""):
                    rank, _, how = item.partition(":")
                    ev.stacks[int(rank)] = how
        judged = judge_hang(ev)
        if judged is not None:
            self._publish(*judged)

    def _publish(self, verdict: dict, quiet: bool = False) -> None:
        verdict["decided_after"] = round(time.monotonic() - self.first, 3)
        value = json.dumps(verdict, sort_keys=True)
        won = self.store.client.compare_set(self._k("verdict"), "", value).decode()
        self.verdict = json.loads(won)
        v = self.verdict
        if quiet:   # a full restart follows whoever hung: nothing to tell
            return
        if v.get("culprits"):
            message = (f"hang blame ({evidence_words(v)}): rank{'s' if len(v['culprits']) > 1 else ''} "
                       f"{', '.join(map(str, v['culprits']))} hung; "
                       + (f"rank{'s' if len(v['victims']) > 1 else ''} {', '.join(map(str, v['victims']))} "
                          f"only waited on it and restart{'' if len(v['victims']) > 1 else 's'} in place"
                          if v.get("victims") else "the others restart in place"))
        else:
            message = f"hang blame: no evidence tells culprit from victim ({v.get('why')}): every hung rank is stopped"
        self.events.event("hang_blame", message, cycle=self.number, **{k: x for k, x in v.items()})
