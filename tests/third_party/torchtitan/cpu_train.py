"""torchtitan 0.3.0's own trainer (`torchtitan.train.main`) on a CPU, under ft_launcher, torchrun
or plain python; the command line is torchtitan's (`--module titan_cpu_config --config
cpu_debugmodel --dump_folder D ...`).

What torchtitan needs on a CPU (README.md beside this file lists why), done here before torchtitan
is imported, without editing torchtitan and without downloading anything:
- its device probe (`_get_available_device_type() or "cuda"`, read once when
  torchtitan.tools.utils is imported) answers "cpu"; gloo then comes from torch's backend map, and
  a stand-in for what `torch.cpu` lacks (device name, properties, memory statistics) keeps
  torchtitan's memory monitor quiet;
- `torch.distributed.set_timeout` (torch 2.14) is aliased to `distributed_c10d._set_pg_timeout`;
- FlexAttention's compiled call (torch has no FlexAttention backward on a CPU) is replaced by plain
  masked attention over the dense mask of the BlockMask's own `mask_mod`; the BlockMask itself is
  made by `create_block_mask` uncompiled (torch.compile of it costs each process ~30 s on 2 cores).
Then ft_launcher's adapter (ft_launcher.integrations.torchtitan) is installed: sections always, a
LiveState when TITAN_LIVE=1 (`buddy_every` from TITAN_BUDDY_EVERY, default 1).

What the tests and the bench read (TITAN_OUT, a folder):
- `steps_rank<R>.jsonl`: one line per step as it starts: {"step", "t" (wall time), "pid"};
- `result_rank<R>.json` at the end of training: the last step, its loss (rank 0's log), and the
  SHA-256 of every parameter gathered whole (`full_tensor()`, in name order): equal digests mean
  bit-equal models.
A reference run in pieces: TITAN_STOP_AFTER=k ends every rank (exit 0) once step k and its checkpoint
are done; TITAN_PARTIAL_LOAD=1 loads torchtitan's checkpoint with DCP's `allow_partial_load` (a key
the checkpoint lacks, e.g. a loader position of a data-parallel rank that was away, keeps its value
as built).
A fault: TITAN_FAIL_STEP=k and TITAN_FAIL_RANK=r SIGKILL rank r as step k starts, once (a marker
file in TITAN_OUT says it happened; the restarted rank trains on).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import sys
import time

import torch
import torch._utils

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)   # titan_cpu_config, for torchtitan's --module


# ---- the CPU, before torchtitan.tools.utils is imported -------------------------------------
class _CpuDeviceModule:
    """torch.cpu, plus what torchtitan's memory monitor asks of a device module."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def get_device_name(device=None):
        return "cpu"

    @staticmethod
    def get_device_properties(device=None):
        import psutil

        class Properties:
            total_memory = psutil.virtual_memory().total
        return Properties()

    @staticmethod
    def current_device():
        return 0

    @staticmethod
    def memory_stats(device=None):
        return {}

    @staticmethod
    def reset_peak_memory_stats(device=None):
        return None

    @staticmethod
    def empty_cache():
        return None


_probe = torch._utils._get_available_device_type
torch._utils._get_available_device_type = lambda: "cpu"
import torchtitan.tools.utils as _titan_utils  # noqa: E402

torch._utils._get_available_device_type = _probe
_titan_utils.device_module = _CpuDeviceModule()

import torch.distributed as dist  # noqa: E402
from torch.distributed import distributed_c10d  # noqa: E402

if not hasattr(dist, "set_timeout"):
    dist.set_timeout = distributed_c10d._set_pg_timeout


