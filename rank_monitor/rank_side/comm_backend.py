"""Which communication backend a process group really uses, per device type, whatever way
`init_process_group` was called; the rank's live state and in-place restart ask it.

`dist.get_backend()` returns the string the group was made with: "nccl", but also "undefined"
(`init_process_group()` with no backend: torch picks the accelerator's backend, NCCL on a GPU
machine) or "cpu:gloo,cuda:nccl" (one backend per device type). So `get_backend() == "nccl"` misses
two of the ways a job runs NCCL. torch keeps the resolved map as the group's backend config
(`get_backend_config`: "cuda:nccl", "cpu:gloo,cuda:nccl", "cpu:gloo,cuda:gloo"); this module reads
it (and falls back to parsing the backend string the way torch's BackendConfig does).

- `device_backends(group)`: {"cuda": "nccl", "cpu": "gloo"} for the default group (or `group`);
  {} when there is no group.
- `has_nccl(group)`: some device of the group communicates over NCCL, whose communicators can be
  aborted from another thread (rank_monitor.rank_side.nccl_watch).
- `transfer_device()`: where LiveState moves tensors: the current CUDA device when CUDA tensors
  go over NCCL, else the CPU.
Nothing here imports torch: it uses the torch the rank has imported (none: no group).
"""
from __future__ import annotations

import sys
from typing import Dict, Optional

# torch's Backend.backend_capability for the names it knows (a single backend name -> its devices)
_CAPABILITY = {"gloo": ("cpu", "cuda"), "nccl": ("cuda",), "xccl": ("xpu",), "ucc": ("cpu", "cuda"),
               "mpi": ("cpu", "cuda"), "fake": ("cpu", "cuda", "hpu", "xpu")}


def parse(config: str, accelerator: str = "cuda") -> Dict[str, str]:
    """A backend string or config -> {device type: backend}: "cpu:gloo,cuda:nccl" as written,
    "nccl" by its capability ({"cuda": "nccl"}), "undefined" as the accelerator's default
    (`accelerator`: "cuda" -> nccl, "cpu" -> gloo); an unknown name serves cpu and cuda (as torch)."""
    text = (config or "").strip().lower()
    if not text:
        return {}
    if ":" in text:
        out = {}
        for pair in text.split(","):
            device, _, backend = pair.strip().partition(":")
            if device and backend:
                out[device] = backend
        return out
    if text == "undefined":
        default = {"cuda": "nccl", "cpu": "gloo", "xpu": "xccl", "mps": "gloo"}.get(accelerator)
        return {accelerator: default} if default else {}
    return {device: text for device in _CAPABILITY.get(text, ("cpu", "cuda"))}


def _dist():
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def device_backends(group=None) -> Dict[str, str]:
    """{device type: backend} of the default group (or `group`); {} without one."""
    dist = _dist()
    if dist is None:
        return {}
    try:
        return parse(dist.get_backend_config(group))
    except Exception:  # noqa: BLE001 - an older torch or an odd group: read the backend string
        pass
    try:
        torch = sys.modules["torch"]
        acc = torch._C._get_accelerator().type if hasattr(torch._C, "_get_accelerator") else "cpu"
        return parse(str(dist.get_backend(group)), acc)
    except Exception:  # noqa: BLE001 - no group after all
        return {}


def has_nccl(group=None) -> bool:
    return "nccl" in device_backends(group).values()


def transfer_device(backends: Optional[Dict[str, str]] = None):
    """torch.device for LiveState's transfers over the default group (see the module docstring)."""
    import torch

    backends = device_backends() if backends is None else backends
    if backends.get("cuda") == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if "cpu" in backends or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())   # a CUDA-only backend that is not NCCL
