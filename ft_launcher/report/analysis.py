"""What happened in a job, from its events: cycles, one bar per rank per cycle, incidents (a cycle
that ended in a failure: who, what, noticed by whom after how long, what was done, how long until
every rank stepped again), goodput and the steps redone, timeout changes.

Goodput: seconds every rank spent in completed `step` sections that were never redone, over world
size x wall time (first cycle start to the job's end, or now). A cycle followed by a restart keeps
only its steps up to the checkpoint the next cycle resumed from (agent.observation.job_status:
resume_point, kept_work), or with live state up to the resume step (a `live_recovery` event);
every restart path (a cold or warm restart, in place) resumes one of these two ways. Hung time,
restarts, start-up and checkpointing are loss: no `step` completes in them. A script without a
`step` section has no goodput to count (`Job.no_step`).

For the timeline: a rank that did not fail is drawn waiting from its cycle's fault to its bar's end
(it was blocked on the failed rank: in a collective, a barrier), the failed rank hung from its
hung section's entry; the span after the last rank ended, until the job's last event (the flight
recorder's analysis, the agents finishing), is `Job.tail`, with what it was.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from ft_launcher.report.reading import END_KINDS
from ft_launcher.report.wording import hang_words, live_words, num, restart_words, waiting_words


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
    culprits: Tuple[int, ...] = ()          # the ranks where it began (the failed rank, the hang blame's)
    resumed: Optional[str] = None           # where the next cycle resumed, and the steps redone (words)

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
    resumes: Dict[int, dict] = dataclasses.field(default_factory=dict)   # cycle -> where the next one resumed
    waiting: List[dict] = dataclasses.field(default_factory=list)   # {node, rank, cycle, start, end}: blocked
    tail: Optional[dict] = None           # {start, end, why}: after the last rank ended, until the job's end
    no_step: bool = False                 # no rank ever closed a `step` section: no goodput to count


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
    culprits = {inc.cycle: set(inc.culprits) for inc in incidents}

    step_seconds, useful, redone, resumes = _goodput_parts(events, statuses, cycles, culprits,
                                                           ended_ok=not ended or state == "complete")
    for inc in incidents:
        inc.resumed = resume_words(resumes.get(inc.cycle))
    world = max([c["world_size"] for c in cycles.values()] + [len(step_seconds), 1])
    wall = max(1e-9, end - start)
    goodput = sum(useful.values()) / (world * wall)
    no_step = not any("step" in ((info.get("sections") or {}))
                      for e in _by_kind(events, "cycle_summary") for info in (e["detail"].get("ranks") or {}).values()) \
        and not any(((row.get("sections") or {}).get("step") or {}).get("count") for s in statuses
                    for row in s.get("ranks") or [])

    changes = []
    for e in _by_kind(events, "timeout_computed", "timeouts_loaded"):
        d = e["detail"]
        if e["kind"] == "timeout_computed":
            changes.append({"time": e["time"], "cycle": e["cycle"], "key": d.get("key"), "old": d.get("old"),
                            "new": d.get("new"), "why": f"max {num(d.get('max'))} s over {d.get('count')} observations"})
        else:
            for key, value in (d.get("timeouts") or {}).items():
                changes.append({"time": e["time"], "cycle": e["cycle"], "key": key, "old": None, "new": value,
                                "why": "loaded from ft_state.json"})
    nodes = sorted({e["node"] for e in starts}, key=str)
    return Job(list(dirs), events, notes, start, end, state, run_id, nodes, world, max_restarts, cycles,
               lanes, bars, incidents, step_seconds, changes, goodput, useful, redone, resumes,
               _waiting(bars, incidents), _tail(events, bars, end, bool(ended)), no_step)


def _waiting(bars: List[dict], incidents: List[Incident]) -> List[dict]:
    """The ranks blocked on a failure: every rank of the failed cycle but the failed ones, from the
    fault to the end of its bar (whatever it was in, no step of it could complete: it waited in a
    collective or a barrier for the failed rank, then was stopped)."""
    spans = []
    for inc in incidents:
        for bar in bars:
            if bar["cycle"] != inc.cycle or bar["rank"] in inc.culprits:
                continue
            since = max(inc.fault_time, bar["start"])
            if since < bar["end"]:
                spans.append({"node": bar["node"], "rank": bar["rank"], "cycle": bar["cycle"], "start": since,
                              "end": bar["end"]})
    return spans


def _tail(events: List[dict], bars: List[dict], end: float, ended: bool) -> Optional[dict]:
    """What the job did after its last rank ended, when that took a while: the flight recorder's
    analysis of a hang (the agent waits for it before the job's last event), or the agents finishing."""
    if not bars or not ended:
        return None
    last = max(b["end"] for b in bars)
    if end - last < 0.5:
        return None
    analyses = [e for e in _by_kind(events, "flight_recorder") if e["time"] > last]
    if analyses:
        cycles = ", ".join(str(e["cycle"]) for e in analyses)
        why = (f"the flight recorder's analysis of the hang in cycle {cycles} (torch's fr_trace on every rank's dump), "
               f"which the job's last event waits for")
    else:
        why = "the agents finishing (the last status and events written, the store kept up until every node left)"
    return {"start": last, "end": end, "why": why}


def resume_words(resume: Optional[dict]) -> Optional[str]:
    """Where the cycle after an incident resumed, and how many steps it redid."""
    if not resume:
        return None
    redone = resume["redone"]
    steps = f"{redone} step{'s' if redone != 1 else ''} redone"
    if resume.get("live") is not None:
        return f"resumed from live state at step {resume['live']}: {steps}"
    where = f"its checkpoint after {resume['steps']} step{'s' if resume['steps'] != 1 else ''} of the cycle"
    return f"resumed from {where}: {steps}" + (f" ({resume['why']})" if resume.get("why") else "")


def _goodput_parts(events: List[dict], statuses: List[dict], cycles: Dict[int, dict],
                   culprits: Dict[int, set], ended_ok: bool):
    """({rank: seconds in completed steps}, {rank: of them, seconds in steps never redone},
    {rank: [steps, seconds] redone}, {cycle: {"steps", "why", "live", "redone"}: where the cycle
    after it resumed}). A cycle that a later cycle follows (a restart), or the last one of a failed
    or stopped job, keeps only its steps up to the checkpoint it resumes from, or with live state up
    to the resume step (agent.observation.job_status.kept_work); the last cycle of a complete or
    running job keeps every step."""
    from ft_launcher.agent.observation.job_status import kept_work, resume_point

    per_cycle: Dict[int, Dict[int, dict]] = {}
    for e in _by_kind(events, "cycle_summary"):
        for r, info in (e["detail"].get("ranks") or {}).items():
            step = (info.get("sections") or {}).get("step") or {}
            per_cycle.setdefault(e["cycle"], {})[int(r)] = {
                "steps": int(step.get("count", 0)), "step_total": float(step.get("total", 0.0)),
                "at_checkpoint": info.get("at_checkpoint"), "checkpoint_unfinished": info.get("checkpoint_unfinished"),
                "live_step": info.get("live_step")}
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
    # a cycle resumed from live state (agent.observation.live_recovery): the one before keeps its steps up to there
    live = {e["cycle"]: e["detail"].get("resume_step") for e in _by_kind(events, "live_recovery")}
    step_seconds: Dict[int, float] = {}
    useful: Dict[int, float] = {}
    redone: Dict[int, list] = {}
    resumes: Dict[int, dict] = {}
    for number, ranks in sorted(per_cycle.items()):
        blamed = culprits.get(number, set())
        if number == last and ended_ok:
            kept = {r: (w["steps"], w["step_total"]) for r, w in ranks.items()}
        else:
            resumed_live = live.get(number + 1)
            kept = kept_work(ranks, resumed_live, blamed)
            steps, why = resume_point(ranks, blamed)
            resumes[number] = {"steps": steps, "why": why,
                               "live": resumed_live if resumed_live is not None and resumed_live >= 0 else None,
                               "redone": sum(w["steps"] - kept[r][0] for r, w in ranks.items())}
        for rank, w in ranks.items():
            steps, seconds = kept[rank]
            step_seconds[rank] = step_seconds.get(rank, 0.0) + w["step_total"]
            useful[rank] = useful.get(rank, 0.0) + seconds
            acc = redone.setdefault(rank, [0, 0.0])
            acc[0] += w["steps"] - steps
            acc[1] += max(0.0, w["step_total"] - seconds)
    return step_seconds, useful, redone, resumes


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
        what, noticed = hang_words(h)
        if blame:   # the hang blame named the rank that hung; the others only waited on it
            if rank not in blame["culprits"]:   # its monitor had not fired: its agent killed it
                rank = blame["culprits"][0]
                what = f"rank {rank} hung (killed by its agent on the hang blame before its monitor fired)"
            what += waiting_words(blame)
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
    reruns = _by_kind(mine, "rerun")   # a rank's exit 16 or 17 (agent.recovery.rerun_exits): the decision
    if reruns:
        rd = reruns[0]["detail"]
        cause = f"exit {rd.get('exitcode')}: {rd.get('meaning')} (Megatron's rerun state machine, or an SDC guard)"
    restarts = _by_kind(mine, "restart")
    failed = _by_kind(mine, "job_failed")
    if restarts:
        r = restarts[0]["detail"]
        budget = f"/{max_restarts}" if max_restarts is not None else ""
        action = f"{restart_words(r)}: cycle {r.get('next_cycle')} (restart {r.get('restarts_used')}{budget})"
        # the first later cycle in which every rank stepped (a cycle may fail before its first step)
        recovered = next((c["stepping"] for n, c in sorted(cycles.items()) if n > number and c["stepping"]), None)
    elif failed:
        action, recovered = "restart budget spent: the job failed (exit 1)", None
    elif reruns and not reruns[0]["detail"].get("restart"):
        action, recovered = f"stopped without a restart: {reruns[0]['detail'].get('decision')}", None
    else:
        action, recovered = "(no decision recorded yet)", None
    # a kept rank that missed its restart point is told as the next cycle starts
    nxt = restarts[0]["detail"].get("next_cycle") if restarts else None
    late = [e for e in _by_kind(events, "inprocess_timeout") if nxt is not None and e["cycle"] == nxt]
    if late:
        action += ("; " + ", ".join(f"rank {e.get('rank')}" for e in late)
                   + " did not reach its restart point in time and started afresh")
    moved = [e for e in _by_kind(events, "rank_moved") if nxt is not None and e["cycle"] == nxt]
    if moved:
        action += "; " + ", ".join(f"rank {e.get('rank')} re-ran on device {e['detail'].get('device')} "
                                   f"(it left {e['detail'].get('left')})" for e in moved)
    dropped = reruns[0]["detail"].get("dropped") if reruns and restarts else None
    if dropped:   # --elastic, no hot spare: the node that had to leave was dropped
        action += (f"; the suspect node was dropped (--elastic, no hot spare): the job went on with "
                   f"{dropped.get('nodes')} nodes")
    told = [e["detail"] for e in _by_kind(events, "live_recovery") if nxt is not None and e["cycle"] == nxt]
    if told:
        action += "; " + live_words(told[0])
    found = _by_kind(mine, "flight_recorder")
    culprits = {rank} if rank is not None else set()
    culprits |= set((blame or {}).get("culprits") or [])
    return Incident(number, rank, failure["node"], what, cause, noticed, fault_time, detect, action, dumps,
                    recovered, hang_timeout, found[0]["detail"].get("summary") if found else None,
                    tuple(sorted(culprits)))


def _blamed_hang(failure: dict, hangs: List[dict], blame: Optional[dict] = None) -> dict:
    """The hang of the rank the hang blame found hung, else the one the agent's failure event (its
    console line) names, else the first one."""
    culprit = next((h for h in hangs if blame and h.get("rank") in blame["culprits"]), None)
    if culprit is not None:
        return culprit
    blamed = (failure["detail"].get("hang") or {}).get("rank", failure.get("rank"))
    return next((h for h in hangs if h.get("rank") == blamed and h["node"] == failure["node"]), hangs[0])


