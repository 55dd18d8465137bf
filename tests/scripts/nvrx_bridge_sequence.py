"""Megatron-Bridge's fault-tolerance call sequence, made with NVRx's own RankMonitorClient,
unchanged: what a Megatron-Bridge job (`FaultToleranceConfig(enable_ft_package=True,
calc_ft_timeouts=True, ...)`) does to the client, so that it runs under ft_launcher as it is.

The sequence is that of megatron/bridge/training/fault_tolerance.py (setup, on_training_step_start
/ _end, on_checkpointing_start / _end, on_checkpoint_loaded, _maybe_update_timeouts, shutdown):
RankMonitorClient(); init_workload_monitoring(); load_state_dict(<checkpoint dir>/ft_state.json)
when it exists; start_section("setup"), closed at the first training step; the first step
(_NUM_WARMUP_ITERS) outside any section; every later step in "step"; each checkpoint in
"checkpointing", after which calculate_and_set_section_timeouts(selected_sections=..., 
calc_out_of_section=False) runs on every rank (it is collective) for "setup" (once a persistent
checkpoint was loaded), "step" (after 16 steps) and "checkpointing", and rank 0 writes state_dict()
to ft_state.json; at the end the same with calc_out_of_section=True, then
shutdown_workload_monitoring(). A tiny DDP model on gloo stands in for the model.

    nvrx_bridge_sequence.py OUT --steps N --save-interval K [--hang R:C:S] [--kill R:C:S] [--exclude R:C:S]
                            [--rerun-exit CODE:R:C:S [--rerun-fatal]]

R:C:S = global rank R, in cycle C, at training step S: --hang stops the rank (SIGSTOP, Bridge's
simulated rank_hung), --kill kills it (SIGKILL, rank_killed), --exclude sends NVRx's
WorkloadControlRequest(ExcludeThisNode) and trains on until the launcher stops it.
--rerun-exit CODE:R:C:S does what Megatron's rerun state machine does when rank R's result at step S
is rejected twice on its GPU (CODE 16) or fails validation (17): every rank (the decision is
collective) saves the checkpoint at step S (16), writes OUT/suspect.json (R's host and LOCAL_RANK:
Megatron's os.uname()[1] and torch.cuda.current_device()) and exits CODE. In the cycle after a 16,
rank R re-runs step S and does Megatron's check: on the same host and device, every rank exits 16
again; else every rank exits 17 with --rerun-fatal, or trains on. Every rank appends
`cycle host LOCAL_RANK FT_LAUNCHER_RERUN_OF FT_LAUNCHER_RERUN_MOVED` to OUT/hw_rank<r>.txt once set up.
Each rank appends `cycle step pid` to OUT/rank_<r>.txt after every step and writes
OUT/loaded_rank<r>_cycle<c>.json once set up (the timeouts it loaded) and
OUT/report_rank<r>_cycle<c>.json at the end (those in effect, the updates made, its state_dict()).
"""
import argparse
import dataclasses
import json
import os
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient
from nvidia_resiliency_ext.fault_tolerance.data import WorkloadAction, WorkloadControlRequest

NUM_WARMUP_ITERS = 1                     # Bridge's _NUM_WARMUP_ITERS
MIN_ITERS_FOR_STEP_TIMEOUT_UPDATE = 16   # Bridge's _MIN_ITERS_FOR_STEP_TIMEOUT_UPDATE


def where(text):
    if not text:
        return None
    rank, cycle, step = (int(x) for x in text.split(":"))
    return rank, cycle, step


p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--steps", type=int, default=50)
p.add_argument("--save-interval", type=int, default=10)
p.add_argument("--hang", type=where)
p.add_argument("--kill", type=where)
p.add_argument("--exclude", type=where)
p.add_argument("--rerun-exit", type=lambda t: tuple(int(x) for x in t.split(":")))
p.add_argument("--rerun-fatal", action="store_true")
args = p.parse_args()

dist.init_process_group("gloo")
rank, cycle = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
ckpt_dir = os.path.join(args.out, "ckpt")
os.makedirs(ckpt_dir, exist_ok=True)


class FtState:   # Bridge's fault_tolerance_state
    ft_state_path = os.path.join(ckpt_dir, "ft_state.json")
    is_persistent_chkpt_loaded = False
    is_setup_section_open = False
    seen_tr_iters_cnt = 0
    seen_checkpoints_cnt = 0


ft_state = FtState()
timeline = {"loaded": None, "updates": []}


def section_view(client):
    st = client.section_timeouts
    return {"section": dict(st.section), "out_of_section": st.out_of_section,
            "calculated_sections": sorted(st.calculated_sections),
            "is_out_of_section_calculated": st.is_out_of_section_calculated}


# ---- fault_tolerance.setup -----------------------------------------------------------------------
client = RankMonitorClient()
client.init_workload_monitoring()
if os.path.exists(ft_state.ft_state_path):   # _load_state_if_exists
    with open(ft_state.ft_state_path) as f:
        client.load_state_dict(json.load(f))
    timeline["loaded"] = section_view(client)
client.start_section("setup")
ft_state.is_setup_section_open = True
with open(os.path.join(args.out, f"loaded_rank{rank}_cycle{cycle}.json"), "w") as f:
    json.dump(timeline["loaded"], f)

torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
start = 0
ckpt_path = os.path.join(ckpt_dir, "model.pt")
if os.path.exists(ckpt_path):
    ckpt = torch.load(ckpt_path, weights_only=True)
    model.module.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    start = int(ckpt["step"])
    ft_state.is_persistent_chkpt_loaded = True   # on_checkpoint_loaded(is_local_chkpt=False)


def maybe_update_timeouts(is_closing_ft=False):   # Bridge's _maybe_update_timeouts (calc_ft_timeouts=True)
    sections = []
    if ft_state.is_persistent_chkpt_loaded:
        sections.append("setup")
    if ft_state.seen_tr_iters_cnt >= MIN_ITERS_FOR_STEP_TIMEOUT_UPDATE:
        sections.append("step")
    if ft_state.seen_checkpoints_cnt > 0:
        sections.append("checkpointing")
    out_of_section = is_closing_ft and {"setup", "step"} <= set(sections) and ft_state.seen_checkpoints_cnt > 0
    if sections or out_of_section:
        client.calculate_and_set_section_timeouts(selected_sections=sections, calc_out_of_section=out_of_section)
        timeline["updates"].append(sections + (["out_of_section"] if out_of_section else []))
        if rank == 0:
            with open(ft_state.ft_state_path, "w") as f:
                json.dump(client.state_dict(), f)


def fault_here(spec, step):
    return spec is not None and spec == (rank, cycle, step)


here = (socket.gethostname(), int(os.environ.get("LOCAL_RANK", 0)))
with open(os.path.join(args.out, f"hw_rank{rank}.txt"), "a") as f:
    f.write(f"{cycle} {here[0]} {here[1]} {os.environ.get('FT_LAUNCHER_RERUN_OF', '-')} "
            f"{os.environ.get('FT_LAUNCHER_RERUN_MOVED', '-')}\n")
suspect_file = os.path.join(args.out, "suspect.json")
rerunning = os.path.exists(suspect_file)   # Megatron's RERUNNING_FROM_CHECKPOINT, loaded with the checkpoint


def _leave(code):
    """Megatron's sys.exit(code), without the interpreter's teardown: torch 2.13's gloo aborts at
    exit (SIGABRT, "terminate called without an active exception") about 1 run in 4-6 with a live
    DDP group, and the launcher then sees a crash, not the code (tests/scripts/nvrx_train_common.py)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def rerun_exit(step):
    """Megatron's should_checkpoint_and_exit after its state machine's verdict, collective."""
    if args.rerun_exit is None:
        return
    code, culprit, at_cycle, at_step = args.rerun_exit
    if (cycle, step) == (at_cycle, at_step):
        if code == 16 and rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt_path)
        if rank == culprit:
            with open(suspect_file, "w") as f:
                json.dump(here, f)
        dist.barrier()
        _leave(code)
    if code == 16 and step == at_step and rerunning:
        with open(suspect_file) as f:
            same = rank == culprit and tuple(json.load(f)) == here
        flag = torch.tensor([1 if same else 0])
        dist.all_reduce(flag)
        if flag.item():
            _leave(16)   # "got rescheduled on the same GPU": resume again
        if args.rerun_fatal:
            _leave(17)   # the second re-run's diagnosis is done; a fatal validation ends the job


for step in range(start, args.steps):
    # on_training_step_start
    if ft_state.is_setup_section_open:
        client.end_section("setup")
        ft_state.is_setup_section_open = False
    in_step = ft_state.seen_tr_iters_cnt >= NUM_WARMUP_ITERS
    if in_step:
        client.start_section("step")
    rerun_exit(step)
    if fault_here(args.hang, step):
        os.kill(os.getpid(), signal.SIGSTOP)
    if fault_here(args.kill, step):
        os.kill(os.getpid(), signal.SIGKILL)
    if fault_here(args.exclude, step):
        client.send_workload_control_request(
            WorkloadControlRequest(WorkloadAction.ExcludeThisNode, "test: this node's NIC is failing"))
        # held here until its agent stops it: a rank that trained on could write a checkpoint and
        # ft_state.json first (a race), and the spare's run would then depend on who won it
        while True:
            time.sleep(1)
    g = torch.Generator().manual_seed(step * 10 + rank)
    loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    # on_training_step_end
    if in_step:
        client.end_section("step")
    ft_state.seen_tr_iters_cnt += 1
    with open(os.path.join(args.out, f"rank_{rank}.txt"), "a") as f:
        f.write(f"{cycle} {step} {os.getpid()}\n")
    if (step + 1) % args.save_interval == 0:
        client.start_section("checkpointing")   # on_checkpointing_start
        if rank == 0:
            tmp = ckpt_path + ".tmp"
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step + 1}, tmp)
            os.replace(tmp, ckpt_path)
        dist.barrier()
        client.end_section("checkpointing")   # on_checkpointing_end(is_async_finalization=False)
        ft_state.seen_checkpoints_cnt += 1
        maybe_update_timeouts()

# ---- fault_tolerance.shutdown --------------------------------------------------------------------
maybe_update_timeouts(is_closing_ft=True)
report = {"loaded": timeline["loaded"], "updates": timeline["updates"], "final": section_view(client),
          "state": client.state_dict(), "hb": dataclasses.asdict(client.hb_timeouts)}
client.shutdown_workload_monitoring()
with open(os.path.join(args.out, f"report_rank{rank}_cycle{cycle}.json"), "w") as f:
    json.dump(report, f)
dist.destroy_process_group()
