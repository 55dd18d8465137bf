"""What SLURM tells one node's agent: node count, node rank, job id, first host, own node name.

Owns reading the SLURM environment (``slurm_info``) and expanding SLURM host lists
(``expand_hostlist``). Nothing here talks to slurmctld except the ``scontrol show hostnames``
fallback used when the python-hostlist package is missing.

Which variables, and why:
- node count: ``SLURM_NNODES`` (the step's, under srun), else ``SLURM_JOB_NUM_NODES``.
- node rank: under srun with one task per node (``SLURM_NTASKS == SLURM_NNODES``) the task's
  ``SLURM_PROCID``; else ``SLURM_NODEID``; else the node's position in the node list.
- node list: the step's (``SLURM_STEP_NODELIST``) when there is one, else ``SLURM_JOB_NODELIST``,
  else ``SLURM_NODELIST``. The step's list is the one that matches the step's node count and
  node ranks: ``srun -N 2`` inside a 3-node allocation runs launchers on the step's nodes only, so
  the rendezvous host must be the first of those, not the first of the allocation.
- own name: ``SLURMD_NODENAME`` (the SLURM node name, which is what the node list holds), else
  the host name.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass
from typing import Mapping

__all__ = ["SlurmInfo", "slurm_info", "expand_hostlist"]

_HOSTNAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class SlurmInfo:
    nnodes: int  # SLURM_NNODES (or SLURM_JOB_NUM_NODES)
    node_rank: int  # SLURM_PROCID when one task per node, else SLURM_NODEID
    job_id: str  # SLURM_JOB_ID
    first_host: str  # first host of the (step's, else job's) node list
    nodename: str  # SLURMD_NODENAME or hostname


def expand_hostlist(text: str) -> list[str]:
    """Expand a SLURM host list: ``'gpu-[001-004,010],login1'`` -> ``['gpu-001', ..., 'login1']``.

    Order is kept (SLURM's order is the node order). Raises ``ValueError`` with a one-line
    message when ``text`` is not a host list.
    """
    if not isinstance(text, str):
        raise ValueError(f"host list must be a string, got {type(text).__name__}")
    text = text.strip()
    if not text:
        raise ValueError("empty host list")
    try:
        import hostlist  # python-hostlist
    except ImportError:
        hosts = _expand_with_scontrol(text)
    else:
        try:
            hosts = hostlist.expand_hostlist(text, sort=False)
        except hostlist.BadHostlist as e:
            raise ValueError(f"bad host list {text!r}: {e}") from None
    if not hosts:
        raise ValueError(f"bad host list {text!r}: no hosts")
    for h in hosts:
        if not _HOSTNAME_RE.match(h):
            raise ValueError(f"bad host list {text!r}: {h!r} is not a host name")
    return hosts


def _expand_with_scontrol(text: str) -> list[str]:
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        raise ValueError(
            f"cannot expand host list {text!r}: neither python-hostlist nor scontrol is available"
        )
    try:
        res = subprocess.run(
            [scontrol, "show", "hostnames", text],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ValueError(f"cannot expand host list {text!r}: scontrol failed: {e}") from None
    if res.returncode != 0:
        msg = " ".join(res.stderr.split()) or f"exit status {res.returncode}"
        raise ValueError(f"bad host list {text!r}: {msg}")
    return res.stdout.split()


def _int_env(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value.strip())
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def slurm_info(environ: Mapping[str, str] = os.environ) -> SlurmInfo | None:
    """Read the SLURM environment; ``None`` when not running under SLURM.

    "Under SLURM" means both a job id and a node list are set. Raises ``ValueError`` (one line)
    when SLURM variables are present but inconsistent or malformed.
    """
    job_id = (environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or "").strip()
    nodelist = ""
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        nodelist = (environ.get(name) or "").strip()
        if nodelist:
            break
    if not job_id or not nodelist:
        return None

    hosts = expand_hostlist(nodelist)

    nnodes = _int_env(environ, "SLURM_NNODES")
    if nnodes is None:
        nnodes = _int_env(environ, "SLURM_JOB_NUM_NODES")
    if nnodes is None:
        nnodes = len(hosts)
    if nnodes < 1:
        raise ValueError(f"SLURM node count must be >= 1, got {nnodes}")

    nodename = (environ.get("SLURMD_NODENAME") or "").strip() or socket.gethostname()

    ntasks = _int_env(environ, "SLURM_NTASKS")
    procid = _int_env(environ, "SLURM_PROCID")
    nodeid = _int_env(environ, "SLURM_NODEID")
    if procid is not None and ntasks is not None and ntasks == nnodes:
        node_rank = procid
    elif nodeid is not None:
        node_rank = nodeid
    elif nodename in hosts:
        node_rank = hosts.index(nodename)
    else:
        node_rank = 0 if nnodes == 1 else None
        if node_rank is None:
            raise ValueError(
                f"cannot tell this node's rank: no SLURM_NODEID/SLURM_PROCID and "
                f"{nodename!r} is not in the node list {nodelist!r}"
            )
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"SLURM node rank {node_rank} is outside 0..{nnodes - 1}")

    return SlurmInfo(
        nnodes=nnodes,
        node_rank=node_rank,
        job_id=job_id,
        first_host=hosts[0],
        nodename=nodename,
    )
