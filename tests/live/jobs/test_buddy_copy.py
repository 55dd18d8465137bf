"""Buddy copies (ft.LiveState(buddy_every=K), rank_monitor/rank_side/live/buddy_copy.py, rank_monitor/buddy_store.py):
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
- the same with buddy_keep=1 (slow): one own and one inbound slot file per rank, a lost node between
  two copies still resumes exact;
- 3 agents x 1 rank + 2 spares (slow): nodes 1 and 2 lost at once (rank 1's copy lived on node 2):
  the checkpoint, with the line that says so.
"""
import os

import pytest

from conftest import ROOT, node_tree, wait_for
from harness import ExampleAgents, own_launcher, progress, started
from ft_launcher.agent.observation.live_recovery import per_rank

EXAMPLE = os.path.join(ROOT, "examples", "hsdp_train.py")
STEPS, FAULT, CKPT = 150, 137, 50


# ---- placement and plan (no process) ---------------------------------------------------------------
def test_buddies_sit_on_the_next_node_and_on_one_node_the_next_local_rank():
    from ft_launcher.rank_monitor.rank_side.live.buddy_copy import place

    assert place([0, 0, 1, 1], [0, 1, 0, 1]) == [2, 3, 0, 1]          # 2 nodes x 2: the other node
    assert place([0, 1, 2], [0, 0, 0]) == [1, 2, 0]                   # 3 nodes x 1: a ring over the nodes
    assert place([1, 1, 0, 0], [1, 0, 1, 0]) == [2, 3, 0, 1]          # order by (node, local rank), not rank
    assert place([0, 0], [0, 1]) == [1, 0]                            # one node: the next local rank
    assert place([0], [0]) == [0]                                     # one rank: no buddy
    for nodes in ([0, 0, 1, 1, 2, 2], [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]):
        dst = place(nodes, [i % 2 if len(nodes) == 6 else i % 3 for i in range(len(nodes))])
        assert sorted(dst) == list(range(len(nodes))) and all(nodes[r] != nodes[d] for r, d in enumerate(dst))


def _plan(steps, copies, shards=(0, 1, 2, 3)):
    """live_plan over live offers (a rank's committed step, -1: none) and buddy-copy offers
    (per rank: (slot, step, shard)); identities are the shards, one layout. -> (resume, sources as
    'kept' / ('peer', N) / ('host', slot) / ('buddy', N, slot), reason)."""
    from ft_launcher.rank_monitor.rank_side.live import buddy_copy
    from ft_launcher.rank_monitor.rank_side.live.live_plan import Need, Offer, plan_recovery

    offers = [Offer(r, s, shards[r], 7) for r, s in enumerate(steps) if s >= 0]
    rows = []
    for held in copies:
        row = [-1, 0, 0, 0] * 4
        for slot, step, shard in held:
            row[slot * 4:slot * 4 + 4] = [step, shard, 7, 100]
        rows.append(row)
    plan = plan_recovery(offers + buddy_copy.offers(rows), [Need(s, 7) for s in shards])
    named = []
    for r, src in enumerate(plan.sources):
        if src is None:
            named.append(None)
        elif plan.kept(r):
            named.append("kept")
        elif buddy_copy.is_copy(src):
            slot = int(src.kind[4:])
            named.append(("host", slot) if src.holder == r else ("buddy", src.holder, slot))
        else:
            named.append(("peer", src.holder))
    return plan.resume, named, plan.reason


