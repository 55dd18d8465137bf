"""Buddy copies (ft.LiveState(buddy_every=K), rank_monitor/rank_side/buddy_copy.py, rank_monitor/buddy_store.py):
each rank's committed state also lives in host memory, its own node's and a buddy's on another node,
so pure FSDP jobs and lost nodes resume from memory instead of the checkpoint.

Without processes: the placement (buddies on another node), the restore plan (the newest step every
shard has; host copy, live replica, buddy copy; the line when a node and its buddy's node are both
lost), a snapshot written into slot files and loaded into fresh objects bit-exactly, and a
description that would run code refused.

End to end (examples/hsdp_train.py --replicas 1: torch's fully_shard over every rank on gloo, no
replica, AdamW; a buddy copy every step; checkpoint every 50 steps; checksums against a fault-free
run):
- 1 agent x 2 ranks, rank 1 SIGKILLed at the start of step 137: it restores its shard from its copy
  in this node's shared memory (its buddy, rank 0, is on the same node here: one node), the job
  resumes at step 136, exact;
- the same with a memory limit below what the copies need: one line at the start, no copies, and the
  kill falls back to the checkpoint with its line (exact too, from step 100);
- 2 agents x 2 ranks (slow): rank 2 killed at 137 resumes at 136 from its host copy, exact; node 1
  (its agent and both ranks) SIGKILLed while training, a spare node takes its place, ranks 2 and 3
  receive their shards from their buddies on node 0, exact;
- 3 agents x 1 rank + 2 spares (slow): nodes 1 and 2 lost at once (rank 1's copy lived on node 2):
  the checkpoint, with the line that says so.
"""
import os
import time

import pytest

from conftest import ROOT, node_tree, read_events, wait_for
from test_fault_matrix import _listening, progress
from test_inprocess_restart import started

EXAMPLE = os.path.join(ROOT, "examples", "hsdp_train.py")
STEPS, FAULT, CKPT = 150, 137, 50


# ---- placement and plan (no process) ---------------------------------------------------------------
def test_buddies_sit_on_the_next_node_and_on_one_node_the_next_local_rank():
    from ft_launcher.rank_monitor.rank_side.buddy_copy import place

    assert place([0, 0, 1, 1], [0, 1, 0, 1]) == [2, 3, 0, 1]          # 2 nodes x 2: the other node
    assert place([0, 1, 2], [0, 0, 0]) == [1, 2, 0]                   # 3 nodes x 1: a ring over the nodes
    assert place([1, 1, 0, 0], [1, 0, 1, 0]) == [3, 2, 1, 0]          # order by (node, local rank), not rank
    assert place([0, 0], [0, 1]) == [1, 0]                            # one node: the next local rank
    assert place([0], [0]) == [0]                                     # one rank: no buddy
    for nodes in ([0, 0, 1, 1, 2, 2], [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]):
        dst = place(nodes, [i % 2 if len(nodes) == 6 else i % 3 for i in range(len(nodes))])
        assert sorted(dst) == list(range(len(nodes))) and all(nodes[r] != nodes[d] for r, d in enumerate(dst))


def test_plan_takes_the_newest_step_every_shard_has_from_the_cheapest_source():
    from ft_launcher.rank_monitor.rank_side.buddy_copy import plan

    shards = [0, 1, 2, 3]
    # rank 1 killed at the start of step 137: its own slots hold 136 and 135; its buddy (3) holds 135
    copies = [[(0, 136, 0), (1, 135, 0), (2, 135, 2)], [(0, 136, 1), (1, 135, 1), (2, 135, 3)],
              [(0, 136, 2), (1, 135, 2), (2, 135, 0)], [(0, 135, 3), (1, 136, 3), (2, 135, 1)]]
    assert plan([136, -1, 136, 136], shards, copies) == (136, [0, ("copy", 1, 0), 2, 3], "")
    # node 1 (ranks 2, 3) lost, their replacements hold nothing; the copies of 2 and 3 on node 0 are at 135
    # (the exchange of 136 was in flight): the survivors roll back to 135 from their own slots
    lost = [copies[0], copies[1], [], []]
    assert plan([136, 136, -1, -1], shards, lost) == (135, [("copy", 0, 1), ("copy", 1, 1), ("copy", 0, 2),
                                                           ("copy", 1, 2)], "")
    # with the exchange of 136 complete, nobody rolls back
    done = [copies[0] + [(3, 136, 2)], copies[1] + [(3, 136, 3)], [], []]
    assert plan([136, 136, -1, -1], shards, done) == (136, [0, 1, ("copy", 0, 3), ("copy", 1, 3)], "")
    # a live replica (HSDP) is used before a buddy's copy; a host copy before either
    resume, sources, _ = plan([40, 40, -1, -1], [0, 1, 0, 1], [[], [], [], [(0, 40, 1)]])
    assert resume == 40 and sources == [0, 1, 0, ("copy", 3, 0)]


