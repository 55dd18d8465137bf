"""`ft_launcher report LOGDIR... [-o FILE]`: what happened in a job, from its events.jsonl (one log
dir, or several merged: one per node under SLURM), as one self-contained HTML file (the timeline
is a PNG drawn with matplotlib, embedded as base64: no network needed to view it) and a one-screen
summary on the console.

Works on a finished job and on a running one: a last line still being written is skipped, and the
running cycle's time in `step` comes from the agents' status files (agent.observation.job_status).

What it computes:
- goodput: seconds every rank spent in completed `step` sections that were never redone, over
  world size x wall time (first cycle start to the job's end, or now). A cycle followed by a
  restart keeps only its steps up to its last completed `checkpointing` section (the job resumes
  from there and does the rest again; agent.observation.job_status.kept_work); the `cycle_summary` events
  carry each rank's step count and seconds at that checkpoint; a cycle whose successor resumed
  from live state (a `live_recovery` event) keeps its steps up to the resume step. Hung time, restarts, start-up and
  checkpointing are loss: no `step` completes in them;
- per incident (a cycle that ended in a failure): which rank, what happened (simulated fault,
  hang, exit status; for a hang the hang blame decided, the rank that hung and the ranks that
  were only waiting on it), who noticed (its monitor, or the agent from the exit status or a lost
  peer, or the rank itself for an exception raised under `ft_launcher.restartable`) after how
  long, the stack dumps, the flight recorder's finding on a hang (which collective never
  completed, and who never joined it), what was done (every rank restarted, or the healthy ranks
  restarted in place and which ranks or nodes were replaced, restart k/N, or the job failed), and
  how long until every rank stepped again (the agents' `stepping` events), and with live state
  where the job resumed and where each rank's state came from (the `live_recovery` event);
- computed-timeout changes (`timeout_computed`) and timeouts loaded from ft_state.json.
matplotlib is an optional dependency (`pip install ft_launcher[report]`).
"""
from __future__ import annotations

import base64
import dataclasses
import glob
import html
import io
import json
import os
import sys
import time
import urllib.parse
from typing import Dict, List, Optional, Sequence, Tuple

PROG = "ft_launcher report"
END_KINDS = ("job_complete", "job_failed", "job_stopped", "rendezvous_failed", "store_lost")


class ReportError(Exception):
    pass


