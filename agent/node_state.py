"""The node's life as an explicit state: what the agent is doing now, and the changes it may make.

    starting ──> joining ──> running ──> restarting ──> joining ...
                    │  └──> spare ─────────┘
                    └─ any of them ──> stopping ──> finished

- starting: the monitors start and the store is reached.
- joining: in a rendezvous round (agent.rounds.rendezvous), waiting for the other nodes.
- running: this node's ranks of the round run under supervision.
- spare: a hot spare, waiting to be needed (`--nnodes MIN:MAX`).
- restarting: a verdict restarts the job (agent.recovery.restart_policy), or the store host was lost and the
  node moves to its successor: ranks are stopped or carried into the next round.
- stopping: the job ends (complete, a spent budget, a stop, a signal) or this node leaves it.
- finished: the agent's exit code is decided (reachable from every state: the way out).

`NodeLife.to` makes a change. A change the diagram does not have is a defect of the agent: it
is said in one line and made anyway (the job is not stopped over it), except where
FT_LAUNCHER_STRICT_STATES=1 (the project's tests set it), where it raises. The state is what
`ft_launcher status` shows for the agent (agent.observation.job_status).
"""
from __future__ import annotations

import enum
import os
import time
from typing import Callable, List, Tuple

ENV_STRICT = "FT_LAUNCHER_STRICT_STATES"


class NodeState(str, enum.Enum):
    STARTING = "starting"
    JOINING = "joining"
    RUNNING = "running"
    SPARE = "spare"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    FINISHED = "finished"


S = NodeState
NEXT = {
    S.STARTING: {S.JOINING, S.STOPPING},
    S.JOINING: {S.RUNNING, S.SPARE, S.RESTARTING, S.STOPPING},   # restarting: the store host was lost
    S.RUNNING: {S.RESTARTING, S.STOPPING},
    S.SPARE: {S.RESTARTING, S.STOPPING},
    S.RESTARTING: {S.JOINING, S.STOPPING},
    S.STOPPING: set(),
    S.FINISHED: set(),
}


class UnexpectedStateChange(AssertionError):
    pass


class NodeLife:
    def __init__(self, say: Callable[[str], None]) -> None:
        self.state = S.STARTING
        self.since = time.time()
        self.history: List[Tuple[float, str, str]] = [(self.since, S.STARTING.value, "")]
        self.listeners: List[Callable[[NodeState], None]] = []
        self._say = say

    def to(self, new: NodeState, why: str = "") -> None:
        """Change to `new` (staying is no change); see the module docstring for what is allowed."""
        if new == self.state:
            return
        if new != S.FINISHED and new not in NEXT[self.state]:
            line = f"internal: node state {self.state.value} -> {new.value} is not one the agent makes ({why})"
            if os.environ.get(ENV_STRICT) == "1":
                raise UnexpectedStateChange(line)
            self._say(f"warning: {line}")
        self.state, self.since = new, time.time()
        self.history.append((self.since, new.value, why))
        for listener in self.listeners:
            listener(new)
