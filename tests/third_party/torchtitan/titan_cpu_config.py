"""torchtitan's llama3 `debugmodel` config, made to train on a CPU (`--module titan_cpu_config
--config cpu_debugmodel`; torchtitan 0.3.0's configs are Python functions).

It starts from torchtitan's own `llama3_debugmodel()` and changes only what a CPU needs or what
keeps the run short (the rest: torchtitan's model, dataloader, AdamW, warmup/decay LR schedule and
DCP checkpointing, as torchtitan ships them):
- the tokenizer and data set the wheel does not ship (titan_assets.py writes them), from
  TITAN_ASSETS (`--hf_assets_path` and `--dataloader.dataset_path` may still override them);
- `parallelism.spmd_backend = "partial_dtensor"`: the default fails in `fully_shard` on torch 2.13;
- gloo has no PREMUL_SUM: every FSDP module gets `set_force_sum_reduction_for_comms(True)`, after
  torchtitan's own parallelize function ran (torchtitan already sets the divide factor to 1);
- float32 parameters (mixed precision in bf16 is slow on a CPU and not needed for a test),
  seq_len 256, 2 sequences per rank, a fixed seed (every run starts from the same weights), no
  validation, no activation checkpointing, logging every step, a checkpoint every 10 steps, gc
  every step (the garbage collector then never runs inside a step at different times).
"""
from __future__ import annotations

import os

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.models.llama3.config_registry import llama3_debugmodel


def _force_sum_reduction(parallelize_fn):
    def parallelize(model, **kwargs):
        from torch.distributed.fsdp import FSDPModule

        model = parallelize_fn(model, **kwargs)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        return model

    return parallelize


def cpu_debugmodel():
    config = llama3_debugmodel()
    assets = os.environ.get("TITAN_ASSETS", "titan_assets")
    config.hf_assets_path = os.path.join(assets, "tokenizer")
    config.dataloader.dataset_path = os.path.join(assets, "c4_local")
    config.model_spec.parallelize_fn = _force_sum_reduction(config.model_spec.parallelize_fn)
    config.parallelism.spmd_backend = "partial_dtensor"
    config.training.seq_len = 256
    config.training.local_batch_size = 2
    config.training.steps = 24
    config.training.mixed_precision_param = "float32"
    config.training.gc_freq = 1
    config.training.disable_cuda_graphs = True
    config.debug.seed = 42
    config.validator.enable = False
    config.activation_checkpoint = None
    config.checkpoint = CheckpointManager.Config(enable=True, interval=10, last_save_model_only=False)
    config.comm.init_timeout_seconds = 120
    config.comm.train_timeout_seconds = 60
    config.comm.trace_buf_size = 0
    return config