def test_plan_takes_the_newest_step_every_shard_has_from_the_cheapest_source():
    # 2 x 2 (buddies: 0 <-> 2, 1 <-> 3); rank 1 killed at the start of step 137: its own slots hold
    # 136 and 135, the others' too; each holds its source's 135
    copies = [[(0, 136, 0), (1, 135, 0), (2, 135, 2)], [(0, 136, 1), (1, 135, 1), (2, 135, 3)],
              [(0, 136, 2), (1, 135, 2), (2, 135, 0)], [(0, 135, 3), (1, 136, 3), (2, 135, 1)]]
    assert _plan([136, -1, 136, 136], copies) == (136, ["kept", ("host", 0), "kept", "kept"], "")
    # node 1 (ranks 2, 3) lost, their replacements hold nothing; the copies of 2 and 3 on node 0 are at
    # 135 (the exchange of 136 was in flight): the survivors go back to 135 from their own slots
    lost = [copies[0], copies[1], [], []]
    assert _plan([136, 136, -1, -1], lost) == (135, [("host", 1), ("host", 1), ("buddy", 0, 2), ("buddy", 1, 2)], "")
    # with the exchange of 136 complete, nobody goes back
    done = [copies[0] + [(3, 136, 2)], copies[1] + [(3, 136, 3)], [], []]
    assert _plan([136, 136, -1, -1], done) == (136, ["kept", "kept", ("buddy", 0, 3), ("buddy", 1, 3)], "")
    # HSDP: a live replica (rank 0) is used before a buddy's copy of the same shard (rank 3's slot 1);
    # a rank's own host copy (rank 3's slot 0) before either
    assert _plan([40, 40, -1, -1], [[], [], [], [(0, 40, 1), (1, 40, 0)]], shards=(0, 1, 0, 1)) == \
        (40, ["kept", "kept", ("peer", 0), ("host", 0)], "")


def test_plan_when_a_node_and_its_buddys_node_are_both_lost_says_so():
    from ft_launcher.rank_monitor.rank_side.live import buddy_copy
    from ft_launcher.rank_monitor.rank_side.live.live_plan import Need, Offer

    # 3 nodes x 1 rank (buddies 0 -> 1 -> 2 -> 0); nodes 1 and 2 lost: rank 1's state lived on both
    resume, sources, _ = _plan([90, -1, -1], [[(0, 90, 0), (1, 89, 0), (2, 90, 2)], [], []], shards=(0, 1, 2))
    assert resume is None and sources == [None] * 3
    offers = [Offer(0, 90, 0, 7), Offer(0, 90, 2, 7, "slot2")]
    assert buddy_copy.unmet_text([Need(0, 7), Need(1, 7), Need(2, 7)], offers, lambda rs: f"rank {rs[0]}") == (
        "no rank holds the shard rank 1 needs in memory at any step, live or as a buddy copy (its rank and the rank "
        "holding its copy were both lost: a node and its buddy's node)")


def test_the_line_names_the_buddy_and_the_step():
    from ft_launcher.agent.observation.live_recovery import line, source_words

    told = {"resume_step": 135, "steps_redone": 1, "sources": {"host copy": "0", "kept": "1", "buddy 0": "2",
                                                               "buddy 1": "3"},
            "bytes": 2_000_000, "transfer_s": 0.01, "mb_per_s": 200.0, "restore_s": 0.05}
    said = line(told)
    assert said.startswith("live recovery: resumed at step 135 (1 completed step(s) redone")
    assert "rank 1 kept, rank 2 from buddy rank 0, rank 3 from buddy rank 1, rank 0 from its host copy" in said
    assert source_words(told["sources"], kept=False) == ("rank 2 from buddy rank 0, rank 3 from buddy rank 1, "
                                                         "rank 0 from its host copy")


# ---- a snapshot in slot files (no process) ---------------------------------------------------------
def build(seed):
    import torch
    import torch.nn as nn

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 300), nn.BatchNorm1d(300), nn.Linear(300, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3 * (seed + 1))
    for _ in range(seed + 2):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    return {"model": model, "optimizer": opt, "note": {"step": torch.tensor(seed), "text": f"seed {seed}"}}


