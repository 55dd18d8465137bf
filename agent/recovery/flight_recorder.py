"""The job's flight-recorder dump on a hang: every rank dumps torch's trace before any is killed,
the dumps are gathered into the cycle's log dir, and torch's own analyzer names the collective
that did not complete and the ranks that never joined it.

- The ranks record: `TORCH_FR_BUFFER_SIZE` (`FR_BUFFER_DEFAULT` entries, rank_monitor.flight_recorder)
  unless the user set it or its older name `TORCH_NCCL_TRACE_BUFFER_SIZE`; set to 0, the whole dump path is off (one line).
  Gloo records too (torch 2.13), so the path below runs and is tested on CPU.
- Each agent owns a local directory (`FT_LAUNCHER_FR_DIR`, inherited by its monitors and ranks)
  holding each slot's pipe and dumps (rank_monitor.flight_recorder).
- A monitor that finds a hang reports it and holds the rank; the agent that gets the report asks
  for the job's dump in the store (`r<cycle>/fr/request`, first writer wins). Every agent has a
  thread per cycle waiting on that key with its own store connection: it asks its ranks to dump
  (through their pipes), gives each `RANK_WAIT` seconds (a rank that does not dump in time, or
  has no pipe because it does not run our client, is skipped, one line each), puts the dumps into
  the store, and once every node has done so (or `JOB_WAIT` seconds after the request) tells its
  monitors (`on_done`, over each monitor's control channel). Only then do monitors dump stacks and stop ranks, and an agent
  that ends a cycle first lets its thread finish that dump (`end_cycle`).
- The agent that asked gathers the dumps into `<log dir>/cycle_<c>/flight_recorder/rank_<r>` (no
  log dir: the agent's run dir in the temp dir, `ft_launcher-<agent pid>/`, which outlives the
  agent like the stack dumps it holds, so the line that names the folder stays true) and
  runs `python -m torch.distributed.flight_recorder.fr_trace` on them (its output kept beside
  them in `fr_trace.txt`), then says in one line and a `flight_recorder` event which collective
  never completed and which ranks never joined it. Where torch lacks a piece (no recorder, the
  analyzer missing or failing) one line says so; the Python stack dumps are taken as before.

torch 2.13's gloo records the default group's config under an empty name, which its analyzer
cannot match with the entries (KeyError): a rank running our client names every group of its own in
its dump (rank_monitor.flight_recorder.with_group_config); for any other dump the gathered copies
name the placeholder after the entries' group. Dumps are read as plain data (load_trace), never as
pickles that may run code.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

from ft_launcher.agent.rounds import store_keys
from ft_launcher.rank_monitor import flight_recorder as FR
from ft_launcher.rank_monitor.flight_recorder import buffer_size, read_trace

RANK_WAIT = 1.0              # seconds a rank gets to dump
JOB_WAIT = 2.0               # seconds after the request until the monitors go on regardless
ANALYZER_TIMEOUT = 60.0
WAIT_SLICE = 5.0             # seconds per store wait for a request: a paused store host never answers
CLOSED = "closed"            # the request key's value once a cycle is over without a request


class FlightRecorder:
    """One agent's part: its dump directory, a thread per cycle, the analysis where it asked."""

    def __init__(self, log_dir: Optional[str], events, say: Callable[[str], None], watchdog=None,
                 keep_dir: Optional[str] = None):
        self.log_dir = log_dir
        self.keep_dir = keep_dir   # where the gathered dumps go without a log dir: kept after the exit
        self.events = events
        self.say = say
        self.enabled = buffer_size(dict(os.environ)) > 0
        self.dir: Optional[str] = None
        self._cycle: Optional[_Cycle] = None
        self._cycles: List[_Cycle] = []
        self._analyses: List[threading.Thread] = []
        # Called with the cycle's number (on the cycle's thread) when a dump is requested, before
        # this node's part is done and so before any hung rank is resumed (computed timeouts).
        self.on_request: Optional[Callable[[int], None]] = None
        # Called with the cycle's number (on the cycle's thread) once the job's dump is complete or
        # given up: the monitors holding hung ranks for it may go on.
        self.on_done: Optional[Callable[[int], None]] = None
        if not self.enabled:
            say("flight recorder off (TORCH_FR_BUFFER_SIZE=0): a hang is reported with Python stacks only")
            return
        self.dir = tempfile.mkdtemp(prefix=f"ft_launcher_fr_{os.getpid()}_")   # the agent pid: a node-loss test finds it
        if watchdog is not None:
            watchdog.remove_at_exit(self.dir)   # also when the agent is SIGKILLed
        os.environ[FR.ENV_FR_DIR] = self.dir   # monitors and ranks started from now on inherit it

    def start_cycle(self, store, rnd, node_id: str, ranks: Callable[[], List[Tuple[int, int]]]) -> None:
        """Serve dump requests of this cycle; `ranks()`: this node's (local_rank, rank) pairs."""
        if not self.enabled:
            return
        try:
            client = store.new_client(label="flight_recorder")
        except Exception as exc:  # noqa: BLE001 - without it there is no job-wide dump, nothing worse
            self.say(f"warning: no flight-recorder dumps in cycle {rnd.number}: {exc}")
            return
        self._cycle = _Cycle(self, store, client, rnd, node_id, ranks)
        self._cycles = [c for c in self._cycles if c.is_alive()] + [self._cycle]
        self._cycle.start()

    def hang(self, report: dict) -> None:
        """A monitor found a hang: ask for the job's dump (the first agent to ask gathers it)."""
        cycle = self._cycle
        if cycle is None or report.get("cycle") != cycle.number:
            return
        cycle.request(report)

    def end_cycle(self, store_ok: bool = True) -> None:
        """The cycle is over: let a dump in progress finish (bounded) before the ranks are stopped.
        `store_ok` False (the store is lost): no store call, the thread ends within WAIT_SLICE."""
        cycle, self._cycle = self._cycle, None
        if cycle is not None:
            cycle.finish(store_ok)

    def settle(self, wait: float = ANALYZER_TIMEOUT) -> None:
        """Before the job's last word: let the analyses finish (bounded), so a `flight_recorder`
        event never follows `job_complete` or `job_failed` in the event file."""
        deadline = time.monotonic() + wait
        for thread in self._analyses:
            thread.join(max(0.0, deadline - time.monotonic()))

    def close(self, wait: float = ANALYZER_TIMEOUT) -> None:
        """At the agent's exit: let the analyses finish (bounded), remove the dump directory."""
        self.end_cycle()
        deadline = time.monotonic() + wait
        for cycle in self._cycles:   # none may be inside torch's store code when the interpreter exits
            cycle.join(min(WAIT_SLICE + 1.0, max(0.0, deadline - time.monotonic())))
        self.settle(max(0.0, deadline - time.monotonic()))
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _analyze_later(self, *args) -> None:
        thread = threading.Thread(target=self._analyze, args=args, name="ft-fr-analysis", daemon=True)
        self._analyses.append(thread)
        thread.start()

    # ---- the gathering agent's part -------------------------------------------------------
    def _analyze(self, number: int, dumps: Dict[int, bytes], skipped: Dict[int, str], world: int,
                 hang: dict) -> None:
        base = self.log_dir or self.keep_dir or self.dir
        out_dir = os.path.join(base, f"cycle_{number}", "flight_recorder")
        for rank in [r for r, data in dumps.items() if FR.load_trace(data) is None]:
            del dumps[rank]   # torch's analyzer unpickles what it reads: only plain data goes to it
            skipped[rank] = "its dump is not a flight-recorder trace of plain data"
        try:
            os.makedirs(out_dir, exist_ok=True)
            for rank, data in dumps.items():
                with open(os.path.join(out_dir, f"rank_{rank}"), "wb") as fh:
                    fh.write(_fix_pg_config(data))
        except OSError as exc:
            self.say(f"warning: cannot write the flight-recorder dumps to {out_dir}: {exc.strerror or exc}")
            return
        detail = {"dir": out_dir, "dumped": sorted(dumps), "skipped": {str(r): why for r, why in sorted(skipped.items())},
                  "hang_rank": hang.get("rank")}
        if not dumps:
            message = f"flight recorder: no rank dumped a trace in cycle {number} (the Python stack dumps stand)"
            self.events.event("flight_recorder", message, cycle=number, summary=message, **detail)
            return
        found, text, problem = run_analyzer(out_dir, all_ranks=len(dumps) == world)
        try:
            with open(os.path.join(out_dir, "fr_trace.txt"), "w") as fh:
                fh.write(text)
        except OSError:
            pass
        detail.update(found)
        waiting = waiting_in(dumps)
        detail["waiting"] = {str(r): w for r, w in waiting.items()}
        if problem:
            message = (f"flight recorder: dumps of ranks {_ranks(dumps)} in {out_dir}; torch's analyzer "
                       f"{problem} (the Python stack dumps stand)")
        elif found.get("collective"):
            message = (f"flight recorder: {found['collective']} (sequence {found.get('sequence', '?')}, group "
                       f"{found.get('group', '?')}) in cycle {number} never completed: rank{'s' if len(found['missing_ranks']) != 1 else ''} "
                       f"{_ranks(found['missing_ranks'])} never joined it (dumps of ranks {_ranks(dumps)} in {out_dir})")
        else:
            missed = re.search(r"missed FR dumps from ranks \(\{([^}]*)\}\)", text)
            why = (f"cannot decide without the dump of rank(s) {missed.group(1)}" if missed
                   else "found no collective that some ranks never joined")
            message = (f"flight recorder: cycle {number}: torch's analyzer {why} (dumps of ranks {_ranks(dumps)} "
                       f"in {out_dir})")
        if waiting:
            message += "; " + ", ".join(f"rank {r} waits in {w}" for r, w in sorted(waiting.items()))
        if skipped:
            message += "; no dump from " + ", ".join(f"rank {r} ({why})" for r, why in sorted(skipped.items()))
        self.events.event("flight_recorder", message, cycle=number, summary=message, **detail)


