"""An NVRx training script using the sections API, written as NVRx's examples are; only the
import differs (`from ft_launcher import ...` for `from nvidia_resiliency_ext.fault_tolerance
import ...`). Sections setup / step / checkpointing; after each epoch the section timeouts are
calculated and set, and the client's state_dict() goes into the script's own checkpoint, from
which a restarted rank restores it. See nvrx_train_common for the arguments.
"""
import time

import torch.distributed as dist

import nvrx_train_common as common
from ft_launcher import (FaultToleranceConfig, RankMonitorClient, RankMonitorClientError, WorkloadAction,
                         WorkloadControlRequest)

args = common.parse_args()
dist.init_process_group("gloo")

ft_client = RankMonitorClient()
ft_client.init_workload_monitoring()
assert ft_client.is_initialized and ft_client.rank_info.global_rank == dist.get_rank()
try:
    ft_client.init_workload_monitoring()
    raise SystemExit("a second init_workload_monitoring must raise RankMonitorClientError")
except RankMonitorClientError:
    pass
if args.ft_cfg:   # the configuration the job was started with, as NVRx's constructors read it
    from_file = FaultToleranceConfig.from_yaml_file(args.ft_cfg)
    assert ft_client.cfg.rank_section_timeouts == from_file.rank_section_timeouts, ft_client.cfg
    assert ft_client.cfg.safety_factor == from_file.safety_factor
assert ft_client.cfg.rank_termination_signal.name == "SIGKILL"
assert FaultToleranceConfig.from_kwargs(safety_factor=3.0, unknown_key=1).safety_factor == 3.0

ft_client.start_section("setup")
model, opt = common.build()
start_epoch, ft_state = common.load_checkpoint(args.out, model, opt)
if ft_state is not None:
    ft_client.load_state_dict(ft_state)
timeouts = ft_client.section_timeouts
common.report(args.out, "loaded", {
    "section": timeouts.section, "out_of_section": timeouts.out_of_section,
    "calculated_sections": timeouts.calculated_sections,
    "is_out_of_section_calculated": timeouts.is_out_of_section_calculated,
    "were_calculated": timeouts.were_calculated, "are_valid": timeouts.are_valid,
    "loaded_section_timeouts": ft_client.loaded_section_timeouts, "restored_from": ft_state})
ft_client.end_section("setup")

for epoch in range(start_epoch, args.epochs):
    common.maybe_hang(args, epoch)
    for step in range(args.steps_per_epoch):
        ft_client.start_section("step")
        common.train_step(model, opt, epoch, step)
        time.sleep(args.step_time)
        ft_client.end_section("step")
    # NVRx: a collective; every rank calls it. Not enough data yet is an error unless skipped.
    before = ft_client.section_timeouts
    ft_client.calculate_and_set_section_timeouts(skip_if_not_ready=False)
    after = ft_client.section_timeouts
    for name in before.calculated_sections:   # a later calculation never lowers a computed timeout
        assert after.section[name] >= before.section[name], (name, before, after)
    ft_client.start_section("checkpointing")
    common.save_checkpoint(args.out, model, opt, epoch, ft_client.state_dict())
    ft_client.end_section("checkpointing")
    common.progress(args.out, epoch)

ft_client.send_workload_control_request(WorkloadControlRequest(WorkloadAction.Continue, "done"))
common.report(args.out, "final", {"section_timeouts": ft_client.section_timeouts, "state": ft_client.state_dict()})
ft_client.shutdown_workload_monitoring()
assert not ft_client.is_initialized
common.finish()