def test_a_snapshot_in_a_slot_file_reads_back_into_fresh_objects_bit_exactly(tmp_path, monkeypatch):
    """write_snapshot: each state as live_wire sends it, into a slot file; read_snapshot from a second
    mapping of the same file (a new process) lands every tensor in the new objects' own tensors."""
    import torch

    from ft_launcher.rank_monitor import buddy_store as S
    from ft_launcher.rank_monitor.rank_side.live import buddy_copy
    from ft_launcher.rank_monitor.rank_side.live import live_wire as W

    monkeypatch.setattr(S.shm_layout, "default_shm_dir", lambda: str(tmp_path))
    prefix = S.prefix_for(1, 0)
    slots = S.SlotSet(prefix)
    old, new = build(0), build(1)
    states = {"model": old["model"].state_dict(), "optimizer": old["optimizer"].state_dict(), "note": old["note"]}
    total = buddy_copy.write_snapshot(slots.slots[0], states, 7, 11, 22, 4, 2, 1)
    header = slots.slots[0].header()
    assert (header["step"], header["identity"], header["layout"], header["world"], header["nbytes"]) == \
        (7, 11, 22, 4, total)
    assert 0 < total <= buddy_copy.estimate(states)
    assert buddy_copy.holdings(slots, 4) == [7, 11, 22, total] + [-1, 0, 0, 0] * 3
    assert buddy_copy.holdings(slots, 2)[:1] == [-1]    # another world size: not a copy for this job
    again = S.SlotSet(prefix)
    fresh = {"model": (W.flat(new["model"].state_dict()),), "optimizer": (W.flat(new["optimizer"].state_dict()),),
             "note": ({},)}
    params = [p.data_ptr() for p in new["model"].parameters()]
    ready, nbytes = buddy_copy.read_snapshot(again.slots[0], fresh, None)
    assert nbytes > 0 and ready["note"]["text"] == "seed 0" and int(ready["note"]["step"]) == 0
    new["model"].load_state_dict(ready["model"])
    new["optimizer"].load_state_dict(ready["optimizer"])
    assert [p.data_ptr() for p in new["model"].parameters()] == params
    for (name, a), (_, b) in zip(old["model"].state_dict().items(), new["model"].state_dict().items()):
        assert torch.equal(a, b), name
    for p_old, p_new in zip(old["model"].parameters(), new["model"].parameters()):
        for key, value in old["optimizer"].state[p_old].items():
            assert torch.equal(value, new["optimizer"].state[p_new][key]), key
    # a slot torn by a death in the middle of a write is no copy
    slots.slots[0].begin()
    assert again.slots[0].header() is None
    slots.close()
    again.close()
    S.remove(prefix)
    assert os.listdir(os.path.dirname(prefix)) == []
    S.remove_agent_dir(1)
    assert os.listdir(tmp_path) == []


def _copy_in(slot, step, cycle=0):
    """A real snapshot of a small model in `slot` (world 2, rank 0)."""
    from ft_launcher.rank_monitor.rank_side.live import buddy_copy

    built = build(0)
    states = {"model": built["model"].state_dict(), "optimizer": built["optimizer"].state_dict()}
    return buddy_copy.write_snapshot(slot, states, step, 11, 22, 2, 0, cycle)


