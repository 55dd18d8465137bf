"""An NVRx training script using the heartbeat API, written as NVRx's examples are; only the
import differs. A heartbeat after every step; after each epoch the heartbeat timeouts are
calculated and set (once enough heartbeats were seen), and the client's state_dict() goes into
the script's own checkpoint, from which a restarted rank restores it. See nvrx_train_common.
"""
import time

import torch.distributed as dist

import nvrx_train_common as common
from ft_launcher import FaultToleranceConfig, RankMonitorClient, RankMonitorClientError

args = common.parse_args()
dist.init_process_group("gloo")

ft_client = RankMonitorClient()
ft_client.init_workload_monitoring()
assert ft_client.is_initialized
# before any heartbeat there is nothing to calculate from: NVRx raises, or returns False if asked
assert ft_client.calculate_and_set_hb_timeouts(skip_if_not_ready=True) is False
try:
    ft_client.calculate_and_set_hb_timeouts()
    raise SystemExit("calculate_and_set_hb_timeouts without heartbeats must raise RankMonitorClientError")
except RankMonitorClientError:
    pass
if args.ft_cfg:
    from_file = FaultToleranceConfig.from_yaml_file(args.ft_cfg)
    assert ft_client.cfg.rank_heartbeat_timeout == from_file.rank_heartbeat_timeout, ft_client.cfg
    assert ft_client.cfg.initial_rank_heartbeat_timeout == from_file.initial_rank_heartbeat_timeout

model, opt = common.build()
start_epoch, ft_state = common.load_checkpoint(args.out, model, opt)
if ft_state is not None:
    ft_client.load_state_dict(ft_state)
hb = ft_client.hb_timeouts
common.report(args.out, "loaded", {
    "initial": hb.initial, "subsequent": hb.subsequent, "were_calculated": hb.were_calculated,
    "are_valid": hb.are_valid, "loaded_hb_timeouts": ft_client.loaded_hb_timeouts, "restored_from": ft_state})
ft_client.send_heartbeat()

for epoch in range(start_epoch, args.epochs):
    common.maybe_hang(args, epoch)
    for step in range(args.steps_per_epoch):
        common.train_step(model, opt, epoch, step)
        time.sleep(args.step_time)
        ft_client.send_heartbeat()
    ft_client.calculate_and_set_hb_timeouts()
    common.save_checkpoint(args.out, model, opt, epoch, ft_client.state_dict())
    common.progress(args.out, epoch)

common.report(args.out, "final", {"hb_timeouts": ft_client.hb_timeouts, "state": ft_client.state_dict()})
ft_client.shutdown_workload_monitoring()
common.finish()
