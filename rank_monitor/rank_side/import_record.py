"""What a rank had imported when it reached its first `step`, and what of it a warm reserve
imports before it is needed, so that the rank it becomes finds those modules already loaded.

The rank side (`record`, called once by the client when the section `step` is first used)
writes `{"modules": [[name, file], ...], "cuda_device": int|null, "environ_set": [name, ...],
"when": t}` atomically to the file the agent names in FT_LAUNCHER_IMPORTS_FILE; `environ_set`
names the variables the process set, changed or removed since it started (the block a cold rank
started with, /proc/self/environ; a warm one's activation environment). The reserve side (`modules_to_import`) reads it
and keeps, in the order the rank imported them, by the `reserve_preimport` key:
  torch     (the default) the modules of torch and of ft_launcher the rank imported: nothing a
            script sets up before importing it (a patched attribute, an environment variable, a
            monkey-patched stdlib) changes what they are, except what torch itself reads at import
  recorded  every library module: not `__main__`, not the training script's own code (a module
            whose file lies under the script's directory, outside site-packages), whose import
            side effects must run only once the rank is activated. A third-party library imported
            ahead misses what the script does before importing it (torchtitan's device probe
            copies torch._utils' at import, and a script on a CPU patches that first)
  none      nothing: the reserve runs the script as a cold interpreter would, only started
Without a record (no incarnation has reached `step` yet) torch and what DDP imports lazily,
except with none. A script that set a variable torch reads when it is imported or makes its
CUDA context (TORCH_IMPORT_ENV: OpenMP's, TORCH_LOGS, the compiler's and allocator's settings,
the visible devices) may have set it before `import torch`: with `torch` the reserve then imports
nothing (`torch_environ_set` names them, for the agent's one line), and with either mode it makes
no CUDA context when the script chose its devices itself. Torch-free and cheap to import.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Dict, List, Optional, Tuple

from ft_launcher.rank_monitor import atomic_file

ENV_IMPORTS_FILE = "FT_LAUNCHER_IMPORTS_FILE"

# Before any incarnation has run: torch, and what DDP's constructor imports lazily (torch._dynamo
# alone is 1.4-1.9 s on a 2-core machine).
DEFAULT_MODULES = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo")

_SKIP_PREFIXES = ("__main__", "__mp_main__", "_frozen_importlib", "__editable__")
# What `reserve_preimport: torch` imports ahead: packages whose import a script cannot have set up
PREIMPORTED_PACKAGES = ("torch", "ft_launcher")
# Variables torch reads when it is imported (OpenMP and MKL when they load, TORCH_LOGS, C++ logging,
# the compiler's config modules) or when it makes a CUDA context (the visible devices, the allocator)
TORCH_IMPORT_ENV = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "PYTORCH_CUDA_ALLOC_CONF", "TORCH_LOGS",
                    "TORCH_CPP_LOG_LEVEL", "TORCH_SHOW_CPP_STACKTRACES")
TORCH_IMPORT_ENV_PREFIXES = ("OMP_", "MKL_", "KMP_", "TORCHINDUCTOR_", "TORCHDYNAMO_", "TORCH_COMPILE_")
CUDA_ENV = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")

# A warm rank's environment as the agent handed it at activation (agent.ranks.reserve_process sets it)
started_environ: Optional[Dict[str, str]] = None


def record(path: Optional[str] = None) -> None:
    """Write this process's imported modules (rank side). Never raises."""
    path = path or os.environ.get(ENV_IMPORTS_FILE)
    if not path:
        return
    try:
        modules = []
        for name, module in list(sys.modules.items()):
            if module is None or name.startswith(_SKIP_PREFIXES):
                continue
            modules.append([name, getattr(module, "__file__", None)])
        cuda_device = None
        torch = sys.modules.get("torch")
        if torch is not None:
            try:
                if torch.cuda.is_initialized():
                    cuda_device = int(torch.cuda.current_device())
            except Exception:  # noqa: BLE001 - a broken CUDA install is not our concern here
                cuda_device = None
        atomic_file.write(path, json.dumps({"modules": modules, "cuda_device": cuda_device,
                                            "environ_set": _environ_set(), "when": time.time()}))
    except Exception:  # noqa: BLE001 - a warm-up hint must never hurt the rank
        pass


def _environ_set() -> List[str]:
    """The variables this process set, changed or removed since it started ([] where that is unknown)."""
    start = started_environ
    if start is None:
        try:
            with open("/proc/self/environ", "rb") as fh:
                start = dict(item.decode(errors="replace").split("=", 1)
                             for item in fh.read().split(b"\0") if b"=" in item)
        except OSError:
            return []
    now = dict(os.environ)
    return sorted(k for k in set(now) | set(start) if now.get(k) != start.get(k))


def load(path: Optional[str]) -> Tuple[List[List[Optional[str]]], Optional[int], List[str]]:
    """(modules, cuda_device, environ_set) from a record file; ([], None, []) when there is none
    or it is bad."""
    if not path:
        return [], None, []
    try:
        with open(path) as fh:
            data = json.load(fh)
        modules = [m for m in data.get("modules", []) if isinstance(m, list) and len(m) == 2]
        device = data.get("cuda_device")
        environ_set = [n for n in data.get("environ_set", []) if isinstance(n, str)]
        return modules, device if isinstance(device, int) else None, environ_set
    except (OSError, ValueError, AttributeError):
        return [], None, []


def torch_environ_set(path: Optional[str]) -> List[str]:
    """The variables torch reads at import (or for its CUDA context) that the rank of a record set itself."""
    return _read_by_torch(load(path)[2])


def _read_by_torch(names: List[str]) -> List[str]:
    return [n for n in names if n in TORCH_IMPORT_ENV or n.startswith(TORCH_IMPORT_ENV_PREFIXES)]


def is_user_code(file: Optional[str], user_dir: Optional[str]) -> bool:
    """A module of the training script's own tree (not a library installed in it)."""
    if not file or not user_dir:
        return False
    file = os.path.realpath(file)
    user_dir = os.path.realpath(user_dir)
    if not file.startswith(user_dir.rstrip(os.sep) + os.sep):
        return False
    parts = file[len(user_dir):].split(os.sep)
    return not any(p in ("site-packages", "dist-packages") for p in parts)


def user_code_dir(kind: str, target: str) -> str:
    """Where the training code of a launch lives: the script's directory, the cwd for -m."""
    return os.getcwd() if kind == "module" else os.path.dirname(os.path.realpath(target))


def modules_to_import(path: Optional[str], user_dir: Optional[str],
                      preimport: str = "torch") -> Tuple[List[str], Optional[int]]:
    """The names a reserve imports (by `preimport`: torch, recorded or none; see the module
    docstring), in the order the rank imported them, and its CUDA device."""
    if preimport == "none":
        return [], None
    recorded, device, environ_set = load(path)
    if set(environ_set) & set(CUDA_ENV):   # the script chose its devices: the context is its own to make
        device = None
    names = [name for name, file in recorded
             if name and not name.startswith(_SKIP_PREFIXES) and not is_user_code(file, user_dir)]
    if preimport != "recorded":
        if _read_by_torch(environ_set):
            return [], None
        names = [name for name in names if name.partition(".")[0] in PREIMPORTED_PACKAGES]
    return (names or list(DEFAULT_MODULES)), device
