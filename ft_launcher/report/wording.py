"""The report's words: the console summary, an incident's line, what goodput counted, and the
phrases the analysis builds incidents from (a hang, who waited on it, a restart, live state). The
HTML page (ft_launcher.report.page) uses the same lines."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Tuple

from ft_launcher.agent.recovery.failure_cause import hang_place
from ft_launcher.agent.recovery.restart_policy import rung_words, waiting_words  # noqa: F401 - one wording

if TYPE_CHECKING:
    from ft_launcher.report.analysis import Incident, Job


def num(value) -> str:
    return "?" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)


def fmt(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{seconds:.2f} s"


def live_words(live: dict) -> str:
    """A live_recovery event in words: where the job resumed and where each rank's state came from."""
    if live.get("resume_step") is None:
        return f"no live state ({live.get('reason')}): every rank loaded its checkpoint"
    from ft_launcher.agent.observation.live_recovery import source_words

    sources = source_words(live.get("sources"), kept=False)
    rate = f" at {live['mb_per_s']:g} MB/s" if live.get("mb_per_s") else ""
    return (f"live state: resumed at step {live['resume_step']}, {live.get('steps_redone', 0)} completed "
            f"step(s) redone; {sources or 'every rank kept its state'}{rate}")


def hang_words(hang: dict) -> Tuple[str, str]:
    """(what happened, who noticed) for the blamed hang, in the words and numbers of its event
    (the place as the console's line says it: agent.recovery.failure_cause.hang_place)."""
    hd = hang["detail"]
    place = hang_place(hd)
    what = f"rank {hang.get('rank')} hung in {place}"
    noticed = (f"its rank monitor ({place} open {float(hd.get('elapsed') or 0):.2f} s > timeout "
               f"{num(hd.get('timeout'))} s)")
    return what, noticed


def restart_words(restart: dict) -> str:
    """How a restart event restarted the job (the verdict's words, agent.recovery.restart_policy)."""
    return rung_words(True, restart.get("rung", "job"), restart.get("replace_nodes") or (),
                      restart.get("replace_ranks") or (), done=True, moved=bool(restart.get("moved")))


def incident_line(job: "Job", inc: "Incident") -> str:
    t = inc.fault_time - job.start
    stepped = any(e["kind"] == "stepping" for e in job.events)
    rec = (f"every rank stepping again {inc.recovery:.2f} s after it" if inc.recovery is not None
           else "" if "restarted" not in inc.action or not stepped
           else "not every rank stepping again yet")
    return (f"cycle {inc.cycle} at +{t:.1f} s: {inc.what} ({inc.cause}); noticed by {inc.noticed_by} after "
            f"{inc.detected_after:.2f} s; {inc.action}" + (f"; {rec}" if rec else "")
            + (f"; {inc.resumed}" if inc.resumed else "")
            + (f"\n    {inc.flight_recorder}" if inc.flight_recorder else ""))


NO_STEP = ("no rank ever completed a `step` section: goodput counts the time in completed `step` sections; mark "
           "the training step with `with ft.section(\"step\"):` (or NVRx's client's start_section(\"step\"))")


def goodput_words(job: "Job") -> str:
    """What goodput counted and what it left out, in rank-seconds (or why there is nothing to count)."""
    if job.no_step:
        return NO_STEP
    wall = job.end - job.start
    steps, secs = sum(r[0] for r in job.redone.values()), sum(r[1] for r in job.redone.values())
    return (f"steps never redone {sum(job.useful_seconds.values()):.1f} rank-s of {job.world_size * wall:.1f} "
            f"rank-s; time in step {sum(job.step_seconds.values()):.1f} rank-s, of which {steps} step"
            f"{'s' if steps != 1 else ''} ({secs:.1f} rank-s) redone after restarts")


def tail_words(job: "Job") -> Optional[str]:
    """What the job did after its last rank ended (the timeline's tail), or None."""
    tail = job.tail
    if not tail:
        return None
    return (f"the last {tail['end'] - tail['start']:.1f} s, after every rank had ended: {tail['why']}")


def console_summary(job: "Job", output: str) -> str:
    wall = job.end - job.start
    lines = [f"job {job.run_id!r}: {job.state}; {len(job.nodes)} node(s), {job.world_size} rank(s), "
             f"{len(job.cycles)} cycle(s), wall {wall:.1f} s",
             f"goodput {job.goodput * 100:.1f}% ({goodput_words(job)})"]
    lines.append(f"incidents: {len(job.incidents)}")
    lines += ["  " + incident_line(job, inc) for inc in job.incidents]
    if job.timeout_changes:
        lines.append("timeout changes:")
        lines += [f"  cycle {c['cycle']}: {c['key']} {num(c['old'])} -> {num(c['new'])} s ({c['why']})"
                  for c in job.timeout_changes]
    tail = tail_words(job)
    if tail:
        lines.append(tail)
    lines += job.notes
    lines.append(f"report: {output}")
    return "\n".join(lines)