def _masked_attention(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
    """FlexAttention's call, as plain attention under the dense mask of `block_mask.mask_mod`."""
    from torch.nn.attention.flex_attention import AuxOutput, create_mask

    if score_mod is not None:
        raise NotImplementedError("cpu_train.py's masked attention takes no score_mod")
    batch, heads, length, dim = q.shape
    if k.shape[1] != heads:
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        v = v.repeat_interleave(heads // v.shape[1], dim=1)
    mask = create_mask(block_mask.mask_mod, batch, 1, length, k.shape[-2], device=q.device)
    scores = (q @ k.transpose(-2, -1)) * (scale if scale is not None else 1.0 / math.sqrt(dim))
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    out = torch.exp(scores - lse) @ v
    return out, AuxOutput(lse=lse.squeeze(-1) if return_aux is not None and return_aux.lse else None)


import torchtitan.models.common.attention as _titan_attention  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask  # noqa: E402

_titan_attention.FlexAttention.compiled_flex_attn = staticmethod(_masked_attention)
_titan_attention._compiled_create_block_mask = create_block_mask   # not compiled: 30 s less per start

# ---- ft_launcher's adapter, then what the tests read ----------------------------------------
from ft_launcher.integrations import torchtitan as ft_titan  # noqa: E402

LIVE = os.environ.get("TITAN_LIVE") == "1"
ft_titan.install(live=LIVE, **({"buddy_every": int(os.environ.get("TITAN_BUDDY_EVERY", "1"))} if LIVE else {}))

from torchtitan.components.metrics import MetricsProcessor  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

OUT = os.environ.get("TITAN_OUT")
RANK = int(os.environ.get("RANK", "0"))
FAIL_STEP = int(os.environ.get("TITAN_FAIL_STEP", "0"))
FAIL_RANK = int(os.environ.get("TITAN_FAIL_RANK", "1"))
_losses: dict = {}
STOP_AFTER = int(os.environ.get("TITAN_STOP_AFTER", "0"))
if os.environ.get("TITAN_PARTIAL_LOAD") == "1":
    import torch.distributed.checkpoint as _dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    _dcp_load = _dcp.load

    def _partial_load(*args, **kwargs):
        kwargs.setdefault("planner", DefaultLoadPlanner(allow_partial_load=True))
        return _dcp_load(*args, **kwargs)
    _dcp.load = _partial_load


def _write_line(name: str, record: dict) -> None:
    if OUT:
        with open(os.path.join(OUT, name), "a") as f:
            f.write(json.dumps(record) + "\n")


_train_step = Trainer.train_step


def train_step(self, *args, **kwargs):
    if STOP_AFTER and self.step == STOP_AFTER + 1:   # step STOP_AFTER and its checkpoint are done
        dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    _write_line(f"steps_rank{RANK}.jsonl", {"step": self.step, "t": time.time(), "pid": os.getpid()})
    mark = os.path.join(OUT or ".", "fault_done")
    if FAIL_STEP and self.step == FAIL_STEP and RANK == FAIL_RANK and not os.path.exists(mark):
        open(mark, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return _train_step(self, *args, **kwargs)


Trainer.train_step = train_step
_log = MetricsProcessor.log


def log(self, step, global_avg_loss, *args, **kwargs):
    _losses[step] = global_avg_loss
    return _log(self, step, global_avg_loss, *args, **kwargs)


MetricsProcessor.log = log
_train = Trainer.train


def train(self):
    _train(self)
    digest = hashlib.sha256()
    for name, param in sorted(self.model_parts[0].named_parameters()):
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        digest.update(name.encode())
        digest.update(full.detach().contiguous().cpu().numpy().tobytes())
    if OUT:
        with open(os.path.join(OUT, f"result_rank{RANK}.json"), "w") as f:
            json.dump({"step": self.step, "loss": _losses.get(self.step), "checksum": digest.hexdigest()}, f)
        # what bench/live_overhead.py reads: this rank's peak RSS, its state's bytes, the LiveState's figures
        live = getattr(self, "_ft_launcher_live", None)
        state = sum(t.numel() * t.element_size() for t in _local_tensors(self))
        with open(os.path.join(OUT, f"stats_rank{RANK}.json"), "w") as f:
            json.dump({"peak_rss_kb": _peak_rss_kb(), "state_bytes": state,
                       "live": dict(live.stats) if live is not None else None}, f)


def _local_tensors(trainer):
    """This rank's parameters and optimizer state (their local shards)."""
    out = []
    for part in trainer.model_parts:
        out += [p.to_local() if hasattr(p, "to_local") else p for p in part.parameters()]
    for optim in trainer.optimizers.optimizers:
        for state in optim.state.values():
            out += [v.to_local() if hasattr(v, "to_local") else v for v in state.values() if torch.is_tensor(v)]
    return out


def _peak_rss_kb() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


Trainer.train = train

if __name__ == "__main__":
    from torchtitan.train import main

    if LIVE:
        ft_titan.run(main)
    else:
        main()
