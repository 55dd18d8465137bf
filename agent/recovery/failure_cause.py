"""What a failure is: the typed `Failure` the supervisor (agent.recovery.supervisor) returns, carrying the
report an agent sends to the round's verdict (agent.recovery.restart_policy) and the words an operator
reads, built from what the agent saw.

One function per way a node learns of a failure, each named as the `Failure.cause` it returns: a
rank ended (`rank_ended`: what its monitor reported about it, a hang or the monitor's own death,
else the hang blame's verdict, else its exit status), a rank's function raised under
`ft.restartable` (`rank_raised`), peer nodes stopped answering (`peers_lost`), or a rank sent a
WorkloadControlRequest (`rank_request`: ShutdownWorkload is a stop, ExcludeThisNode its node
`leaving`, both decided by the policy). The report: kind "failure" (or "stop"), the line `what`,
the rank where known, and the evidence (hang, exitcode, exception, dead_nodes, action, ...).
A rank's exit 16 or 17 (Megatron's rerun state machine, agent.recovery.rerun_exits) is said with its
meaning and carries the rank's `slot`, to which the agent adds the slot's `hardware`.
`hang_place` and `dump_words` are the hang line's parts.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional

from ft_launcher.agent.ranks.workers import describe_exit
from ft_launcher.agent.recovery import rerun_exits
from ft_launcher.rank_monitor.workload_requests import WorkloadAction

_ACTION_VALUES = {a.value for a in WorkloadAction}

CAUSES = ("rank_ended", "rank_raised", "peers_lost", "rank_request")


@dataclasses.dataclass
class Failure:
    """What this node saw end its cycle: `cause` (one of CAUSES) and the `report` the round's
    verdict is decided from."""

    cause: str
    report: dict


def rank_ended(rank, code: int, node: str, reports: List[dict], blame) -> Failure:
    return Failure("rank_ended", _ended(rank, code, node, reports, blame))


def _ended(rank, code: int, node: str, reports: List[dict], blame) -> dict:
    """Why `rank` (on `node`, in words) ended with `code`: `reports` are its monitor's reports of
    this cycle (monitor_set.take_pending), `blame` the cycle's hang blame (agent.recovery.hang_blame)."""
    hangs = [r for r in reports if r.get("kind") == "hang"]
    lost = [r for r in reports if r.get("kind") == "monitor_died"]
    if hangs:
        hang = hangs[-1]
        what = (f"rank {rank.rank} on {node} hung in {hang_place(hang)} for {hang.get('elapsed', 0):.2f}s "
                f"(timeout {hang.get('timeout', 0):g}s) and was stopped by its monitor" + blame.words(rank.rank))
        return {"kind": "failure", "what": what, "rank": rank.rank, "exitcode": code, "hang": hang}
    if lost:
        what = (f"rank {rank.rank} on {node} was stopped because its monitor (pid {lost[-1]['pid']}) died: "
                f"it restarts under the new monitor")
        return {"kind": "failure", "what": what, "rank": rank.rank, "exitcode": code, "monitor_died": lost[-1]}
    if blame.blamed(rank.local_rank):
        what = f"rank {rank.rank} on {node} hung and was killed by its agent" + blame.words(rank.rank)
        return {"kind": "failure", "what": what, "rank": rank.rank, "exitcode": code, "hang_blame": blame.verdict}
    if code in rerun_exits.CODES:   # Megatron's (and the SDC guard's): the agent adds the rank's `hardware`
        return {"kind": "failure", "what": f"rank {rank.rank} on {node} exited {code} ({rerun_exits.MEANING[code]})",
                "rank": rank.rank, "exitcode": code, "slot": rank.local_rank}
    return {"kind": "failure", "what": f"rank {rank.rank} on {node} {describe_exit(code)}", "rank": rank.rank,
            "exitcode": code}


def rank_raised(rank, node: str, text: str) -> Failure:
    """`rank`'s function raised `text` (its one-line summary) under ft.restartable."""
    return Failure("rank_raised", {"kind": "failure", "what": f"rank {rank.rank} on {node} raised {text}",
                                   "rank": rank.rank, "exception": text})


def peers_lost(dead: list) -> Failure:
    """Peer nodes (NodeInfo) whose keep-alive stopped."""
    what = ", ".join(f"node {n.label()}" for n in dead) + " stopped answering"
    return Failure("peers_lost", {"kind": "failure", "what": what, "dead_nodes": [n.__dict__ for n in dead]})


def rank_request(rank: int, node: str, node_id: str, request: dict) -> Optional[Failure]:
    """Global rank `rank` on `node` sent `request` ({action, description}, rank_monitor.workload_requests'
    WorkloadControlRequest, from rank_side.nvrx_api); None for Continue (nothing to do: the caller says so)."""
    action, asked = request_words(rank, node, request)
    fields = {"rank": rank, "action": action, "description": request["description"]}
    if action == "ShutdownWorkload":
        return Failure("rank_request", dict(fields, kind="stop", what=f"{asked}: stopping the job"))
    if action == "ExcludeThisNode":   # the policy leaves the node out, or stops the job if too few remain
        return Failure("rank_request", dict(fields, kind="failure", what=f"{asked}: excluding its node",
                                            leaving=node_id))
    return None


def request_words(rank: int, node: str, request: dict) -> tuple:
    """(the action's name, "rank R on NODE sent ACTION (DESCRIPTION)")."""
    action = WorkloadAction(request["action"]).name if request["action"] in _ACTION_VALUES else "?"
    return action, f"rank {rank} on {node} sent {action} ({request['description'] or 'no description'})"


def dump_words(report: dict) -> str:
    """Where the hung rank's stack dump goes, or why there is none."""
    if report.get("stack_file"):
        return f"stack dump: {report['stack_file']}"
    return "no stack dump (the rank never used ft_launcher's client, so it has no dump handler)"


def hang_place(report: dict) -> str:
    """"section 'step'", or the expired timeout and the innermost open section:
    "heartbeat (in section 'setup')"."""
    if report.get("section"):
        return f"section '{report['section']}'"
    place = str(report.get("reason", "?")).replace("_", " ")
    opened = report.get("open_sections") or []
    return place + (f" (in section '{opened[-1]}')" if opened else "")