# ---- reading ------------------------------------------------------------------------------------
def read_events(path: str) -> Tuple[List[dict], bool]:
    """The records of one events.jsonl, and whether its last line was cut short (a running job)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise ReportError(f"cannot read {path}: {exc.strerror or exc}") from None
    lines = data.split(b"\n")
    truncated = False
    records = []
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
            if not isinstance(record, dict) or not isinstance(record.get("kind"), str) \
                    or not isinstance(record.get("time"), (int, float)):
                raise ValueError("not an event")
        except (ValueError, UnicodeDecodeError):
            if number == len(lines):  # no newline after it: still being written
                truncated = True
                continue
            raise ReportError(f"{path} line {number}: not an ft_launcher event (garbage JSONL?)") from None
        record.setdefault("detail", {})
        if not isinstance(record["detail"], dict):
            record["detail"] = {}
        records.append(record)
    return records, truncated


def load(dirs: Sequence[str]) -> Tuple[List[dict], List[dict], List[str]]:
    """(events merged in time order, status files, notes) of the given log dirs."""
    events, statuses, notes, seen = [], [], [], set()
    for d in dirs:
        if not os.path.isdir(d):
            raise ReportError(f"log dir not found: {d}")
        path = os.path.join(d, "events.jsonl")
        if not os.path.isfile(path):
            raise ReportError(f"no events.jsonl in {d} (was the job run with --log-dir {d}?)")
        records, truncated = read_events(path)
        if truncated:
            notes.append(f"{path}: the last line is incomplete (the job is still writing it); skipped")
        for r in records:
            key = json.dumps(r, sort_keys=True)
            if key not in seen:  # the same dir named twice, or a shared dir: count each event once
                seen.add(key)
                events.append(r)
        for sp in sorted(glob.glob(os.path.join(d, "status", "*.json"))):
            try:
                with open(sp) as fh:
                    statuses.append(json.load(fh))
            except (OSError, ValueError):
                continue
    if not events:
        raise ReportError(f"no events yet in {', '.join(dirs)}")
    events.sort(key=lambda r: r["time"])
    return events, statuses, notes


# ---- analysis -----------------------------------------------------------------------------------
@dataclasses.dataclass
class Incident:
    cycle: int
    rank: Optional[int]
    node: object
    what: str                         # what happened, one phrase
    cause: str                        # simulated fault / hang / exit status / lost peer
    noticed_by: str
    fault_time: float                 # when it went wrong (fault injected, section entered, exit)
    detect_time: float
    action: str
    stack_dumps: List[str]
    recovered_time: Optional[float]   # every rank stepping again (None: not yet / never)
    hang_timeout: Optional[float] = None
    flight_recorder: Optional[str] = None   # the flight recorder's finding on a hang (its line)

    @property
    def detected_after(self) -> float:
        return max(0.0, self.detect_time - self.fault_time)

    @property
    def recovery(self) -> Optional[float]:
        return None if self.recovered_time is None else max(0.0, self.recovered_time - self.fault_time)


@dataclasses.dataclass
class Job:
    dirs: List[str]
    events: List[dict]
    notes: List[str]
    start: float
    end: float
    state: str
    run_id: str
    nodes: List[object]
    world_size: int
    max_restarts: Optional[int]
    cycles: Dict[int, dict]               # cycle -> {start, end, world_size, stepping (time or None)}
    lanes: List[Tuple[object, int]]       # (node, rank)
    bars: List[dict]                      # {node, rank, cycle, start, first_step, end}
    incidents: List[Incident]
    step_seconds: Dict[int, float]        # rank -> seconds in completed steps
    timeout_changes: List[dict]
    goodput: float                        # useful step seconds over world size x wall time
    useful_seconds: Dict[int, float]      # rank -> seconds in completed steps never redone
    redone: Dict[int, list]               # rank -> [steps, seconds] done again after a restart


def _by_kind(events, *kinds):
    return [e for e in events if e["kind"] in kinds]


def analyse(dirs: Sequence[str], events: List[dict], statuses: List[dict], notes: List[str],
            now: Optional[float] = None) -> Job:
    starts = _by_kind(events, "cycle_start")
    start = min(e["time"] for e in (starts or events))
    ended = _by_kind(events, *END_KINDS)
    if ended:
        end = max(e["time"] for e in ended)
        last = max(ended, key=lambda e: e["time"])
        state = {"job_complete": "complete", "job_failed": "failed (restart budget spent)",
                 "job_stopped": f"stopped by signal {last['detail'].get('signal')}"}.get(last["kind"], last["kind"])
    else:
        latest = max([e["time"] for e in events] + [s.get("time", 0) for s in statuses])
        end = latest
        state = "running (as of its last event)" if not statuses else "running (as of its last status update)"
        if statuses and all(s.get("state") == "finished" for s in statuses):
            state = "ended (exit code " + ", ".join(sorted({str(s.get("exit_code")) for s in statuses})) + ")"
    run_id = next((s.get("rdzv_id") for s in statuses if s.get("rdzv_id")), None) or "?"
    max_restarts = next((s.get("max_restarts") for s in statuses if s.get("max_restarts") is not None), None)

    cycles: Dict[int, dict] = {}
    for e in starts:
        c = cycles.setdefault(e["cycle"], {"start": e["time"], "end": None, "world_size": 0, "stepping": None,
                                           "first_steps": {}, "nodes": set()})
        c["start"] = min(c["start"], e["time"])
        c["world_size"] = max(c["world_size"], int(e["detail"].get("world_size") or 0))
        c["nodes"].add(e["node"])
    for e in _by_kind(events, "stepping"):
        c = cycles.get(e["cycle"])
        if c is not None:
            c["first_steps"].update({int(r): t for r, t in e["detail"].get("first_step", {}).items()})
    for e in _by_kind(events, "cycle_summary"):
        c = cycles.get(e["cycle"])
        if c is not None:
            for r, info in (e["detail"].get("ranks") or {}).items():
                if info.get("first_step") is not None:
                    c["first_steps"].setdefault(int(r), info["first_step"])
    for number, c in cycles.items():
        if c["world_size"] and len(c["first_steps"]) >= c["world_size"]:
            c["stepping"] = max(c["first_steps"].values())
        nxt = [o["start"] for n, o in cycles.items() if n > number]
        closing = [e["time"] for e in events if e["cycle"] == number
                   and e["kind"] in ("restart", "cycle_summary") + END_KINDS]
        c["end"] = min(nxt) if nxt else (max(closing) if closing else end)
        if not nxt and not ended:
            c["end"] = end

    # one bar per rank per cycle
    bars, lanes = [], set()
    exits = {(e["cycle"], e["rank"]): e["time"] for e in _by_kind(events, "rank_exit")}
    steps = {(e["cycle"], int(r)): ((info.get("sections") or {}).get("step") or {}).get("count")
             for e in _by_kind(events, "cycle_summary") for r, info in (e["detail"].get("ranks") or {}).items()}
    for e in _by_kind(events, "ranks_started"):
        c = cycles.get(e["cycle"])
        for r in e["detail"].get("ranks") or []:
            rank = r.get("rank")
            lanes.add((e["node"], rank))
            stop = c["end"] if c else end
            stop = exits.get((e["cycle"], rank), stop)
            bars.append({"node": e["node"], "rank": rank, "cycle": e["cycle"], "start": e["time"],
                         "first_step": c["first_steps"].get(rank) if c else None, "end": stop, "warm": r.get("warm"),
                         "steps": steps.get((e["cycle"], rank))})
    lanes = sorted(lanes, key=lambda nr: (str(nr[0]).isdigit() is False, str(nr[0]).zfill(6), nr[1]))

    incidents = []
    for number in sorted({e["cycle"] for e in _by_kind(events, "failure") if e["cycle"] is not None}):
        incidents.append(_incident(number, events, cycles, max_restarts))

    step_seconds, useful, redone = _goodput_parts(events, statuses, cycles, ended_ok=not ended or state == "complete")
    world = max([c["world_size"] for c in cycles.values()] + [len(step_seconds), 1])
    wall = max(1e-9, end - start)
    goodput = sum(useful.values()) / (world * wall)

    changes = []
    for e in _by_kind(events, "timeout_computed", "timeouts_loaded"):
        d = e["detail"]
        if e["kind"] == "timeout_computed":
            changes.append({"time": e["time"], "cycle": e["cycle"], "key": d.get("key"), "old": d.get("old"),
                            "new": d.get("new"), "why": f"max {_num(d.get('max'))} s over {d.get('count')} observations"})
        else:
            for key, value in (d.get("timeouts") or {}).items():
                changes.append({"time": e["time"], "cycle": e["cycle"], "key": key, "old": None, "new": value,
                                "why": "loaded from ft_state.json"})
    nodes = sorted({e["node"] for e in starts}, key=str)
    return Job(list(dirs), events, notes, start, end, state, run_id, nodes, world, max_restarts, cycles,
               lanes, bars, incidents, step_seconds, changes, goodput, useful, redone)


def _goodput_parts(events: List[dict], statuses: List[dict], cycles: Dict[int, dict], ended_ok: bool):
    """({rank: seconds in completed steps}, {rank: of them, seconds in steps never redone},
    {rank: [steps, seconds] redone}). A cycle that a later cycle follows (a restart), or the last
    one of a failed or stopped job, keeps only its steps up to its last checkpoint
    (agent.observation.job_status.kept_work); the last cycle of a complete or running job keeps every step."""
    from ft_launcher.agent.observation.job_status import kept_work

    per_cycle: Dict[int, Dict[int, dict]] = {}
    for e in _by_kind(events, "cycle_summary"):
        for r, info in (e["detail"].get("ranks") or {}).items():
            step = (info.get("sections") or {}).get("step") or {}
            per_cycle.setdefault(e["cycle"], {})[int(r)] = {
                "steps": int(step.get("count", 0)), "step_total": float(step.get("total", 0.0)),
                "at_checkpoint": info.get("at_checkpoint"), "live_step": info.get("live_step")}
    for s in statuses:  # the running cycle: from the status files
        if s.get("state") != "running" or s.get("cycle") is None:
            continue
        for row in s.get("ranks") or []:
            if row["rank"] in per_cycle.get(s["cycle"], {}):
                continue
            step = (row.get("sections") or {}).get("step") or {}
            per_cycle.setdefault(s["cycle"], {})[row["rank"]] = {
                "steps": int(step.get("count", 0)), "step_total": float(step.get("total", 0.0)), "at_checkpoint": None}
    last = max(list(cycles) + list(per_cycle), default=None)
    # a cycle resumed from live state (agent.recovery.live_recovery): the one before keeps its steps up to there
    live = {e["cycle"]: e["detail"].get("resume_step") for e in _by_kind(events, "live_recovery")}
    step_seconds: Dict[int, float] = {}
    useful: Dict[int, float] = {}
    redone: Dict[int, list] = {}
    for number, ranks in sorted(per_cycle.items()):
        kept = ({r: (w["steps"], w["step_total"]) for r, w in ranks.items()} if number == last and ended_ok
                else kept_work(ranks, live.get(number + 1)))
        for rank, w in ranks.items():
            steps, seconds = kept[rank]
            step_seconds[rank] = step_seconds.get(rank, 0.0) + w["step_total"]
            useful[rank] = useful.get(rank, 0.0) + seconds
            acc = redone.setdefault(rank, [0, 0.0])
            acc[0] += w["steps"] - steps
            acc[1] += max(0.0, w["step_total"] - seconds)
    return step_seconds, useful, redone


def _num(value) -> str:
    return "?" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)


def _incident(number: int, events: List[dict], cycles: Dict[int, dict], max_restarts: Optional[int]) -> Incident:
    mine = [e for e in events if e["cycle"] == number]
    failure = _by_kind(mine, "failure")[0]
    d = failure["detail"]
    faults = _by_kind(mine, "fault_injected")
    hangs = [h for h in _by_kind(mine, "hang") if h["time"] <= failure["time"] + 1e-3] or _by_kind(mine, "hang")
    dumps = [e["detail"].get("stack_file") for e in _by_kind(mine, "stack_dump") if e["detail"].get("stack_file")]
    rank = failure.get("rank")
    hang_timeout = None
    blame = next((b["detail"] for b in _by_kind(mine, "hang_blame") if b["detail"].get("culprits")), None)
    if hangs:
        h = _blamed_hang(failure, hangs, blame)
        hd = h["detail"]
        rank = h.get("rank") if h.get("rank") is not None else rank
        what, noticed = _hang_words(h)
        if blame:   # the hang blame named the rank that hung; the others only waited on it
            if rank not in blame["culprits"]:   # its monitor had not fired: its agent killed it
                rank = blame["culprits"][0]
                what = f"rank {rank} hung (killed by its agent on the hang blame before its monitor fired)"
            what += _waiting_words(blame)
        detect = h["time"]
        started = detect - float(hd.get("elapsed") or 0.0)  # the monitor's clock: the section's entry
        hang_timeout = hd.get("timeout")
    elif d.get("dead_nodes"):
        what, detect, started = d.get("what", "a node stopped answering"), failure["time"], failure["time"]
        noticed = f"the agent on node {failure['node']} (the peer's keep-alives stopped)"
    elif d.get("exception"):
        what, detect, started = d.get("what", "a failure"), failure["time"], failure["time"]
        noticed = "the rank itself (its restartable function raised and reported it)"
    else:
        what, detect, started = d.get("what", "a failure"), failure["time"], failure["time"]
        noticed = f"the agent on node {failure['node']} (the rank's exit status {d.get('exitcode')})"
    cause = "an exception" if d.get("exception") else "a real failure"
    fault_time = started
    if faults:
        f = faults[0]
        cause = f"simulated {f['detail'].get('fault')} injected into rank {f.get('rank')}"
        if not hangs:  # a hang is timed as its monitor timed it: from the hung section's entry
            fault_time = f["time"]
            what = d.get("what", what)
        if rank is None:
            rank = f.get("rank")  # the rank the fault hit
    elif hangs:
        cause = "a hang"
    restarts = _by_kind(mine, "restart")
    failed = _by_kind(mine, "job_failed")
    if restarts:
        r = restarts[0]["detail"]
        budget = f"/{max_restarts}" if max_restarts is not None else ""
        action = f"{_restart_words(r)}: cycle {r.get('next_cycle')} (restart {r.get('restarts_used')}{budget})"
        # the first later cycle in which every rank stepped (a cycle may fail before its first step)
        recovered = next((c["stepping"] for n, c in sorted(cycles.items()) if n > number and c["stepping"]), None)
    elif failed:
        action, recovered = "restart budget spent: the job failed (exit 1)", None
    else:
        action, recovered = "(no decision recorded yet)", None
    # a kept rank that missed its restart point is told as the next cycle starts
    nxt = restarts[0]["detail"].get("next_cycle") if restarts else None
    late = [e for e in _by_kind(events, "inprocess_timeout") if nxt is not None and e["cycle"] == nxt]
    if late:
        action += ("; " + ", ".join(f"rank {e.get('rank')}" for e in late)
                   + " did not reach its restart point in time and started afresh")
    told = [e["detail"] for e in _by_kind(events, "live_recovery") if nxt is not None and e["cycle"] == nxt]
    if told:
        action += "; " + live_words(told[0])
    found = _by_kind(mine, "flight_recorder")
    return Incident(number, rank, failure["node"], what, cause, noticed, fault_time, detect, action, dumps,
                    recovered, hang_timeout, found[0]["detail"].get("summary") if found else None)


def live_words(live: dict) -> str:
    """A live_recovery event in words: where the job resumed and where each rank's state came from."""
    if live.get("resume_step") is None:
        return f"no live state ({live.get('reason')}): every rank loaded its checkpoint"
    from ft_launcher.agent.recovery.live_recovery import source_words

    sources = source_words(live.get("sources"), kept=False)
    rate = f" at {live['mb_per_s']:g} MB/s" if live.get("mb_per_s") else ""
    return (f"live state: resumed at step {live['resume_step']}, {live.get('steps_redone', 0)} completed "
            f"step(s) redone; {sources or 'every rank kept its state'}{rate}")


