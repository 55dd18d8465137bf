"""What a rank's environment holds for GPUs and NCCL: torch's NCCL watchdog set so that our
monitors act first, and the devices left as the user (or the scheduler) gave them.

Defaults, each only where the user's environment does not set the variable (a value the user set
is passed on unchanged):
- `TORCH_NCCL_ASYNC_ERROR_HANDLING=1`, as torchrun sets it: a collective that outlives the process
  group's timeout makes torch's watchdog abort the communicator and end the rank, which the agent
  then handles as a crash (restart).
- `TORCH_NCCL_ENABLE_MONITORING=1` and `TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC` = the larger of torch's
  default (480) and the largest configured section / out-of-section / heartbeat timeout + 60 s:
  torch's heartbeat monitor kills a rank whose watchdog thread is stuck that long, without our
  stack or trace dumps, so it must never fire before our own timeouts.
- `TORCH_NCCL_DUMP_ON_TIMEOUT=1`, and with `--log-dir` `TORCH_NCCL_DEBUG_INFO_TEMP_FILE=
  <log dir>/nccl_trace_rank_`: when torch's watchdog does fire first, its own flight-recorder
  dump lands in the log dir.
A user's `TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC` at or below a configured timeout gets one warning line
(`heartbeat_warning`): torch may end a hung rank before our monitor can dump it.

`CUDA_VISIBLE_DEVICES` is passed on as it is, never set or reordered (as torchrun): the rank with
`LOCAL_RANK` n uses the n-th visible device (`torch.cuda.set_device(LOCAL_RANK)`), so
`--nproc-per-node gpu` runs one rank per visible device in the order given. So a slot's device is
the entry of CUDA_VISIBLE_DEVICES at its index, else the index (`slot_device`): what a rank's exit 16
moves it away from (agent.recovery.rerun_exits).
"""
from __future__ import annotations

import math
import os
from typing import Dict, Optional

TORCH_HEARTBEAT_DEFAULT = 480      # torch's TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC
HEARTBEAT_MARGIN = 60


def largest_timeout(ft) -> Optional[float]:
    values = [v for v in ft.timeout_keys().values() if v is not None]
    return max(values) if values else None


def heartbeat_timeout(ft) -> int:
    """The NCCL heartbeat timeout our ranks get by default: after every timeout of ours."""
    largest = largest_timeout(ft)
    if largest is None:
        return TORCH_HEARTBEAT_DEFAULT
    return max(TORCH_HEARTBEAT_DEFAULT, int(math.ceil(largest)) + HEARTBEAT_MARGIN)


def nccl_env(env: Dict[str, str], ft, log_dir: Optional[str]) -> Dict[str, str]:
    """The NCCL variables to add to a rank's environment `env` (the user's values win)."""
    defaults = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_ENABLE_MONITORING": "1",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(heartbeat_timeout(ft)),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }
    if log_dir:
        defaults["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = os.path.join(os.path.abspath(log_dir), "nccl_trace_rank_")
    return {k: v for k, v in defaults.items() if k not in env}


def heartbeat_warning(env: Dict[str, str], ft) -> Optional[str]:
    """One line when the user's NCCL heartbeat timeout can end a hung rank before our monitor."""
    value = env.get("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC")
    largest = largest_timeout(ft)
    if value is None or largest is None or env.get("TORCH_NCCL_ENABLE_MONITORING", "1") == "0":
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    if seconds > largest:
        return None
    return (f"warning: TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC={value} is not above the largest configured timeout "
            f"({largest:g}s): torch's NCCL heartbeat monitor may end a hung rank before its monitor dumps "
            f"its stack and trace (unset it for {heartbeat_timeout(ft)})")


def slot_device(slot: int, env: Dict[str, str]) -> str:
    """The device slot `slot`'s rank uses (LOCAL_RANK = slot): CUDA_VISIBLE_DEVICES' entry at that
    index when it has one, else the index itself (on a CPU: the slot)."""
    visible = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return visible[slot] if slot < len(visible) else str(slot)