def test_a_planted_or_foreign_or_open_slot_file_is_refused_in_one_line_and_never_offered(tmp_path, monkeypatch,
                                                                                         capsys):
    """The agent's slot directory is its own (mkdtemp: 0700); a slot file that is a symbolic link,
    another user's, or open to group or others is refused with one line, never mapped, so never
    offered to a restore (holdings: none); writing the slot replaces it with a file of this user's
    (0600, O_EXCL). A directory open to others refuses every slot in it."""
    import stat

    from ft_launcher.rank_monitor import buddy_store as S
    from ft_launcher.rank_monitor.rank_side.live import buddy_copy

    monkeypatch.setattr(S.shm_layout, "default_shm_dir", lambda: str(tmp_path))
    prefix = S.prefix_for(os.getpid(), 0)
    where = os.path.dirname(prefix)
    assert os.path.basename(where).startswith(f"ft_launcher_{os.getpid()}_buddy_")
    assert stat.S_IMODE(os.lstat(where).st_mode) == 0o700 and os.lstat(where).st_uid == os.getuid()
    slots = S.SlotSet(prefix)
    for i in range(2):   # complete copies, as a rank writes them
        _copy_in(slots.slots[i], 136 - i)
    slots.close()
    assert buddy_copy.holdings(S.SlotSet(prefix), 2)[0::4] == [136, 135, -1, -1]
    assert stat.S_IMODE(os.stat(prefix + "_own0").st_mode) == 0o600
    capsys.readouterr()

    os.chmod(prefix + "_own0", 0o666)                        # open to every local user
    os.rename(prefix + "_own1", prefix + "_elsewhere")       # a symbolic link planted in its place
    os.symlink(prefix + "_elsewhere", prefix + "_own1")
    foreign = os.getuid() == 0
    if foreign:                                              # another user's file (root can make one)
        os.rename(prefix + "_elsewhere", prefix + "_in0")
        os.chown(prefix + "_in0", 65534, 65534)
    for _ in range(2):   # a restart looks again: still refused, still one line each
        planted = S.SlotSet(prefix)
        assert buddy_copy.holdings(planted, 2) == [-1, 0, 0, 0] * 4
        planted.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"ft_launcher: buddy copy {prefix}_own0 refused: mode 0666 lets other users in (a slot is " \
                       f"0600 in a 0700 directory); it is never loaded", lines
    assert lines[1].startswith(f"ft_launcher: buddy copy {prefix}_own1 refused: Too many levels of symbolic links")
    if foreign:
        assert lines[2] == (f"ft_launcher: buddy copy {prefix}_in0 refused: owned by uid 65534, not by this user "
                            f"(uid 0); it is never loaded"), lines
    assert len(lines) == 2 + foreign, lines

    # the rank's next copy replaces a refused file with its own (the planted file itself is not written)
    again = S.SlotSet(prefix)
    _copy_in(again.slots[1], 137, cycle=1)
    assert not os.path.islink(prefix + "_own1") and stat.S_IMODE(os.lstat(prefix + "_own1").st_mode) == 0o600
    assert buddy_copy.holdings(again, 2)[0::4] == [-1, 137, -1, -1]
    again.close()

    # a directory open to others: every slot in it refused, nothing written there
    os.chmod(where, 0o777)
    open_dir = S.SlotSet(prefix)
    assert buddy_copy.holdings(open_dir, 2) == [-1, 0, 0, 0] * 4
    with pytest.raises(OSError, match="lets other users in"):
        open_dir.slots[0].ensure(10)
    assert capsys.readouterr().err.splitlines() == [
        f"ft_launcher: buddy copy directory {where} refused: mode 0777 lets other users in (a slot is 0600 in a "
        f"0700 directory); no copy in it is loaded or written"]
    os.chmod(where, 0o700)
    S.remove_agent_dir(os.getpid())
    assert os.listdir(tmp_path) == []


def test_a_fallback_abandons_every_copy_held_also_one_an_old_exchange_completes_later(tmp_path, monkeypatch):
    """A fallback to the checkpoint in cycle 1 (SlotSet.abandon): the copies of steps 135-136 are never
    offered again, neither in this process nor in a new one, nor one that an exchange of cycle 0
    completes after the fallback; a copy written in cycle 1 is."""
    from ft_launcher.rank_monitor import buddy_store as S
    from ft_launcher.rank_monitor.rank_side.live import buddy_copy

    monkeypatch.setattr(S.shm_layout, "default_shm_dir", lambda: str(tmp_path))
    prefix = S.prefix_for(os.getpid(), 0)
    old = S.SlotSet(prefix)                 # cycle 0's mapping (an exchange a restart left running holds it)
    sizes = [_copy_in(old.slots[i], step) for i, step in enumerate((136, 135, 136, 135))]
    now = S.SlotSet(prefix)                 # cycle 1's
    assert buddy_copy.holdings(now, 2)[0::4] == [136, 135, 136, 135]
    now.abandon(1)
    assert buddy_copy.holdings(now, 2)[0::4] == [-1, -1, -1, -1]
    old.slots[2].begin()                    # cycle 0's exchange completes late
    old.slots[2].finish(137, 11, 22, 2, 1, 0, sizes[2])
    assert buddy_copy.holdings(now, 2)[0::4] == [-1, -1, -1, -1]
    _copy_in(now.slots[0], 101, cycle=1)    # the checkpoint's timeline: step 101 of cycle 1
    later = S.SlotSet(prefix)               # a new process
    assert buddy_copy.holdings(later, 2)[0::4] == [101, -1, -1, -1]
    for s in (old, now, later):
        s.close()
    S.remove_agent_dir(os.getpid())
    assert os.listdir(tmp_path) == []