def test_plan_when_a_node_and_its_buddys_node_are_both_lost_says_so():
    from ft_launcher.rank_monitor.rank_side.buddy_copy import plan

    # 3 nodes x 1 rank (buddies 0->1->2->0); nodes 0 and 1 lost: rank 0's state lived on both
    resume, sources, reason = plan([-1, -1, 90], [0, 1, 2], [[], [], [(0, 90, 2), (1, 89, 2), (2, 90, 1)]])
    assert resume is None and sources == [None] * 3
    assert reason == ("no rank holds shard 0 in memory, live or as a buddy copy (its rank and the rank holding its "
                      "copy were both lost: a node and its buddy's node)")
    assert plan([-1, -1], [0, 1], [[], []])[2].startswith("no rank holds live state or a buddy copy")
    assert plan([90, -1], [0, 1], [[], [(0, 80, 1)]])[2] == \
        "no step is held by every shard (shard 0 at 90-90, shard 1 at 80-80)"


# ---- a snapshot in slot files (no process) ---------------------------------------------------------
class Holder:
    def __init__(self, **objects):
        self.objects = objects


def build(seed):
    import torch
    import torch.nn as nn

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 300), nn.BatchNorm1d(300), nn.Linear(300, 3))
    model[0].weight.data = model[0].weight.data.t().contiguous().t()   # a non-contiguous parameter
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3 * (seed + 1))
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    for _ in range(seed + 2):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        sched.step()
    return {"model": model, "optimizer": opt, "scheduler": sched}


def test_a_snapshot_in_a_slot_file_loads_into_fresh_objects_bit_exactly(tmp_path, monkeypatch):
    import torch

    from ft_launcher.rank_monitor import buddy_store as S
    from ft_launcher.rank_monitor.rank_side import buddy_copy

    monkeypatch.setattr(S.shm_layout, "default_shm_dir", lambda: str(tmp_path))
    prefix = S.prefix_for(1, 0)
    slots = S.SlotSet(prefix)
    old, new = build(0), build(1)
    total = buddy_copy.write_snapshot(slots.slots[0], old, 7, 3, 4, 2, 1)
    header = slots.slots[0].header()
    assert header["step"] == 7 and header["shard"] == 3 and header["world"] == 4 and header["nbytes"] == total
    assert buddy_copy.holdings(slots, 4, old) == [7, 3, total, header["meta"]] + [-1, -1, 0, 0] * 3
    assert buddy_copy.holdings(slots, 2, old)[:2] == [-1, -1]    # another world size: not a copy for this job
    # a second mapping of the same files (a new process), loading into other objects' own tensors
    again = S.SlotSet(prefix)
    params = list(new["model"].parameters())
    loaded = buddy_copy.load_snapshot(again.slots[0].payload(total), header["meta"], new, torch.device("cpu"))
    assert loaded == total
    assert all(p is q for p, q in zip(params, new["model"].parameters()))
    for (name, a), (_, b) in zip(old["model"].state_dict().items(), new["model"].state_dict().items()):
        assert torch.equal(a, b), name
    for p_old, p_new in zip(old["model"].parameters(), new["model"].parameters()):
        for key, value in old["optimizer"].state[p_old].items():
            assert torch.equal(value, new["optimizer"].state[p_new][key]), key
    assert new["scheduler"].state_dict() == old["scheduler"].state_dict()
    assert new["optimizer"].param_groups[0]["lr"] == old["optimizer"].param_groups[0]["lr"]
    # a slot torn by a death in the middle of a write is no copy
    slots.slots[0].begin()
    assert again.slots[0].header() is None
    slots.close()
    again.close()
    S.remove(prefix)
    assert os.listdir(tmp_path) == []


def test_a_description_that_would_run_code_is_refused():
    import pickle

    from ft_launcher.rank_monitor.rank_side import buddy_copy

    assert buddy_copy._loads(pickle.dumps({"a": [1, 2.0, "x", None, (3,)]})) == {"a": [1, 2.0, "x", None, (3,)]}
    with pytest.raises(pickle.UnpicklingError, match="a posix.system in the state"):
        buddy_copy._loads(pickle.dumps(os.system))