class _Halted(Exception):
    """The cycle ended while its dump service waited."""


class _Cycle(threading.Thread):
    """One cycle's dump service on one agent (its own store connection)."""

    def __init__(self, owner: FlightRecorder, store, client, rnd, node_id: str, ranks):
        super().__init__(name="ft-flight-recorder", daemon=True)
        self.owner, self.store, self.s = owner, store, client
        self.number = rnd.number
        self.world = rnd.world_size
        self.nodes = rnd.nnodes
        self.node_id = node_id
        self.ranks = ranks
        self.asked = False
        self.served = threading.Event()
        self.halt = threading.Event()

    def k(self, name: str) -> str:
        return self.store.key(store_keys.flight(self.number, name))

    def request(self, report: dict) -> None:
        value = json.dumps({"node": self.node_id, "rank": report.get("rank"), "time": time.time(),
                            "section": report.get("section"), "reason": report.get("reason")})
        try:
            won = self.store.client.compare_set(self.k("request"), "", value).decode() == value
        except Exception:  # noqa: BLE001 - a lost store is the agent's business, not ours
            return
        self.asked = self.asked or won

    def finish(self, store_ok: bool = True) -> None:
        self.halt.set()
        if not store_ok:
            return
        try:   # release our waiting thread when nobody asked (a cycle without a hang)
            self.store.client.compare_set(self.k("request"), "", CLOSED)
        except Exception:  # noqa: BLE001
            pass
        self.served.wait(FR.HOLD_SECONDS)

    def run(self) -> None:
        from ft_launcher.agent.rounds.store_client import StoreUnreachable

        try:
            self._run()
        except Exception as exc:  # noqa: BLE001 - never the job's end: say it and let monitors go on
            if not isinstance(exc, StoreUnreachable):   # a store gone at the cycle's end: nothing to say
                self.owner.say(f"warning: flight-recorder dump in cycle {self.number} failed: "
                               f"{str(exc).splitlines()[0] if str(exc) else repr(exc)}")
        finally:
            self.served.set()
            try:
                del self.s
            except AttributeError:
                pass

    def _run(self) -> None:
        from ft_launcher.agent.rounds.store_client import StoreTimeout, StoreUnreachable

        def halted():   # asked between the wait's local slices: no store traffic while it waits
            if self.halt.is_set():
                raise _Halted()

        self.s.stop = halted
        try:
            self.s.wait([self.k("request")])   # one WAIT, answered when a request (or CLOSED) is written
        except (_Halted, StoreTimeout, StoreUnreachable):   # the cycle ended, or the store is lost
            return
        finally:
            self.s.stop = None
        raw = self.s.get(self.k("request")).decode()
        if raw == CLOSED:
            return
        request = json.loads(raw)
        started = time.monotonic()
        if self.owner.on_request is not None:
            try:
                self.owner.on_request(self.number)
            except Exception:  # noqa: BLE001 - the dump goes on whatever this hook does
                pass
        dumps, skipped = self._dump_local()
        for rank, data in dumps.items():
            self.s.set(self.store.key(store_keys.flight_dump(self.number, rank)), data)
        for rank, why in skipped.items():
            self.s.set(self.store.key(store_keys.flight_skipped(self.number, rank)), why)
        if int(self.s.add(self.k("nodes_done"), 1)) >= self.nodes:
            self.s.set(self.k("all_done"), "1")
        left = started + JOB_WAIT - time.monotonic()
        if left > 0:
            try:
                self.s.wait([self.k("all_done")], left)
            except Exception:  # noqa: BLE001 - a node that did not finish in time is named below
                pass
        if self.owner.on_done is not None:   # the monitors may go on
            try:
                self.owner.on_done(self.number)
            except Exception:  # noqa: BLE001 - a monitor that missed it goes on after HOLD_SECONDS
                pass
        self.served.set()
        if request.get("node") != self.node_id:
            return
        dumps, skipped = {}, {}
        for rank in range(self.world):
            if self.s.check([self.store.key(store_keys.flight_dump(self.number, rank))]):
                data = self.s.get(self.store.key(store_keys.flight_dump(self.number, rank)))
                trace, why = read_trace(data)
                if trace is None:
                    skipped[rank] = f"its dump in the store was not read: {why}"
                else:
                    dumps[rank] = data
            elif self.s.check([self.store.key(store_keys.flight_skipped(self.number, rank))]):
                why = self.s.get(self.store.key(store_keys.flight_skipped(self.number, rank)))
                skipped[rank] = (why.decode("utf-8", "replace").splitlines() or ["no reason given"])[0]
            else:
                skipped[rank] = f"its node did not answer within {JOB_WAIT:g}s"
        self.owner._analyze_later(self.number, dumps, skipped, self.world, request)

    def _dump_local(self) -> Tuple[Dict[int, bytes], Dict[int, str]]:
        """Ask this node's ranks to dump; each gets RANK_WAIT seconds."""
        fr_dir = self.owner.dir
        pending, skipped = {}, {}
        for local_rank, rank in self.ranks():
            for path in (FR.dump_path(fr_dir, local_rank, self.number), FR.error_path(fr_dir, local_rank, self.number)):
                try:
                    os.unlink(path)
                except OSError:
                    pass
            try:
                fd = os.open(FR.pipe_path(fr_dir, local_rank), os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                skipped[rank] = "nothing reads its dump pipe: it is stopped, has exited, or does not run ft_launcher's client"
                continue
            try:
                os.write(fd, f"{self.number}\n".encode())
            except OSError as exc:
                skipped[rank] = f"cannot ask it ({exc.strerror or exc})"
                continue
            finally:
                os.close(fd)
            pending[rank] = local_rank
        dumps: Dict[int, bytes] = {}
        deadline = time.monotonic() + RANK_WAIT
        while pending:
            for rank, local_rank in list(pending.items()):
                try:
                    with open(FR.dump_path(fr_dir, local_rank, self.number), "rb") as fh:
                        dumps[rank] = fh.read()
                    del pending[rank]
                    continue
                except FileNotFoundError:
                    pass
                try:
                    with open(FR.error_path(fr_dir, local_rank, self.number)) as fh:
                        skipped[rank] = fh.read().strip() or "it failed to dump"
                    del pending[rank]
                except FileNotFoundError:
                    pass
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(0.005)
        for rank in pending:
            skipped[rank] = (f"no dump within {RANK_WAIT:g}s: stopped, or holding the GIL in native code")
        for rank, why in skipped.items():
            self.owner.say(f"flight recorder: rank {rank} skipped: {why}")
        return dumps, skipped


def run_analyzer(trace_dir: str, all_ranks: bool) -> Tuple[dict, str, Optional[str]]:
    """Run torch's analyzer on `trace_dir` -> (what it found, its output, a problem or None)."""
    cmd = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", trace_dir, "-p", "rank_"]
    if not all_ranks:
        cmd.append("--allow-incomplete-ranks")
    try:   # at low priority: the restart it runs beside matters more
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                stdin=subprocess.DEVNULL)
    except OSError as exc:
        return {}, "", f"could not run ({exc})"
    try:
        os.setpriority(os.PRIO_PROCESS, proc.pid, 10)
    except OSError:
        pass
    try:
        text, _ = proc.communicate(timeout=ANALYZER_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {}, "", f"did not finish within {ANALYZER_TIMEOUT:g}s"
    res = proc
    if res.returncode != 0:
        last = [line for line in text.splitlines() if line.strip()]
        if "No module named" in text and "flight_recorder" in text:
            return {}, text, "is not in this torch (torch.distributed.flight_recorder)"
        return {}, text, f"failed (exit {res.returncode}: {last[-1].strip() if last else 'no output'})"
    return parse_analysis(text), text, None


def parse_analysis(text: str) -> dict:
    """The first mismatch torch's analyzer printed: collective, sequence, group, missing ranks."""
    found: dict = {}
    patterns = {"sequence": r"sequence number:\s*(\d+)", "group": r"group info:\s*(\S+)",
                "collective": r"^collective:\s*(\S+)", "missing_ranks": r"missing ranks:\s*\{([^}]*)\}",
                "state": r"collective state:\s*(\S+)"}
    for key, pattern in patterns.items():
        match = re.search(pattern, text, re.MULTILINE)
        if match:
            found[key] = match.group(1)
    if "missing_ranks" in found:
        found["missing_ranks"] = sorted(int(r) for r in found["missing_ranks"].replace(",", " ").split())
    if "sequence" in found:
        found["sequence"] = int(found["sequence"])
    if "collective" in found and "missing_ranks" not in found:
        found["missing_ranks"] = []
    return found


def waiting_in(dumps: Dict[int, bytes]) -> Dict[int, str]:
    """Per rank, the oldest collective of its dump that was not retired: where it waits."""
    out = {}
    for rank, data in dumps.items():
        trace = FR.load_trace(data)
        entries = [e for e in (trace or {}).get("entries") or [] if isinstance(e, dict)]
        pending = [e for e in entries if not e.get("retired") and e.get("state") != "completed"]
        if pending:
            e = pending[0]
            group = tuple(e.get("process_group") or ())
            where = f", group {':'.join(map(str, group))}" if group and group[-1] != "default_pg" else ""
            out[rank] = f"{e.get('profiling_name', '?')} (sequence {e.get('collective_seq_id', '?')}{where})"
    return out


def _fix_pg_config(data: bytes) -> bytes:
    """gloo (torch 2.13) records the default group's config under '' while its entries name the
    group ('0', 'default_pg'): name the config after the entries so the analyzer can match them."""
    trace = FR.load_trace(data)
    if trace is None:
        return data
    try:
        config = trace.get("pg_config") or {}
        if set(config) != {""}:
            return data
        groups = {tuple(e["process_group"]) for e in trace.get("entries", []) if e.get("process_group")}
        if len(groups) != 1:
            return data
        (name, desc), = groups
        trace["pg_config"] = {name: dict(config[""], name=name, desc=desc)}
        return pickle.dumps(trace)
    except Exception:  # noqa: BLE001 - not ours to judge: the analyzer gets it as it is
        return data


def _ranks(ranks) -> str:
    return ", ".join(str(r) for r in sorted(ranks))
