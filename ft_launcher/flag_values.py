"""Each launcher flag's value read into what it means, or a one-line UsageError naming the flag:
--nnodes, --nproc-per-node, --rdzv-backend, --rdzv-endpoint, --rdzv-conf, --signals-to-handle,
--redirects/--tee, --local-ranks-filter, --metrics-port and active_world_size.

One value at a time; how flags combine is ft_launcher.cli's (with rendezvous_endpoint, output_paths
and flag_checks).
"""
from __future__ import annotations

import difflib
import os
import signal
import warnings
from typing import Dict, Optional, Set

from ft_launcher.flags import UsageError, warn


def parse_nnodes(text: str) -> tuple:
    parts = text.split(":")
    try:
        if len(parts) == 1:
            low = high = int(parts[0])
        elif len(parts) == 2:
            low, high = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise UsageError(f"--nnodes: expected N or MIN:MAX, got {text!r}") from None
    if low < 1 or high < low:
        raise UsageError(f"--nnodes: need 1 <= MIN <= MAX, got {text!r}")
    return low, high


def parse_backend(text: Optional[str]) -> Optional[str]:
    if text is None or text in ("c10d", "static"):
        return text
    if text in ("etcd", "etcd-v2"):
        raise UsageError(f"--rdzv-backend: {text} is not supported: ft_launcher has no etcd rendezvous; its agents host their own "
                         "store: use --rdzv-backend c10d --rdzv-endpoint NODE0_HOST:PORT (or --standalone)")
    raise UsageError(f"--rdzv-backend: expected c10d or static, got {text!r}")


def parse_signals(text: Optional[str]) -> tuple:
    """--signals-to-handle SIGTERM,SIGUSR1,... (names, with or without SIG, or numbers)."""
    if text is None:
        return ()
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        name = item.upper() if item.upper().startswith("SIG") else "SIG" + item.upper()
        try:
            sig = signal.Signals(int(item)) if item.isdigit() else signal.Signals[name]
        except (KeyError, ValueError):
            raise UsageError(f"--signals-to-handle: unknown signal {item!r}") from None
        if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            raise UsageError(f"--signals-to-handle: {sig.name} cannot be handled")
        out.append(int(sig))
    if not out:
        raise UsageError("--signals-to-handle: expected e.g. SIGTERM,SIGINT,SIGUSR1")
    return tuple(dict.fromkeys(out))


def parse_rdzv_conf(text: str) -> Dict[str, object]:
    from ft_launcher.agent.launch_config import RDZV_CONF_DEFAULTS

    conf: Dict[str, object] = dict(RDZV_CONF_DEFAULTS)
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(f"--rdzv-conf: expected key=value, got {item!r}")
        if key == "is_host":
            if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise UsageError(f"--rdzv-conf: is_host must be true or false, got {value!r}")
            conf[key] = value.lower() in ("1", "true", "yes")
        elif key in RDZV_CONF_DEFAULTS or key == "timeout":
            try:
                number = float(value)
            except ValueError:
                raise UsageError(f"--rdzv-conf: {key} must be a number, got {value!r}") from None
            if number < 0:
                raise UsageError(f"--rdzv-conf: {key} must not be negative, got {value!r}")
            conf["join_timeout" if key == "timeout" else key] = number
        else:
            hint = difflib.get_close_matches(key, list(RDZV_CONF_DEFAULTS) + ["is_host"], n=1)
            warn(f"--rdzv-conf: unknown key {key!r} ignored" + (f" (did you mean {hint[0]!r}?)" if hint else ""))
    return conf


def parse_stream_map(flag: str, text: str, nproc: int) -> Dict[int, int]:
    text = text.strip()
    try:
        if ":" not in text:
            mask = int(text)
            if not 0 <= mask <= 3:
                raise ValueError
            return {i: mask for i in range(nproc)} if mask else {}
        out = {}
        for item in text.split(","):
            rank, _, mask = item.partition(":")
            value = int(mask)
            if not 0 <= value <= 3:
                raise ValueError
            out[int(rank)] = value
        return out
    except ValueError:
        raise UsageError(f"{flag}: expected 0-3 or local_rank:mask,... (1 stdout, 2 stderr, 3 both), got {text!r}") from None


def parse_nproc(text: str) -> int:
    if text.isdigit() and int(text) > 0:
        return int(text)
    if text in ("gpu", "auto"):
        with warnings.catch_warnings():  # torch's import-time warnings are not the user's (no numpy, pynvml)
            warnings.simplefilter("ignore")
            import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if text == "gpu":
            if not gpus:
                raise UsageError("--nproc-per-node gpu: no GPU found on this node")
            return gpus
        return gpus or (os.cpu_count() or 1)
    if text == "cpu":
        return os.cpu_count() or 1
    raise UsageError(f"--nproc-per-node: expected a positive int, cpu, gpu or auto, got {text!r}")


def parse_active_nodes(active_world_size: Optional[int], nproc: int, max_nodes: int) -> Optional[int]:
    """The nodes that train when only `active_world_size` ranks may (the rest are warm spares)."""
    if active_world_size is None:
        return None
    if active_world_size % nproc:
        raise UsageError(f"active_world_size {active_world_size} must be a multiple of --nproc-per-node "
                         f"({nproc} ranks per node): whole nodes train or stand by")
    nodes = active_world_size // nproc
    if nodes > max_nodes:
        raise UsageError(f"active_world_size {active_world_size} needs {nodes} nodes of {nproc} rank{'s' if nproc != 1 else ''}, "
                         f"but the job has at most {max_nodes} node{'s' if max_nodes != 1 else ''} (--nnodes)")
    return nodes


def parse_endpoint(text: str, default_port: int) -> tuple:
    host, sep, port = text.rpartition(":") if text.count(":") == 1 or text.startswith("[") else (text, "", "")
    if not sep:
        return text or "127.0.0.1", default_port
    host = host.strip("[]")
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise UsageError(f"--rdzv-endpoint: bad port in {text!r}")
    return host or "127.0.0.1", int(port)


def parse_ranks_filter(text: str) -> Optional[Set[int]]:
    """--local-ranks-filter 0,1: the local ranks shown on the console (None: all)."""
    if not text:
        return None
    try:
        return {int(x) for x in text.split(",") if x.strip()}
    except ValueError:
        raise UsageError(f"--local-ranks-filter: expected e.g. 0,1, got {text!r}") from None


def check_metrics_port(port: Optional[int]) -> None:
    """--metrics-port is a TCP port (or not given)."""
    if port is not None and not 0 < port < 65536:
        raise UsageError(f"--metrics-port: expected a port 1-65535, got {port}")
