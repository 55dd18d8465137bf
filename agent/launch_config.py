"""What one node's agent is asked to run: the parsed, validated launch settings.

`ft_launcher.cli` fills it from torchrun-style flags (or their `PET_*` variables), SLURM and the
fault-tolerance YAML; the agent only reads it.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Set, Tuple

from ft_launcher.agent.rounds.elastic import Elastic
from ft_launcher.rank_monitor.config import FaultToleranceConfig

# torch's c10d rendezvous defaults, in seconds, so `--rdzv-conf` keeps its meaning.
RDZV_CONF_DEFAULTS = {
    "join_timeout": 600.0,
    "last_call_timeout": 30.0,
    "close_timeout": 30.0,
    "read_timeout": 60.0,
    # Ours: how often agents prove they are alive, and after how many silent intervals a
    # node counts as dead (torch's dynamic handler spells them the same way).
    "keep_alive_interval": 1.0,
    "keep_alive_max_attempt": 3,
    # Ours: how long a store that still holds its connections (alive: paused, starved, busy) may
    # go without answering before the agents give it up and fail over (agent.rounds.store_client).
    "store_unresponsive_timeout": 20.0,
}


@dataclasses.dataclass
class LaunchConfig:
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    entrypoint: List[str]                 # the full command of one cold rank
    rdzv_backend: str = "c10d"            # c10d | static
    rdzv_host: str = "127.0.0.1"
    rdzv_port: int = 29400                # 0: pick a free one (standalone)
    rdzv_id: str = "none"
    rdzv_conf: Dict[str, object] = dataclasses.field(default_factory=lambda: dict(RDZV_CONF_DEFAULTS))
    is_host: Optional[bool] = None        # host the store here? None: decide from the address
    order_key: Optional[int] = None       # node order from the infrastructure (SLURM_PROCID, ...)
    standalone: bool = False
    max_restarts: int = 0
    monitor_interval: float = 0.1
    role: str = "default"
    log_dir: Optional[str] = None
    capture: Dict[int, int] = dataclasses.field(default_factory=dict)  # local rank -> streams (1 out, 2 err, 3 both)
    tee: Dict[int, int] = dataclasses.field(default_factory=dict)
    local_ranks_filter: Optional[Set[int]] = None
    local_addr: Optional[str] = None
    term_timeout: float = 30.0
    workers_stop_timeout: float = 15.0
    ft: FaultToleranceConfig = dataclasses.field(default_factory=FaultToleranceConfig)
    # What `entrypoint` runs, for a warm reserve that runs it in-process: script | module |
    # run_path (through python) or program (--no-python), the script/module/program, its args.
    entry_kind: str = "script"
    entry_target: str = ""
    entry_args: List[str] = dataclasses.field(default_factory=list)
    # where the node count and the endpoint came from: a flag, a PET_* variable, SLURM or default
    origins: Dict[str, str] = dataclasses.field(default_factory=dict)
    metrics_port: Optional[int] = None    # the node's Prometheus endpoint (agent.observation.metrics); None: off
    # Nodes that train when ft.active_world_size is set (active_world_size / nproc_per_node, 1 to
    # max_nodes); the other nodes stand by as warm spares. None: every node trains.
    active_nodes: Optional[int] = None
    # --elastic: --nnodes MIN:MAX as torchrun means it (up to MAX nodes train, the job goes on down to
    # MIN at once and grows back); False: NVRx's (MIN train, the rest are hot spares)
    elastic: bool = False
    signals: Tuple[int, ...] = ()         # --signals-to-handle: forwarded, then the job stops; (): the agent's own
    # NVRx's log layout beside ours (agent.observation.nvrx_logs): --ft-per-cycle-applog-prefix, --ft-nvrx-logfile
    applog_prefix: Optional[str] = None
    nvrx_logfile: Optional[str] = None

    def conf(self, key: str) -> float:
        return float(self.rdzv_conf.get(key, RDZV_CONF_DEFAULTS[key]))

    def summary(self) -> str:
        """The agent's first line: what it will run and where the node count and endpoint came from."""
        nodes = str(self.min_nodes) if self.min_nodes == self.max_nodes else f"{self.min_nodes}:{self.max_nodes}"
        where = ("a local store on a free port" if self.standalone
                 else f"{self.rdzv_backend} rendezvous at {self.rdzv_host}:{self.rdzv_port}")
        nodes += Elastic.of(self).words()
        if self.active_nodes:
            nodes += f" ({self.active_nodes} train: active_world_size {self.active_nodes * self.nproc_per_node})"
        return (f"starting: nnodes {nodes} (from {self.origins.get('nnodes', 'default')}), "
                f"{self.nproc_per_node} rank{'s' if self.nproc_per_node != 1 else ''} per node, "
                f"{where} (from {self.origins.get('endpoint', 'default')}), rdzv id {self.rdzv_id!r}")