# ---- end to end ---------------------------------------------------------------------------------------
class FsdpJob(ExampleAgents):
    """examples/hsdp_train.py --replicas 1 (pure FSDP) on `nodes` agents x `nproc` ranks on this machine,
    plus `spares` agents that wait as hot spares; shared log, checkpoint and progress dirs."""

    def __init__(self, launcher, root, nodes, nproc, job_args=(), ft_args=(), spares=0, max_restarts=1):
        self.ckpt, self.prog = root / "ckpt", root / "progress"
        super().__init__(launcher, root, nodes, nproc, EXAMPLE,
                         ["--replicas", 1, "--fail-how", "kill", "--steps", STEPS, "--ckpt-every", CKPT,
                          "--ckpt-dir", self.ckpt, "--progress-dir", self.prog] + list(job_args),
                         ft_args, spares, max_restarts)


def final_checksum(results):
    lines = [ln.split("FINAL ", 1)[1] for _, out, _ in results for ln in out.splitlines() if "FINAL " in ln]
    return lines[-1] if lines else None


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The fault-free run's final line per layout (nodes, nproc), once per module."""
    cache = {}

    def checksum(nodes, nproc, args=()):
        key = (nodes, nproc, tuple(args))
        if key not in cache:
            root = tmp_path_factory.mktemp(f"clean_{nodes}x{nproc}")
            with own_launcher(root) as helper:
                cache[key] = final_checksum(FsdpJob(helper, root, nodes, nproc, args).launch().wait())
        return cache[key]

    return checksum


def first_steps(job, world, cycle=1):
    return {r: min((s for c, s, _ in progress(str(job.prog), r) if c == cycle), default=None) for r in range(world)}


def told(job):
    evs = [e["detail"] for e in job.events() if e["kind"] == "live_recovery"]
    assert len(evs) == 1, evs
    return evs[0]


@pytest.mark.slow
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
    assert live["resume_step"] == FAULT - 1 and per_rank(live["sources"]) == {"0": "kept", "1": "host copy"}, live
    assert first_steps(job, 2) == {0: FAULT, 1: FAULT}
    assert "rank 1 from its host copy" in [ln for ln in results[0][1].splitlines() + err.splitlines()
                                           if "live recovery: resumed at step 136" in ln][0]