def _blamed_hang(failure: dict, hangs: List[dict], blame: Optional[dict] = None) -> dict:
    """The hang of the rank the hang blame found hung, else the one the agent's failure event (its
    console line) names, else the first one."""
    culprit = next((h for h in hangs if blame and h.get("rank") in blame["culprits"]), None)
    if culprit is not None:
        return culprit
    blamed = (failure["detail"].get("hang") or {}).get("rank", failure.get("rank"))
    return next((h for h in hangs if h.get("rank") == blamed and h["node"] == failure["node"]), hangs[0])


def _waiting_words(blame: dict) -> str:
    """'; rank 0 was waiting on it (...)': the victims of a hang blame verdict, and its evidence."""
    victims = blame.get("victims") or []
    if not victims:
        return ""
    how = ("the flight recorder: they had entered " + str(blame.get("collective", "a collective"))
           if blame.get("evidence") == "flight recorder" else
           "their stacks: inside a collective" if blame.get("evidence") == "stacks" else str(blame.get("evidence")))
    many = len(victims) > 1
    return (f"; rank{'s' if many else ''} {', '.join(map(str, victims))} {'were' if many else 'was'} waiting on it "
            f"(by {how})")


def _hang_words(hang: dict) -> Tuple[str, str]:
    """(what happened, who noticed) for the blamed hang, in the words and numbers of its event."""
    hd = hang["detail"]
    place = f"section '{hd['section']}'" if hd.get("section") else str(hd.get("reason", "?")).replace("_", " ")
    what = f"rank {hang.get('rank')} hung in {place}"
    noticed = (f"its rank monitor ({place} open {float(hd.get('elapsed') or 0):.2f} s > timeout "
               f"{_num(hd.get('timeout'))} s)")
    return what, noticed


