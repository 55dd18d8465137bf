"""Every key the agents share in the job's store, in one place: its name, shape, writer, readers,
and what a store failover does with it. Modules compose key names only through the functions
here (the name under the run's prefix `ft/<run_id>/`, which JobStore.key adds); a test fails when
a module composes one itself, or when a key is declared without saying what a failover does
with it (tests/agent/unit/test_store_keys.py).

What a failover does with a key (`failover=`; agent.rounds.store_failover):
- SEEDED: the successor writes it fresh from what every survivor knows (the round, the budget
  spent, the store's generation, ...).
- CARRIED: the policy's history, which the job must not forget: the nodes at the head of each
  round's order read these keys when they join a round (CARRIED_NAMES: one read), and the one
  that becomes the successor writes what it read into the new store. Families are enumerated from
  what a reader asks about: per node, the last round's members; per round, the CARRY_ROUNDS
  rounds before it (as many as the policy looks back) and the last round with progress.
- NOT CARRIED (`failover` says why): a round's own workings, which end with the round, or what
  every agent writes again on its own.

Round numbers are `r<R>` (a round is a cycle: `c`), nodes their `node_id`.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Iterable, List

SEEDED = "seeded"
CARRIED = "carried"
ROUND_ENDED = "not carried: the round's own workings, over once a later round began"
REWRITTEN = "not carried: every agent writes it again on its own"


@dataclasses.dataclass(frozen=True)
class Key:
    pattern: str          # the name, with <R>, <c>, <node>, <g>, <rank> for its parts
    shape: str            # what its value is
    writer: str           # the module(s) that write it
    readers: str          # the module(s) that read it
    failover: str         # SEEDED, CARRIED, or "not carried: <why>"
    name: Callable[..., str]


KEYS: Dict[str, Key] = {}   # pattern -> Key, in declaration order


def key(pattern: str, *, shape: str, writer: str, readers: str, failover: str):
    """Declare the key a function names (all five are required: a key without its failover mark
    cannot be declared)."""
    if failover not in (SEEDED, CARRIED) and not failover.startswith("not carried: "):
        raise ValueError(f"store key {pattern}: failover must be SEEDED, CARRIED or 'not carried: <why>'")

    def register(fn: Callable[..., str]) -> Callable[..., str]:
        if pattern in KEYS:
            raise ValueError(f"store key {pattern} declared twice")
        KEYS[pattern] = Key(pattern, shape, writer, readers, failover, fn)
        return fn
    return register


# ---- job-wide --------------------------------------------------------------------------------
@key("agents", shape="counter: agents that have reached the store (each agent's stable order)",
     writer="rounds.rendezvous (each agent once)", readers="rounds.rendezvous", failover=CARRIED)
def agents() -> str:
    return "agents"


@key("round", shape="the number of the round to join next", writer="rounds.rendezvous (a restart's "
     "decider), rounds.store_failover", readers="rounds.rendezvous, recovery.no_restart", failover=SEEDED)
def next_round() -> str:
    return "round"


@key("restarts_used", shape="counter: the job-wide restart budget spent", writer="rounds.rendezvous (the "
     "decider)", readers="rounds.rendezvous (the policy's input), rounds.store_failover", failover=SEEDED)
def restarts_used() -> str:
    return "restarts_used"


@key("faults_fired", shape="counter: simulated faults fired", writer="recovery.fault_injection (through "
     "rounds.rendezvous)", readers="recovery.fault_injection, rounds.store_failover", failover=SEEDED)
def faults_fired() -> str:
    return "faults_fired"


@key("timeouts", shape="JSON: the job-wide computed timeouts", writer="observation.timeout_learning (node 0)",
     readers="observation.timeout_learning (every agent, when timeouts_version rises)", failover=CARRIED)
def timeouts() -> str:
    return "timeouts"


@key("timeouts_version", shape="counter: versions of `timeouts` published", writer="observation.timeout_learning",
     readers="observation.timeout_learning, rounds.store_failover", failover=SEEDED)
def timeouts_version() -> str:
    return "timeouts_version"


@key("generation", shape="which store this is: 0 the first, then 1, 2, ... (a failover's successors)",
     writer="rounds.store_failover", readers="the operator (a look into the store)", failover=SEEDED)
def generation() -> str:
    return "generation"


@key("took_over", shape="the generation of a successor store, once the job runs on it",
     writer="rounds.store_failover", readers="rounds.store_failover (a returning host's fence)",
     failover="not carried: it says that the store holding it took over")
def took_over() -> str:
    return "took_over"


@key("excluded", shape="counter: nodes that left the job", writer="recovery.no_restart",
     readers="rounds.rendezvous (the policy's input, a joiner's check), agent", failover=CARRIED)
def excluded() -> str:
    return "excluded"


@key("excluded/<node>", shape="'1': that node left the job", writer="recovery.no_restart",
     readers="recovery.no_restart, rounds.rendezvous (who a restart round expects)", failover=CARRIED)
def excluded_node(node_id: str) -> str:
    return f"excluded/{node_id}"


@key("slow/<node>", shape="the line saying why that node straggles", writer="observation.stragglers (node 0)",
     readers="rounds.rendezvous (the policy's input), agent (the leaving node's line)", failover=CARRIED)
def slow(node_id: str) -> str:
    return f"slow/{node_id}"


@key("obs/<node>", shape="JSON: that node's section-time observations", writer="observation.timeout_learning",
     readers="observation.timeout_learning (node 0)", failover=REWRITTEN)
def observations(node_id: str) -> str:
    return f"obs/{node_id}"


# ---- per round: joining ----------------------------------------------------------------------
@key("r<R>/records", shape="every joiner's NodeInfo, one JSON line each (append)", writer="rounds.rendezvous",
     readers="rounds.rendezvous, recovery.no_restart (a parked store host)", failover=ROUND_ENDED)
def records(r: int) -> str:
    return f"r{r}/records"


@key("r<R>/joined", shape="counter: each joiner's sequence number", writer="rounds.rendezvous",
     readers="rounds.rendezvous", failover=ROUND_ENDED)
def joined(r: int) -> str:
    return f"r{r}/joined"


@key("r<R>/target", shape="how many nodes a restart round expects back", writer="rounds.rendezvous (with the "
     "verdict of round R-1)", readers="rounds.rendezvous",
     failover="not carried: a failover's survivors know their own target")
def target(r: int) -> str:
    return f"r{r}/target"


@key("r<R>/expect", shape="JSON: the NodeInfo of every node round R expects back", writer="rounds.rendezvous "
     "(with the verdict of round R-1), rounds.store_failover", readers="rounds.rendezvous", failover=SEEDED)
def expect(r: int) -> str:
    return f"r{r}/expect"


@key("r<R>/closed", shape="'<count>:<token>' of the closer (compare_set: one closer)", writer="rounds.rendezvous",
     readers="rounds.rendezvous", failover=ROUND_ENDED)
def closed(r: int) -> str:
    return f"r{r}/closed"


@key("r<R>/at/<node>", shape="JSON: that node's place (node rank or spare, rank offset, watched peers)",
     writer="rounds.rendezvous (the closer)", readers="rounds.rendezvous", failover=ROUND_ENDED)
def place(r: int, node_id: str) -> str:
    return f"r{r}/at/{node_id}"


@key("r<R>/info", shape="JSON: world size, nodes, spares, the head of the order", writer="rounds.rendezvous "
     "(the closer)", readers="rounds.rendezvous", failover=ROUND_ENDED)
def info(r: int) -> str:
    return f"r{r}/info"


@key("r<R>/members", shape="JSON: every member in order", writer="rounds.rendezvous (the closer)",
     readers="rounds.rendezvous", failover=ROUND_ENDED)
def members(r: int) -> str:
    return f"r{r}/members"


@key("r<R>/assigned", shape="'ok' once every place is published, or 'abandoned'", writer="rounds.rendezvous",
     readers="rounds.rendezvous (every joiner waits on it)", failover=ROUND_ENDED)
def assigned(r: int) -> str:
    return f"r{r}/assigned"


@key("r<R>/late", shape="NodeInfo lines of nodes that joined after the round closed", writer="rounds.rendezvous",
     readers="rounds.round_watcher, rounds.rendezvous", failover=ROUND_ENDED)
def late(r: int) -> str:
    return f"r{r}/late"


@key("r<R>/nlate", shape="counter: nodes that joined after the round closed", writer="rounds.rendezvous",
     readers="rounds.round_watcher", failover=ROUND_ENDED)
def nlate(r: int) -> str:
    return f"r{r}/nlate"


@key("r<R>/worker_store", shape="'addr:port' of the store this round's workers use",
     writer="rounds.job_rounds (node 0, through rounds.rendezvous)", readers="rounds.rendezvous",
     failover=ROUND_ENDED)
def worker_store(r: int) -> str:
    return f"r{r}/worker_store"


# ---- per round: its end and the policy's history -------------------------------------------------
@key("r<R>/interrupt", shape="JSON: the first report of the round's end (compare_set: first writer wins); "
     "{'kind': 'store_lost'} for the round a failover ended", writer="rounds.rendezvous, rounds.store_failover",
     readers="rounds.round_watcher (waits on it), rounds.rendezvous (same-error history, join check)",
     failover=CARRIED)
def interrupt(r: int) -> str:
    return f"r{r}/interrupt"


@key("r<R>/verdict", shape="JSON: the Verdict every agent applies", writer="rounds.rendezvous (the decider)",
     readers="rounds.rendezvous", failover=ROUND_ENDED)
def verdict(r: int) -> str:
    return f"r{r}/verdict"


@key("r<R>/origin", shape="JSON: the rank and node where round R's failure began (an exit 16 or 17: its "
     "exitcode, hardware and iteration too)", writer="rounds.rendezvous "
     "(the decider)", readers="rounds.rendezvous (the policy's input)", failover=CARRIED)
def origin(r: int) -> str:
    return f"r{r}/origin"


@key("r<R>/restartable", shape="counter: nodes whose ranks all run under ft.restartable",
     writer="rounds.rendezvous", readers="rounds.rendezvous (the policy's input)",
     failover="not carried: a failover's round declares its own")
def restartable(r: int) -> str:
    return f"r{r}/restartable"


@key("r<R>/progress", shape="a step (or checkpoint iteration) completed in round R", writer="recovery.progress",
     readers="recovery.progress (the policy's input), rounds.rendezvous", failover=CARRIED)
def progress(r: int) -> str:
    return f"r{r}/progress"


@key("r<R>/progress_unknown", shape="'1': the checkpoint iteration file could not tell",
     writer="recovery.progress", readers="recovery.progress", failover=CARRIED)
def progress_unknown(r: int) -> str:
    return f"r{r}/progress_unknown"


@key("r<R>/done", shape="counter: nodes whose ranks finished", writer="rounds.rendezvous",
     readers="rounds.rendezvous, agent (the teardown watch: every other node's ranks are done)", failover=ROUND_ENDED)
def done(r: int) -> str:
    return f"r{r}/done"


@key("r<R>/left", shape="counter: nodes that left the round", writer="rounds.rendezvous",
     readers="rounds.rendezvous", failover=ROUND_ENDED)
def left(r: int) -> str:
    return f"r{r}/left"


@key("r<R>/strag/<g>", shape="JSON: node g's straggler window", writer="observation.stragglers",
     readers="observation.stragglers (node 0)", failover=ROUND_ENDED)
def straggler_window(r: int, group_rank: int) -> str:
    return f"r{r}/strag/{group_rank}"


# ---- per cycle: a hang's evidence (recovery.hang_blame, recovery.flight_recorder) -----------------
BLAME_PARTS = ("hung", "stacks", "decider", "verdict")
FR_PARTS = ("request", "nodes_done", "all_done")


@key("r<c>/blame/<part>", shape="the hang blame's evidence and verdict: hung ('rank;' lines), stacks "
     "('rank:wait|run|?;'), decider (compare_set), verdict (JSON)", writer="recovery.hang_blame",
     readers="recovery.hang_blame", failover=ROUND_ENDED)
def blame(c: int, part: str) -> str:
    if part not in BLAME_PARTS:
        raise ValueError(f"no blame key {part!r}")
    return f"r{c}/blame/{part}"


@key("r<c>/fr/<part>", shape="the flight-recorder gathering: request (compare_set), nodes_done (counter), "
     "all_done", writer="recovery.flight_recorder", readers="recovery.flight_recorder", failover=ROUND_ENDED)
def flight(c: int, part: str) -> str:
    if part not in FR_PARTS:
        raise ValueError(f"no flight-recorder key {part!r}")
    return f"r{c}/fr/{part}"


@key("r<c>/fr/dump/<rank>", shape="that rank's flight-recorder dump", writer="recovery.flight_recorder",
     readers="recovery.flight_recorder, recovery.hang_blame", failover=ROUND_ENDED)
def flight_dump(c: int, rank: int) -> str:
    return f"r{c}/fr/dump/{rank}"


@key("r<c>/fr/skipped/<rank>", shape="why that rank's dump is missing", writer="recovery.flight_recorder",
     readers="recovery.flight_recorder", failover=ROUND_ENDED)
def flight_skipped(c: int, rank: int) -> str:
    return f"r{c}/fr/skipped/{rank}"


# ---- what a failover carries -----------------------------------------------------------------------
def carry_rounds(*limits: int) -> int:
    """How many rounds back a failover carries: as far as the policy looks (the limits of its rules
    in rounds), and a margin for the rounds failovers ended."""
    return max(limits) + 2


def carried_names(number: int, node_ids: Iterable[str], rounds: int, also: Iterable[int] = ()) -> List[str]:
    """The names of every CARRIED key a failover needs while round `number` runs: the job-wide ones,
    the per-node ones of `node_ids`, the per-round ones of the `rounds` rounds before it and of the
    rounds in `also` (the last with progress)."""
    per_node = [k for k in KEYS.values() if k.failover == CARRIED and "<node>" in k.pattern]
    per_round = [k for k in KEYS.values() if k.failover == CARRIED and k.pattern.startswith("r<")]
    job_wide = [k for k in KEYS.values() if k.failover == CARRIED and k not in per_node and k not in per_round]
    names = [k.name() for k in job_wide]
    names += [k.name(n) for n in node_ids for k in per_node]
    numbers = sorted(set(range(max(0, number - rounds), number)) | {r for r in also if 0 <= r < number})
    names += [k.name(r) for r in numbers for k in per_round]
    return names