@pytest.mark.slow
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
    assert live["resume_step"] == FAULT - 1 and per_rank(live["sources"]) == {"0": "kept", "1": "kept", "2": "host copy",
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
    assert {k: v for k, v in per_rank(live["sources"]).items() if k in ("2", "3")} == {"2": "buddy 0", "3": "buddy 1"}, live
    assert set(per_rank(live["sources"])[k] for k in ("0", "1")) <= {"kept", "host copy"}, live
    assert live["bytes"] > 0 and live["steps_redone"] <= 2, live
    after = started(job.events(), 1)
    assert all(after[r][1] for r in (0, 1)) and not any(after[r][1] for r in (2, 3)), after


@pytest.mark.slow
def test_buddy_keep_1_holds_half_the_slots_and_a_lost_node_still_resumes_exact(launcher, tmp_path, clean):
    """buddy_keep=1, a copy every 10 steps, 2 x 2 + a spare node: each rank's slot directory holds one
    own snapshot and one copy of its source (no own1/in1 file: 2 x its state, not 4), said in the
    start line; node 1 lost between two copies (outside the copy window): ranks 2 and 3 receive the
    copy of the last multiple of 10 from their buddies, the survivors go back to it from their own
    slots, exact."""
    job = FsdpJob(launcher, tmp_path, 2, 2, ["--buddy-every", 10, "--buddy-keep", 1, "--step-time", 0.05],
                  spares=1).launch()
    job.add_spares()
    wait_for(lambda: any(c == 0 and s >= 40 for c, s, _ in progress(str(job.prog), 3)), 120, "rank 3 at step 40")
    slots = sorted(name.split("_", 1)[1] for agent in job.agents[:2] for d in os.listdir("/dev/shm")
                   if d.startswith(f"ft_launcher_{agent.pid}_buddy_")
                   for name in os.listdir(os.path.join("/dev/shm", d)) if "_own" in name or "_in" in name)
    assert slots == ["in0"] * 4 + ["own0"] * 4, slots

    def between_copies():
        now = max((s for c, s, _ in progress(str(job.prog), 0) if c == 0), default=0)
        return now >= 60 and 3 <= now % 10 <= 7
    wait_for(between_copies, 120, "rank 0 between two copies")
    for proc in node_tree(job.agents[1].pid):
        proc.kill()
    results = job.wait(lost=(1,))
    err = results[0][2]
    assert "host memory per rank: its own copy + 1 of its buddy's (buddy_keep=1)" in err, err[-3000:]
    assert final_checksum(results) == clean(2, 2)
    live = told(job)
    assert live["resume_step"] is not None and live["resume_step"] % 10 == 0, live
    assert per_rank(live["sources"]) == {"0": "host copy", "1": "host copy", "2": "buddy 0", "3": "buddy 1"}, live


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
    assert live["resume_step"] is None and "no rank holds the shard rank 1 needs in memory" in live["reason"], live
    out = "".join(r[1] + r[2] for r in results)
    lines = [ln for ln in out.splitlines() if "no live state to resume from" in ln]
    assert len(lines) == 1 and "a node and its buddy's node" in lines[0], out[-3000:]
    assert "resumed from the checkpoint at step" in out, out[-3000:]


@pytest.mark.slow
def test_a_fallback_then_a_second_failure_never_resumes_forward_onto_the_abandoned_timeline(launcher, tmp_path,
                                                                                            clean):
    """1 x 2 (a DCP AppState), a buddy copy every step: rank 1 killed at the start of step 137; the heal
    fails (rank 1's load raises) and the job falls back to the checkpoint of step 100, its slots still
    holding copies of steps 135-136. Rank 1 killed again at the start of step 102 (cycle 1, within 2 x buddy_every of
    the fallback): the job resumes at step 101 of the checkpoint's timeline (rank 0 kept, rank 1 its
    host copy of 101), never forward at 136 (the abandoned copies), and ends exact."""
    app = ["--state", "app"]
    job = FsdpJob(launcher, tmp_path, 1, 2, app + ["--buddy-every", 1, "--fail-at-step", FAULT, "--fail-rank", 1,
                                                   "--fail-load-rank", 1, "--fail-again-at-step", 102],
                  max_restarts=2).launch()
    results = job.wait()
    out, err = results[0][1], results[0][2]
    assert final_checksum(results) == clean(1, 2, app), err[-3000:]
    evs = [e["detail"] for e in job.events() if e["kind"] == "live_recovery"]
    assert len(evs) == 2, evs
    assert evs[0]["resume_step"] is None and "on rank 1, load_state_dict() of 'app' raised" in evs[0]["reason"], evs[0]
    assert "resumed from the checkpoint at step 100 (cycle 1)" in out, out[-3000:]
    assert evs[1]["resume_step"] == 101 and per_rank(evs[1]["sources"]) == {"0": "kept", "1": "host copy"}, evs[1]
    assert "resumed from live state at step 101 (cycle 2)" in out, out[-3000:]
    assert first_steps(job, 2, cycle=2) == {0: 102, 1: 102}
