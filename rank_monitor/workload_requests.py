"""NVRx's workload control requests, from a rank to its launcher: the actions
(`WorkloadAction`: Continue, ExcludeThisNode, ShutdownWorkload, with NVRx 0.4.1's values) and the
request a rank sends (`WorkloadControlRequest`). The rank writes the action's value into its
shared-memory record (rank_monitor.shm_layout H_REQUEST_*); the agent reads it back by the same
enum (agent.recovery.failure_cause)."""
from __future__ import annotations

import enum

# A Continue request whose description starts so is the step guard's decision
# (rank_side.live.step_guard): the agent says it as a `step_guard` event, not as a request.
STEP_GUARD_PREFIX = "step_guard: "


class WorkloadAction(enum.Enum):
    """NVRx's requests from a rank to its launcher (see send_workload_control_request)."""

    Continue = 0
    ExcludeThisNode = 1
    ShutdownWorkload = 2


class WorkloadControlRequest:
    def __init__(self, action: WorkloadAction, description: str = "<not set>") -> None:
        self.action = action
        self.description = description

    def __str__(self) -> str:
        return f"WorkloadControlRequest(action={self.action}, description={self.description})"