def _restart_words(restart: dict) -> str:
    """How a restart event restarted the job: every rank, or in place and what was replaced."""
    if restart.get("rung") != "in_process":
        return "restarted every rank"
    words = "restarted in place (healthy ranks kept their processes"
    if restart.get("replace_nodes"):
        words += "; node " + ", ".join(map(str, restart["replace_nodes"])) + " restarted all its ranks"
    if restart.get("replace_ranks"):
        words += "; rank " + ", ".join(map(str, restart["replace_ranks"])) + " replaced after failing again at once"
    return words + ")"


# ---- output -------------------------------------------------------------------------------------
def _fmt(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{seconds:.2f} s"


def incident_line(job: Job, inc: Incident) -> str:
    t = inc.fault_time - job.start
    rec = (f"every rank stepping again {inc.recovery:.2f} s after it" if inc.recovery is not None
           else "" if "restarted" not in inc.action or not _by_kind(job.events, "stepping")
           else "not every rank stepping again yet")
    return (f"cycle {inc.cycle} at +{t:.1f} s: {inc.what} ({inc.cause}); noticed by {inc.noticed_by} after "
            f"{inc.detected_after:.2f} s; {inc.action}" + (f"; {rec}" if rec else "")
            + (f"\n    {inc.flight_recorder}" if inc.flight_recorder else ""))


def goodput_words(job: Job) -> str:
    """What goodput counted and what it left out, in rank-seconds."""
    wall = job.end - job.start
    steps, secs = sum(r[0] for r in job.redone.values()), sum(r[1] for r in job.redone.values())
    return (f"steps never redone {sum(job.useful_seconds.values()):.1f} rank-s of {job.world_size * wall:.1f} "
            f"rank-s; time in step {sum(job.step_seconds.values()):.1f} rank-s, of which {steps} step"
            f"{'s' if steps != 1 else ''} ({secs:.1f} rank-s) redone after restarting from a checkpoint")


def console_summary(job: Job, output: str) -> str:
    wall = job.end - job.start
    lines = [f"job {job.run_id!r}: {job.state}; {len(job.nodes)} node(s), {job.world_size} rank(s), "
             f"{len(job.cycles)} cycle(s), wall {wall:.1f} s",
             f"goodput {job.goodput * 100:.1f}% ({goodput_words(job)})"]
    lines.append(f"incidents: {len(job.incidents)}")
    lines += ["  " + incident_line(job, inc) for inc in job.incidents]
    if job.timeout_changes:
        lines.append("timeout changes:")
        lines += [f"  cycle {c['cycle']}: {c['key']} {_num(c['old'])} -> {_num(c['new'])} s ({c['why']})"
                  for c in job.timeout_changes]
    lines += job.notes
    lines.append(f"report: {output}")
    return "\n".join(lines)


def _hung_spans(job: Job, index: dict) -> List[Tuple[float, float, int]]:
    """(from, to, lane) for every hang: from the hung section's entry to the end of the rank's bar."""
    spans = []
    for h in _by_kind(job.events, "hang"):
        y = index.get((h["node"], h.get("rank")))
        bar = next((b for b in job.bars if (b["node"], b["rank"], b["cycle"]) == (h["node"], h.get("rank"), h["cycle"])),
                   None)
        if y is None or bar is None:
            continue
        since = h["time"] - float(h["detail"].get("elapsed") or 0.0)
        if since < bar["end"]:
            spans.append((since, bar["end"], y))
    return spans


def timeline_png(job: Job) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.lines import Line2D

    lanes = job.lanes or [(n, 0) for n in job.nodes]
    index = {lane: i for i, lane in enumerate(lanes)}
    height = 1.6 + 0.42 * len(lanes)
    fig, ax = plt.subplots(figsize=(12, height), dpi=110)
    t0 = job.start
    for inc in job.incidents:  # downtime: from the fault to every rank stepping again
        stop = inc.recovered_time if inc.recovered_time is not None else job.end
        ax.axvspan(inc.fault_time - t0, stop - t0, color="#d62728", alpha=0.13, lw=0)
    for bar in job.bars:
        y = index.get((bar["node"], bar["rank"]))
        if y is None:
            continue
        first = bar["first_step"] if bar["first_step"] is not None and bar["first_step"] < bar["end"] else None
        ax.barh(y, (first or bar["end"]) - bar["start"], left=bar["start"] - t0, height=0.55,
                color="#c7c7c7", edgecolor="none")
        if first is not None:
            ax.barh(y, bar["end"] - first, left=first - t0, height=0.55, color="#2ca02c", edgecolor="none")
            if bar.get("steps"):
                ax.text((first + bar["end"]) / 2 - t0, y, f"{bar['steps']} step{'s' if bar['steps'] != 1 else ''}", fontsize=7, color="white",
                        ha="center", va="center", clip_on=True)
    for since, end, y in _hung_spans(job, index):  # a hung rank is not stepping: from its section's entry
        ax.barh(y, end - since, left=since - t0, height=0.55, color="#ff7f0e", edgecolor="none")
    for i, (number, c) in enumerate(sorted(job.cycles.items())):  # labels alternate in height
        ax.axvline(c["start"] - t0, color="#555555", lw=0.8, ls=":")
        ax.text(c["start"] - t0, len(lanes) - 0.45 + 0.25 * (i % 2), f" cycle {number}", fontsize=8, va="bottom",
                color="#333333")
    marks = {"fault_injected": ("X", "#d62728", 90), "hang": ("v", "#ff7f0e", 70),
             "stack_dump": ("D", "#9467bd", 30), "failure": ("o", "#000000", 40)}
    for e in job.events:
        if e["kind"] not in marks:
            continue
        marker, color, size = marks[e["kind"]]
        rank = e.get("rank")
        ys = [index[(e["node"], rank)]] if (e["node"], rank) in index else \
            [i for (n, _), i in index.items() if n == e["node"]][:1]
        for y in ys:
            ax.scatter(e["time"] - t0, y + (0.33 if e["kind"] == "stack_dump" else 0), marker=marker, s=size,
                       color=color, zorder=5)
    for e in _by_kind(job.events, "restart"):
        ax.axvline(e["time"] - t0, color="#1f77b4", lw=1.2, ls="--")
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([f"node {n} rank {r}" for n, r in lanes], fontsize=9)
    ax.set_ylim(-0.7, len(lanes) + 0.1)
    ax.set_xlim(0, max(1.0, job.end - t0) * 1.01)
    ax.set_xlabel("seconds since the first cycle started")
    ax.grid(axis="x", alpha=0.3)
    handles = [Patch(color="#c7c7c7", label="starting (no step yet)"), Patch(color="#2ca02c", label="stepping"),
               Patch(color="#ff7f0e", label="hung (no step completes)"),
               Patch(color="#d62728", alpha=0.2, label="downtime (fault -> all stepping)"),
               Line2D([], [], marker="X", color="#d62728", ls="", label="fault injected"),
               Line2D([], [], marker="v", color="#ff7f0e", ls="", label="hang detected"),
               Line2D([], [], marker="D", color="#9467bd", ls="", label="stack dump"),
               Line2D([], [], marker="o", color="#000000", ls="", label="failure"),
               Line2D([], [], color="#1f77b4", ls="--", label="restart")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.set_title(f"job {job.run_id}: {job.state}, goodput {job.goodput * 100:.1f}%", fontsize=10)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


_CSS = """body{font-family:sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse;margin:.5em 0}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;font-size:13px}th{background:#f0f0f0}
.num{text-align:right}.big{font-size:20px;font-weight:bold}code{background:#f4f4f4}"""


def _stack_link(path: str, dirs: Sequence[str], out_dir: Optional[str]) -> str:
    """A stack dump as a link relative to the report's folder: the recorded path, or the file of
    that name in one of the log dirs (a log dir copied or moved since). A bare name when neither
    exists or the report's folder is unknown."""
    e = html.escape
    found = next((c for c in [path] + [os.path.join(d, os.path.basename(path)) for d in dirs] if os.path.isfile(c)),
                 None)
    if found is None or out_dir is None:
        return e(os.path.basename(path))
    href = os.path.relpath(os.path.abspath(found), os.path.abspath(out_dir))
    return f"<a href='{e(urllib.parse.quote(href))}'>{e(os.path.basename(path))}</a>"


def render_html(job: Job, png: bytes, out_dir: Optional[str] = None) -> str:
    """The page; `out_dir` (the folder the page is written to) makes stack dumps relative links."""
    e = html.escape
    wall = job.end - job.start
    rows = [("job", job.run_id), ("state", job.state), ("log dirs", ", ".join(job.dirs)),
            ("nodes", len(job.nodes)), ("ranks", job.world_size), ("cycles", len(job.cycles)),
            ("wall time", f"{wall:.1f} s"),
            ("restarts", f"{len(_by_kind(job.events, 'restart'))}" +
             (f" of {job.max_restarts}" if job.max_restarts is not None else "")),
            ("generated", time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))]
    out = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>ft_launcher report: {e(job.run_id)}</title>"
           f"<style>{_CSS}</style></head><body>",
           f"<h1>ft_launcher report: job {e(job.run_id)}</h1>",
           f"<p class='big' id='goodput'>goodput {job.goodput * 100:.1f}%</p>",
           f"<p id='goodput-parts'>{e(goodput_words(job))} ({job.world_size} ranks x {wall:.1f} s wall time). "
           "Goodput counts completed <code>step</code> sections that were never redone: steps after a "
           "cycle's last <code>checkpointing</code> section are done again after a restart.</p>",
           "<table id='summary'>" + "".join(f"<tr><th>{e(str(k))}</th><td>{e(str(v))}</td></tr>" for k, v in rows)
           + "</table>",
           "<h2>Timeline</h2>",
           f"<img id='timeline' alt='timeline' style='max-width:100%' src='data:image/png;base64,"
           f"{base64.b64encode(png).decode()}'>",
           f"<h2>Incidents ({len(job.incidents)})</h2>"]
    if job.incidents:
        out.append("<table id='incidents'><tr><th>cycle</th><th>at</th><th>rank</th><th>what happened</th>"
                   "<th>cause</th><th>noticed by</th><th>after</th><th>stack dumps</th><th>flight recorder</th>"
                   "<th>what was done</th>"
                   "<th>every rank stepping again after</th></tr>")
        for inc in job.incidents:
            out.append(
                f"<tr class='incident'><td>{inc.cycle}</td><td class='num'>+{inc.fault_time - job.start:.1f} s</td>"
                f"<td>{e(str(inc.rank))} (node {e(str(inc.node))})</td><td>{e(inc.what)}</td><td>{e(inc.cause)}</td>"
                f"<td>{e(inc.noticed_by)}</td><td class='num detected'>{inc.detected_after:.2f} s</td>"
                f"<td class='stacks'>{'<br>'.join(_stack_link(p, job.dirs, out_dir) for p in inc.stack_dumps) or '-'}</td>"
                f"<td class='flight-recorder'>{e(inc.flight_recorder or '-')}</td><td>{e(inc.action)}</td><td class='num recovery'>{_fmt(inc.recovery)}</td></tr>")
        out.append("</table>")
    else:
        out.append("<p>None: no cycle ended in a failure.</p>")
    out.append("<h2>Cycles</h2><table id='cycles'><tr><th>cycle</th><th>started</th><th>ended</th><th>ranks</th>"
               "<th>every rank stepping</th></tr>")
    for number, c in sorted(job.cycles.items()):
        stepping = "-" if c["stepping"] is None else f"+{c['stepping'] - job.start:.1f} s ({c['stepping'] - c['start']:.2f} s after its start)"
        out.append(f"<tr><td>{number}</td><td>+{c['start'] - job.start:.1f} s</td><td>+{c['end'] - job.start:.1f} s</td>"
                   f"<td>{c['world_size']}</td><td>{e(stepping)}</td></tr>")
    out.append("</table><h2>Time in step per rank</h2><table id='ranks'><tr><th>rank</th><th>seconds in step</th>"
               "<th>steps redone (seconds)</th><th>seconds in steps never redone</th><th>share of wall time</th></tr>")
    for rank, secs in sorted(job.step_seconds.items()):
        steps, lost = job.redone.get(rank, [0, 0.0])
        kept = job.useful_seconds.get(rank, 0.0)
        out.append(f"<tr><td>{rank}</td><td class='num'>{secs:.1f}</td><td class='num'>{steps} ({lost:.1f})</td>"
                   f"<td class='num'>{kept:.1f}</td><td class='num'>{kept / max(wall, 1e-9) * 100:.1f}%</td></tr>")
    out.append("</table><h2>Timeout changes</h2>")
    if job.timeout_changes:
        out.append("<table id='timeouts'><tr><th>cycle</th><th>timeout</th><th>old</th><th>new</th><th>why</th></tr>")
        for c in job.timeout_changes:
            out.append(f"<tr><td>{c['cycle']}</td><td>{e(str(c['key']))}</td><td>{e(_num(c['old']))}</td>"
                       f"<td>{e(_num(c['new']))}</td><td>{e(c['why'])}</td></tr>")
        out.append("</table>")
    else:
        out.append("<p>No computed timeout changed (computed timeouts are on with <code>--ft-calc-ft-timeouts true</code>).</p>")
    for note in job.notes:
        out.append(f"<p><i>{e(note)}</i></p>")
    out.append("</body></html>\n")
    return "\n".join(out)


