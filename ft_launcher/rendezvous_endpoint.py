"""Where and with whom this node meets its peers: the rendezvous backend, the store's host and port,
the run id, the node count (MIN:MAX), this node's order key and whether it hosts the store, from
--standalone, --nnodes, --rdzv-*, --master-*, --node-rank, SLURM and GROUP_RANK (torchrun's rules,
with SLURM's defaults under SLURM).
"""
from __future__ import annotations

import dataclasses
import os
import uuid
from typing import Dict, Optional

from ft_launcher.flag_values import parse_endpoint, parse_nnodes, parse_rdzv_conf
from ft_launcher.flags import DEFAULT_MASTER_PORT, UsageError

DEFAULT_C10D_PORT = 29400


@dataclasses.dataclass
class Rendezvous:
    backend: str              # c10d or static
    min_nodes: int
    max_nodes: int
    host: str                 # the store's
    port: int                 # 0: a free port (--standalone)
    run_id: str
    order_key: Optional[int] = None   # this node's place among the nodes (static: its rank)
    is_host: Optional[bool] = None    # host the store here? None: decide from the address
    conf: Dict[str, object] = dataclasses.field(default_factory=dict)   # --rdzv-conf, is_host taken out


def slurm_or_none():
    """The SLURM allocation this node runs in (agent.rounds.slurm_env), or None outside SLURM."""
    try:
        from ft_launcher.agent.rounds.slurm_env import slurm_info
    except ImportError:
        return None
    try:
        return slurm_info()
    except ValueError as exc:
        raise UsageError(f"SLURM environment: {exc}") from None


def resolve_rendezvous(args, backend: Optional[str], slurm) -> Rendezvous:
    """The rendezvous of the parsed flags `args` (`backend`: --rdzv-backend's value, None if not
    given; `slurm`: slurm_or_none())."""
    rdzv = _standalone(args) if args.standalone else _across_nodes(args, backend, slurm)
    rdzv.conf = parse_rdzv_conf(args.rdzv_conf)
    rdzv.is_host = rdzv.conf.pop("is_host", rdzv.is_host)
    if rdzv.backend == "static" and rdzv.is_host is None:
        rdzv.is_host = rdzv.order_key == 0
    return rdzv


def _standalone(args) -> Rendezvous:
    if args.nnodes and args.nnodes.strip() not in ("1", "1:1"):
        raise UsageError(f"--standalone is one node: it cannot be combined with --nnodes {args.nnodes}")
    return Rendezvous("c10d", 1, 1, "127.0.0.1", 0, args.rdzv_id or uuid.uuid4().hex[:12])


def _across_nodes(args, backend: Optional[str], slurm) -> Rendezvous:
    low, high = parse_nnodes(args.nnodes) if args.nnodes else (
        (slurm.nnodes, slurm.nnodes) if slurm else (1, 1))
    backend, host, port, store_here = _store_address(args, backend, slurm)
    run_id = args.rdzv_id or (slurm.job_id if slurm else "none")
    order_key = _order_key(args, slurm)
    if backend == "static":
        if low != high:
            raise UsageError("--rdzv-backend static needs a fixed --nnodes N (use c10d for MIN:MAX)")
        order_key = order_key or 0
    return Rendezvous(backend, low, high, host, port, run_id, order_key, store_here)


def _store_address(args, backend: Optional[str], slurm) -> tuple:
    """(backend, host, port, whether this node hosts the store when SLURM says so, else None)."""
    if args.rdzv_endpoint:
        return (backend or "c10d",) + parse_endpoint(args.rdzv_endpoint, DEFAULT_C10D_PORT) + (None,)
    if slurm and backend != "static":
        # the store lives on the first node, and only there
        store_here = slurm.nodename == slurm.first_host if os.environ.get("SLURMD_NODENAME") else None
        return "c10d", slurm.first_host, DEFAULT_MASTER_PORT, store_here
    return backend or "static", args.master_addr, args.master_port, None


def _order_key(args, slurm) -> Optional[int]:
    """This node's place: --node-rank, else SLURM's node rank, else torchrun's GROUP_RANK."""
    order_key = slurm.node_rank if slurm else None
    if args.node_rank is not None:
        order_key = args.node_rank
    elif order_key is None and os.environ.get("GROUP_RANK", "").isdigit():
        order_key = int(os.environ["GROUP_RANK"])
    return order_key