# ---- end to end ---------------------------------------------------------------------------------------
class FsdpJob:
    """examples/hsdp_train.py --replicas 1 (pure FSDP) on `nodes` agents x `nproc` ranks on this machine,
    plus `spares` agents that wait as hot spares; shared log, checkpoint and progress dirs."""

    def __init__(self, launcher, root, nodes, nproc, job_args=(), ft_args=(), spares=0, max_restarts=1):
        self.launcher, self.root = launcher, root
        self.nodes, self.nproc, self.spares = nodes, nproc, spares
        self.logs, self.ckpt, self.prog = root / "logs", root / "ckpt", root / "progress"
        self.port = __import__("conftest").free_port()
        base = ["--nproc-per-node", nproc, "--max-restarts", max_restarts, "--log-dir", self.logs,
                "--ft-warm-reserves", 0]
        if nodes == 1 and not spares:
            base = ["--standalone"] + base
        else:
            base += ["--nnodes", f"{nodes}:{nodes + spares}" if spares else nodes, "--rdzv-backend", "c10d",
                     "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", f"bdy{self.port}",
                     "--rdzv-conf", "join_timeout=30,last_call_timeout=1"]
        self.args = base + list(ft_args) + [EXAMPLE, "--replicas", 1, "--steps", STEPS, "--ckpt-every", CKPT,
                                            "--ckpt-dir", self.ckpt, "--progress-dir", self.prog] + list(job_args)
        self.agents = []

    def launch(self):
        for node in range(self.nodes):
            if node == 1:
                wait_for(lambda: _listening(self.port), 30, "the store host to listen")
            self.agents.append(self.launcher.start(self.args, extra_env={"GROUP_RANK": str(node)}))
        return self

    def add_spares(self):
        wait_for(lambda: read_events(str(self.logs), "ranks_started"), 60, "cycle 0's ranks")
        for i in range(self.spares):
            self.agents.append(self.launcher.start(self.args, extra_env={"GROUP_RANK": str(self.nodes + i)}))
        wait_for(lambda: len(read_events(str(self.logs), "spare_waiting")) >= self.spares, 60, "the spares to wait")

    def wait(self, bound=240, lost=()):
        results = []
        deadline = time.monotonic() + bound
        for i, proc in enumerate(self.agents):
            try:
                out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except Exception:
                for p in self.agents:
                    p.kill()
                outs = [p.communicate() for p in self.agents]
                pytest.fail(f"job did not end within {bound}s\n" + "\n".join(o[1][-3000:] for o in outs))
            results.append((proc.returncode, out, err))
        for i, (code, _, err) in enumerate(results):
            if i not in lost:
                assert code == 0, f"agent {i} exited {code}\n{err[-3000:]}"
        return results

    def events(self):
        return read_events(str(self.logs))


def final_checksum(results):
    lines = [ln.split("FINAL ", 1)[1] for _, out, _ in results for ln in out.splitlines() if "FINAL " in ln]
    return lines[-1] if lines else None


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The fault-free run's final line per layout (nodes, nproc), once per module."""
    import uuid

    from conftest import Launcher, wait_until_gone

    cache = {}

    def checksum(nodes, nproc):
        if (nodes, nproc) not in cache:
            token = uuid.uuid4().hex
            root = tmp_path_factory.mktemp(f"clean_{nodes}x{nproc}")
            helper = Launcher(token, root)
            try:
                job = FsdpJob(helper, root, nodes, nproc).launch()
                cache[(nodes, nproc)] = final_checksum(job.wait())
            finally:
                helper.cleanup()
                left = wait_until_gone(token, timeout=5)
                for proc in left:
                    proc.kill()
        return cache[(nodes, nproc)]

    return checksum


def first_steps(job, world, cycle=1):
    return {r: min((s for c, s, _ in progress(str(job.prog), r) if c == cycle), default=None) for r in range(world)}


def told(job):
    evs = [e["detail"] for e in job.events() if e["kind"] == "live_recovery"]
    assert len(evs) == 1, evs
    return evs[0]


def test_one_node_pure_fsdp_a_killed_rank_restores_its_shard_from_host_memory(launcher, tmp_path, clean):
    """1 x 2, no replica: rank 1 killed at the start of step 137. Its buddy (rank 0) is on the same
    node here (one node: a copy survives its rank, not the node); its own copy of step 136 is in this
    node's shared memory too, and it loads that one (no transfer). Resumes at 136, exact."""
    job = FsdpJob(launcher, tmp_path, 1, 2, ["--buddy-every", 1, "--fail-at-step", FAULT, "--fail-rank", 1]).launch()
    results = job.wait()
    err = results[0][2]
    assert "buddy copies every 1 step(s)" in err and "the buddy is on the same node" in err, err[-3000:]
    assert final_checksum(results) == clean(1, 2)
    live = told(job)
    assert live["resume_step"] == FAULT - 1 and live["sources"] == {"0": "kept", "1": "host copy"}, live
    assert first_steps(job, 2) == {0: FAULT, 1: FAULT}
    assert "rank 1 from its host copy" in [ln for ln in results[0][1].splitlines() + err.splitlines()
                                           if "live recovery: resumed at step 136" in ln][0]