def main(argv: Sequence[str]) -> int:
    from ft_launcher.cli import UsageError, _Parser

    parser = _Parser(prog=PROG, description="An HTML report (timeline, goodput, incidents, timeout changes) "
                     "of a job from its log dirs, and a summary on the console.")
    parser.add_argument("log_dirs", nargs="+", metavar="LOGDIR", help="the job's --log-dir (several: one per node)")
    parser.add_argument("-o", "--output", default=None, help="the HTML file (default LOGDIR/report.html)")
    try:
        args = parser.parse_args(list(argv))
    except UsageError as exc:
        print(f"ft_launcher: error: {exc}", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("ft_launcher: error: report needs matplotlib: pip install 'ft_launcher[report]'", file=sys.stderr)
        return 2
    output = args.output or os.path.join(args.log_dirs[0], "report.html")
    try:
        events, statuses, notes = load(args.log_dirs)
        job = analyse(args.log_dirs, events, statuses, notes)
        page = render_html(job, timeline_png(job), os.path.dirname(os.path.abspath(output)))
        try:
            with open(output, "w") as fh:
                fh.write(page)
        except OSError as exc:
            raise ReportError(f"cannot write {output}: {exc.strerror or exc}") from None
    except ReportError as exc:
        print(f"ft_launcher: error: {exc}", file=sys.stderr)
        return 2
    print(console_summary(job, os.path.abspath(output)))
    return 0
