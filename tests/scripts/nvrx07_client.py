"""An NVRx 0.7 training script's client calls, under ft_launcher: init_workload_monitoring with
NVRx 0.7's `num_warmup_iters`, the config's 0.7 keys, a section, then (with
--ft-install-exception-hook true) an uncaught exception in cycle 0 after the client is initialized.

    nvrx07_client.py"""
import os

from ft_launcher import RankMonitorClient

client = RankMonitorClient()
client.init_workload_monitoring(num_warmup_iters=3)
cfg = client.cfg
print(f"rank {os.environ['RANK']} initialized={client.is_initialized} warmup={client.num_warmup_iters} "
      f"hook={cfg.install_exception_hook} reclaim={cfg.gpu_memory_reclaim_timeout}", flush=True)
client.start_section("step")
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
    raise RuntimeError("client rank fails")
client.end_section("step")
client.shutdown_workload_monitoring()
