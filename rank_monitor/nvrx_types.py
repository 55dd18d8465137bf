"""NVRx's value types for training scripts: HeartbeatTimeouts, SectionTimeouts and RankInfo,
with the fields and properties of nvidia_resiliency_ext.fault_tolerance 0.4.1.

Dataclasses, like NVRx's, so `dataclasses.asdict` gives NVRx's state-dict fields. Kept apart from
rank_monitor.rank_side.nvrx_api so that `import ft_launcher` does not pay for the dataclasses machinery; the
client imports this module on its slow path (the views, load_state_dict, init).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Set


@dataclasses.dataclass
class HeartbeatTimeouts:
    """NVRx's heartbeat timeouts: seconds, None = not enforced; were_calculated: both computed."""

    initial: Optional[float] = None
    subsequent: Optional[float] = None
    were_calculated: Optional[bool] = None

    @property
    def are_valid(self) -> bool:
        return self.initial is not None and self.subsequent is not None


@dataclasses.dataclass
class SectionTimeouts:
    """NVRx's section timeouts: every section in effect, and which of them were computed."""

    section: Dict[str, Optional[float]] = dataclasses.field(default_factory=dict)
    out_of_section: Optional[float] = None
    calculated_sections: Set[str] = dataclasses.field(default_factory=set)
    is_out_of_section_calculated: bool = False

    def __post_init__(self) -> None:
        self.calculated_sections = set(self.calculated_sections)

    @property
    def were_calculated(self) -> bool:
        return self.calculated_sections == set(self.section) and self.is_out_of_section_calculated

    @property
    def are_valid(self) -> bool:
        return all(t is not None for t in self.section.values()) and self.out_of_section is not None


@dataclasses.dataclass
class RankInfo:
    global_rank: int
    local_rank: int
    host: str
    pid: int
