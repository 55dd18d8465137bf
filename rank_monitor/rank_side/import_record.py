"""What a rank had imported when it reached its first `step`, and what of it a warm reserve
imports before it is needed, so that the rank it becomes finds those modules already loaded.

The rank side (`record`, called once by the client when the section `step` is first used)
writes `{"modules": [[name, file], ...], "cuda_device": int|null, "torch_environ": {name:
value|null}, "when": t}` atomically to the file the agent names in FT_LAUNCHER_IMPORTS_FILE;
`torch_environ` holds the variables of TORCH_IMPORT_ENV (those torch reads when it is imported or
makes a CUDA context: OpenMP's, TORCH_LOGS, the compiler's and allocator's settings, the visible
devices) that differ from the environment the process started with (the block a cold rank
started with, /proc/self/environ; a warm one's activation environment), null where removed. The
reserve side (`modules_to_import`) reads it and keeps, in the order the rank imported them, by the `reserve_preimport` key:
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
except with none. A script may set a variable of torch_environ before `import torch`: once a
reserve has imported torch, `environ_conflicts` names those whose value it does not share (what
torch sets itself at import, TORCHINDUCTOR_CACHE_DIR, it shares), and the agent then starts that
slot's reserves with none (agent.ranks.reserve_pool). No mode makes a CUDA context for a script
that chose its devices itself (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER). Torch-free and cheap to
import.
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
                                            "torch_environ": _torch_environ(), "when": time.time()}))
    except Exception:  # noqa: BLE001 - a warm-up hint must never hurt the rank
        pass


def _torch_environ() -> Dict[str, Optional[str]]:
    """TORCH_IMPORT_ENV's variables that differ from the environment this process started with
    (None: removed); {} where that is unknown."""
    start = started_environ
    if start is None:
        try:
            with open("/proc/self/environ", "rb") as fh:
                start = dict(item.decode(errors="replace").split("=", 1)
                             for item in fh.read().split(b"\0") if b"=" in item)
        except OSError:
            return {}
    now = dict(os.environ)
    return {k: now.get(k) for k in sorted(set(now) | set(start))
            if now.get(k) != start.get(k) and (k in TORCH_IMPORT_ENV or k.startswith(TORCH_IMPORT_ENV_PREFIXES))}


def load(path: Optional[str]) -> Tuple[List[List[Optional[str]]], Optional[int], Dict[str, Optional[str]]]:
    """(modules, cuda_device, torch_environ) from a record file; ([], None, {}) when there is
    none or it is bad."""
    if not path:
        return [], None, {}
    try:
        with open(path) as fh:
            data = json.load(fh)
        modules = [m for m in data.get("modules", []) if isinstance(m, list) and len(m) == 2]
        device = data.get("cuda_device")
        environ = data.get("torch_environ") or {}
        environ = {k: v for k, v in environ.items() if isinstance(k, str) and (v is None or isinstance(v, str))}
        return modules, device if isinstance(device, int) else None, environ
    except (OSError, ValueError, AttributeError):
        return [], None, {}


def environ_conflicts(path: Optional[str]) -> List[str]:
    """The variables the rank of a record had set (torch_environ) whose value this process's
    environment does not have: in a reserve that has imported torch, what torch saw otherwise
    than it may have in the rank."""
    return sorted(k for k, v in load(path)[2].items() if os.environ.get(k) != v)


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
    recorded, device, environ = load(path)
    if set(environ) & set(CUDA_ENV):   # the script chose its devices: the context is its own to make
        device = None
    names = [name for name, file in recorded
             if name and not name.startswith(_SKIP_PREFIXES) and not is_user_code(file, user_dir)]
    if preimport != "recorded":
        names = [name for name in names if name.partition(".")[0] in PREIMPORTED_PACKAGES]
    return (names or list(DEFAULT_MODULES)), device
