"""NVRx's cycle info files (`cycle_info_dir`, NVRx 0.7): one JSON file per cycle for tools that
follow a job from outside, in NVRx's file name, keys and formats.

In `cycle_info_dir` the node that is rank 0 of a round writes, when the cycle starts,
`cycle_info.<job>.<attempt>.<cycle>`: job = SLURM_ARRAY_JOB_ID or SLURM_JOB_ID (empty outside
SLURM, as in NVRx), attempt = SLURM_RESTART_COUNT (0), cycle = our cycle number (0-based, NVRx's
rendezvous round). Its keys, in NVRx's order (its NVRxCycleInfo message as protobuf JSON):
`job_id`, `attempt_index`, `cycle_number`, `cycle_start_time`, `cycle_end_time` (ISO 8601 UTC
with Z; empty until the cycle ends), `cycle_log_file` (the cycle's --ft-per-cycle-applog-prefix
file, else empty), `active_nodes` and `standby_nodes` (SLURM node-list form, e.g.
`node[001-004]`), `generation` (a string, as protobuf writes 64-bit ints: 0 when written, +1 at
each rewrite) and `active_ranks` (the active nodes' group ranks, range-compressed: `0-3`).
`cycle_info.<job>.current` is a symlink to the newest file (replaced atomically), and every rank
of every node finds its path in NVRX_CURRENT_CYCLE_INFO. When the cycle ends the file is
rewritten atomically with its end time.

A file that cannot be written costs one warning line (the event log's disk warning), never the job.
"""
from __future__ import annotations

import datetime
import json
import os
import re
from typing import Callable, Dict, List, Optional, Sequence

from ft_launcher.rank_monitor import atomic_file

ENV_CURRENT = "NVRX_CURRENT_CYCLE_INFO"


def job_id(env=os.environ) -> str:
    return env.get("SLURM_ARRAY_JOB_ID") or env.get("SLURM_JOB_ID") or ""


def attempt_index(env=os.environ) -> int:
    try:
        return int(env.get("SLURM_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def current_link(directory: str, env=os.environ) -> str:
    """The path ranks get in NVRX_CURRENT_CYCLE_INFO."""
    return os.path.join(os.path.abspath(directory.rstrip("/") or "/"), f"cycle_info.{job_id(env)}.current")


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def _split_number(name: str):
    match = re.fullmatch(r"(.*?)(\d+)", name)
    return (match.group(1), int(match.group(2)), match.group(2)) if match else None


def _host_key(host: str):
    short = host.split(".")[0].strip()
    parts = _split_number(short)
    return (0, parts[0], parts[1]) if parts else (1, short, 0)


def node_list(hosts: Sequence[str]) -> str:
    """SLURM's node-list form of `hosts` (short names): node[001-003,007],gpu[1-2]; names without
    a trailing number are listed as they are, comma-separated."""
    short = [h.split(".")[0].strip() for h in hosts if h]
    if not short:
        return ""
    parsed = [_split_number(s) for s in short]
    if None in parsed:
        return ",".join(sorted(set(short)))
    groups: Dict[str, Dict[int, str]] = {}
    for prefix, number, digits in parsed:
        groups.setdefault(prefix, {})[number] = digits
    out = []
    for prefix in sorted(groups):
        numbers = sorted(groups[prefix])
        width = max(len(d) for d in groups[prefix].values())
        out.append(f"{prefix}[{','.join(_ranges(numbers, width))}]")
    return ",".join(out)


def _ranges(numbers: List[int], width: int = 0) -> List[str]:
    runs: List[List[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    fmt = lambda n: str(n).zfill(width)  # noqa: E731
    return [fmt(a) if a == b else f"{fmt(a)}-{fmt(b)}" for a, b in runs]


def rank_ranges(ranks: Sequence[int]) -> str:
    """0-3,6 (in the order given)."""
    return ",".join(_ranges(list(ranks)))


def hostname_of(node) -> str:
    """The host name of a round's node (NodeInfo.node_id is <hostname>-<pid>-<token>)."""
    return node.node_id.rsplit("-", 2)[0]


class CycleInfoWriter:
    def __init__(self, directory: str, warn: Optional[Callable[[str, OSError], None]] = None, env=os.environ):
        self.directory = os.path.abspath(directory)
        self.job, self.attempt = job_id(env), attempt_index(env)
        self.warn = warn or (lambda what, exc: None)
        self._open: Optional[dict] = None

    def path(self, cycle: int) -> str:
        return os.path.join(self.directory, f"cycle_info.{self.job}.{self.attempt}.{cycle}")

    def start(self, cycle: int, active: Sequence, spares: Sequence, log_file: str = "") -> None:
        """A cycle starts: its file (generation 0) and the .current link to it. `active` and
        `spares` are the round's nodes (NodeInfo), in group-rank order."""
        if self._open is not None:
            self.end()
        hosts = [hostname_of(n) for n in active]
        order = sorted(range(len(hosts)), key=lambda i: (_host_key(hosts[i]), i))
        record = {"job_id": self.job, "attempt_index": self.attempt, "cycle_number": cycle,
                  "cycle_start_time": utc_now(), "cycle_end_time": "", "cycle_log_file": log_file or "",
                  "active_nodes": node_list(hosts), "standby_nodes": node_list([hostname_of(n) for n in spares]),
                  "generation": "0", "active_ranks": rank_ranges(order)}
        if not self._write(cycle, record):
            return
        self._open = dict(record, cycle=cycle)
        link = os.path.join(self.directory, f"cycle_info.{self.job}.current")
        try:
            atomic_file.symlink(os.path.basename(self.path(cycle)), link)
        except OSError as exc:
            self.warn(f"cannot update the cycle info link {link}", exc)

    def end(self) -> None:
        """The cycle written last ends now: its file gets its end time (once)."""
        record, self._open = self._open, None
        if record is None:
            return
        cycle = record.pop("cycle")
        record.update(cycle_end_time=utc_now(), generation=str(int(record["generation"]) + 1))
        self._write(cycle, record)

    def _write(self, cycle: int, record: dict) -> bool:
        path = self.path(cycle)
        try:
            os.makedirs(self.directory, exist_ok=True)
            atomic_file.write(path, json.dumps(record, indent=2))
            return True
        except OSError as exc:
            self.warn(f"cannot write the cycle info file {path}", exc)
            return False