def test_a_host_that_cannot_hold_the_copies_refuses_them_in_one_line(launcher, tmp_path, clean):
    """A 1 MB limit (the copies need more): one line at the start, no copies; the kill at 137 then
    falls back to the checkpoint of step 100, with its line, and ends exact."""
    job = FsdpJob(launcher, tmp_path, 1, 2, ["--buddy-every", 1, "--buddy-memory-limit-mb", 1,
                                             "--fail-at-step", FAULT, "--fail-rank", 1]).launch()
    results = job.wait()
    err = results[0][2]
    refused = [ln for ln in err.splitlines() if "buddy copies off" in ln]
    assert len(refused) == 2 and "more than the 1.0 MB it may use (buddy_memory_limit_mb)" in refused[0], err[-3000:]
    assert "no live state to resume from" in err and "resumed from the checkpoint at step 100" in results[0][1]
    assert final_checksum(results) == clean(1, 2)
    assert [f for f in os.listdir("/dev/shm") if "_buddy_" in f and f"_{job.agents[0].pid}_" in f] == []


@pytest.mark.slow
def test_two_nodes_a_killed_rank_resumes_at_the_step_before(launcher, tmp_path, clean):
    job = FsdpJob(launcher, tmp_path, 2, 2, ["--buddy-every", 1, "--fail-at-step", FAULT, "--fail-rank", 2]).launch()
    results = job.wait()
    assert final_checksum(results) == clean(2, 2)
    live = told(job)
    assert live["resume_step"] == FAULT - 1 and live["sources"] == {"0": "kept", "1": "kept", "2": "host copy",
                                                                      "3": "kept"}, live
    assert first_steps(job, 4) == {r: FAULT for r in range(4)}


@pytest.mark.slow
def test_a_lost_node_resumes_from_the_buddies_on_the_other_node(launcher, tmp_path, clean):
    """2 x 2 + a spare node: node 1 (its agent and ranks 2, 3) SIGKILLed while training; the spare
    takes its place; ranks 2 and 3 receive their shards from their buddies (ranks 0 and 1, node 0);
    the job resumes at the newest step every copy has and ends exact."""
    job = FsdpJob(launcher, tmp_path, 2, 2, ["--buddy-every", 1, "--step-time", 0.02], spares=1).launch()
    job.add_spares()
    wait_for(lambda: any(c == 0 and s >= 60 for c, s, _ in progress(str(job.prog), 3)), 120, "rank 3 at step 60")
    for proc in node_tree(job.agents[1].pid):
        proc.kill()
    kill_step = max(s for c, s, _ in progress(str(job.prog), 0) if c == 0)
    results = job.wait(lost=(1,))
    assert final_checksum(results) == clean(2, 2)
    live = told(job)
    resume = live["resume_step"]
    assert resume is not None and kill_step - 3 <= resume, (live, kill_step)
    assert {k: v for k, v in live["sources"].items() if k in ("2", "3")} == {"2": "buddy 0", "3": "buddy 1"}, live
    assert set(live["sources"][k] for k in ("0", "1")) <= {"kept", "host copy"}, live
    assert live["bytes"] > 0 and live["steps_redone"] <= 2, live
    after = started(job.events(), 1)
    assert all(after[r][1] for r in (0, 1)) and not any(after[r][1] for r in (2, 3)), after


@pytest.mark.slow
def test_a_node_and_its_buddys_node_both_lost_fall_back_to_the_checkpoint_with_one_line(launcher, tmp_path, clean):
    """3 x 1 + 2 spares (buddies 0 -> 1 -> 2 -> 0): nodes 1 and 2 lost together (rank 1's copy lived
    on node 2; node 0, the store host, survives): no shard 1 anywhere; the job falls back to its
    checkpoint, saying so in one line, and ends exact."""
    job = FsdpJob(launcher, tmp_path, 3, 1, ["--buddy-every", 1, "--step-time", 0.02], spares=2).launch()
    job.add_spares()
    wait_for(lambda: any(c == 0 and s >= 60 for c, s, _ in progress(str(job.prog), 2)), 120, "rank 2 at step 60")
    for victim in (job.agents[1], job.agents[2]):
        for proc in node_tree(victim.pid):
            proc.kill()
    results = job.wait(lost=(1, 2))
    assert final_checksum(results) == clean(3, 1)
    live = told(job)
    assert live["resume_step"] is None and "no rank holds shard 1 in memory" in live["reason"], live
    out = "".join(r[1] + r[2] for r in results)
    lines = [ln for ln in out.splitlines() if "no live state to resume from" in ln]
    assert len(lines) == 1 and "a node and its buddy's node" in lines[0], out[-3000:]
    assert "resumed from the checkpoint at step" in out, out[-3000:]
