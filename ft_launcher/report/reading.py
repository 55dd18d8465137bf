"""Reading a job's log dirs for `ft_launcher report`: events.jsonl (one per dir, merged in time
order, each event once) and the agents' status files (agent.observation.job_status), which give the
running cycle's numbers. A last line still being written (a running job) is skipped, with a note."""
from __future__ import annotations

import glob
import json
import os
from typing import List, Sequence, Tuple

END_KINDS = ("job_complete", "job_failed", "job_stopped", "rendezvous_failed", "store_lost")


class ReportError(Exception):
    pass


def read_events(path: str) -> Tuple[List[dict], bool]:
    """The records of one events.jsonl, and whether its last line was cut short (a running job)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise ReportError(f"cannot read {path}: {exc.strerror or exc}") from None
    lines = data.split(b"\n")
    truncated = False
    records = []
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
            if not isinstance(record, dict) or not isinstance(record.get("kind"), str) \
                    or not isinstance(record.get("time"), (int, float)):
                raise ValueError("not an event")
        except (ValueError, UnicodeDecodeError):
            if number == len(lines):  # no newline after it: still being written
                truncated = True
                continue
            raise ReportError(f"{path} line {number}: not an ft_launcher event (garbage JSONL?)") from None
        record.setdefault("detail", {})
        if not isinstance(record["detail"], dict):
            record["detail"] = {}
        records.append(record)
    return records, truncated


def load(dirs: Sequence[str]) -> Tuple[List[dict], List[dict], List[str]]:
    """(events merged in time order, status files, notes) of the given log dirs."""
    events, statuses, notes, seen = [], [], [], set()
    for d in dirs:
        if not os.path.isdir(d):
            raise ReportError(f"log dir not found: {d}")
        path = os.path.join(d, "events.jsonl")
        if not os.path.isfile(path):
            raise ReportError(f"no events.jsonl in {d} (was the job run with --log-dir {d}?)")
        records, truncated = read_events(path)
        if truncated:
            notes.append(f"{path}: the last line is incomplete (the job is still writing it); skipped")
        for r in records:
            key = json.dumps(r, sort_keys=True)
            if key not in seen:  # the same dir named twice, or a shared dir: count each event once
                seen.add(key)
                events.append(r)
        for sp in sorted(glob.glob(os.path.join(d, "status", "*.json"))):
            try:
                with open(sp) as fh:
                    statuses.append(json.load(fh))
            except (OSError, ValueError):
                continue
    if not events:
        raise ReportError(f"no events yet in {', '.join(dirs)}")
    events.sort(key=lambda r: r["time"])
    return events, statuses, notes
