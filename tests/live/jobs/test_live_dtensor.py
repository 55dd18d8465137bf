"""Live recovery on the state real FSDP jobs hand LiveState (issue 39): a `Stateful` whose state
holds DTensors (PyTorch's DCP recipe: an AppState over get_state_dict / set_state_dict, with or
without flattened optimizer keys; torchtitan-like containers), and never worse than without it.

Without a launcher (one process, a gloo world of 1): an AppState's committed state crosses the wire
(live_wire) into a fresh AppState's objects: every DTensor arrives as a DTensor on the receiver's
own mesh with the sender's placements, also the state of a fresh optimizer; it loads with
set_state_dict and the model is equal. A DTensor on a mesh the receiver lacks, a tensor that does
not fit, a sender that cannot split its state: the receiver reads every message first, then raises.

End to end (examples/hsdp_train.py, torch's fully_shard on gloo, AdamW; checksums against a
fault-free run of the same flags):
- HSDP 1 x 4 (2 replicas x 2 shards), `--state app`: rank 3 killed at step 17 heals from rank 1,
  exact; the same with rank 3's load_state_dict raising in the heal: one line naming rank 3, 'app'
  and the error, every rank on its checkpoint (step 10), the job ends exact with 1 restart.
- `--state app-flat` (flattened optimizer keys) and `--state parts` (torchtitan-like containers):
  the kill heals exactly (slow: the default kill runs the same wire, the unit test flattens).
- Pure FSDP, 2 agents x 1 rank, `--buddy-every 1 --state app`: rank 1 killed at 17 resumes at 16
  from its copy, exact (slow: test_buddy_copy's default case runs the copy path, this file's unit
  test the DTensors' placing).
- HSDP 2 agents x 2 ranks + a spare agent (`--nnodes 2:3`), `--state app`: the node of ranks 2, 3
  (one whole replica) killed; the spare takes its place and heals from the other replica, exact
  (slow).
- HSDP 2 agents x 2 ranks, `--elastic --nnodes 1:2`, `model=`/`optimizer=` and `--state app`: the
  node of ranks 2, 3 killed, the job goes on with ranks 0, 1, the node comes back and its ranks
  heal from ranks 0, 1, exact (slow).
"""
import os
import subprocess
import sys

import pytest

from conftest import ROOT, node_tree, read_events, wait_for
from harness import ExampleAgents, progress
from ft_launcher.agent.observation.live_recovery import per_rank

EXAMPLE = os.path.join(ROOT, "examples", "hsdp_train.py")

# ---- the wire, in one process ---------------------------------------------------------------------
_WIRE = r"""
import os, sys, tempfile
import torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.checkpoint.state_dict import StateDictOptions
sys.path.insert(0, os.path.join(sys.argv[1], "examples"))
from hsdp_train import AppState
from ft_launcher.rank_monitor.rank_side.live import live_objects as O, live_wire as W

dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tempfile.mkdtemp(), "s"), 1), rank=0, world_size=1)
flat = StateDictOptions(flatten_optimizer_state_dict=True) if sys.argv[2] == "flat" else None

def build(seed, steps):
    torch.manual_seed(seed)
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    for m in (model[0], model[2], model):
        fully_shard(m, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
    return mesh, model, opt

_, model, opt = build(0, 3)
sender = O.Tracked("app", AppState(model, opt, flat))
sender.snapshot()   # a commit
wire = []
W.send_state(sender.committed(), torch.device("cpu"), wire.append)
mesh, model2, opt2 = build(1, 0)   # a new process's objects: another mesh object, a fresh optimizer
assert not opt2.state
receiver = O.Tracked("app", AppState(model2, opt2, flat))
dests, layout, ident = receiver.fresh()
msgs = iter(wire)
state, nbytes = W.recv_state(dests, torch.device("cpu"), lambda t: t.copy_(next(msgs)), receiver.place)
assert next(msgs, None) is None
sent = W.flat(sender.committed())
got = W.flat(state)
assert sent.keys() == got.keys()
dtensors = 0
for path, t in sent.items():
    r = got[path]
    if W.is_dtensor(t):
        dtensors += 1
        assert W.is_dtensor(r), (path, type(r))
        # the receiver's own DTensor's mesh at that path (in one process torch's caches may hand out an
        # equal mesh made before: rank_side.dtensor_cycle clears them at a restart point)
        assert r.device_mesh is receiver.placed[path][0] and r.device_mesh == mesh, path
        assert r.placements == t.placements and r.shape == t.shape and r.stride() == t.stride(), path
        assert torch.equal(r.to_local(), t.to_local()), path
    else:
        assert not W.is_dtensor(r) and torch.equal(r, t), path
receiver.obj.load_state_dict(state)
for (k, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
    assert torch.equal(a.to_local(), b.to_local()), k
x = torch.randn(4, 16)
for m, o in ((model, opt), (model2, opt2)):
    o.zero_grad(); m(x).sum().backward(); o.step()
assert all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), model2.parameters()))
print("dtensors:", dtensors, "keys:", sorted({str(p[:2]) for p in sent})[:4])

# a mesh this call lacks: every message read, then Unbound
other = O.Tracked("app", AppState(model2, opt2, flat))
other.fresh()
other.placed, other.meshes = {}, [init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))]
msgs = iter(wire)
try:
    W.recv_state({}, torch.device("cpu"), lambda t: t.copy_(next(msgs)), other.place)
    raise SystemExit("placed on a mesh it does not have")
except O.Unbound as exc:
    assert next(msgs, None) is None
    print("unbound:", exc)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("keys", ["nested", pytest.param("flat", marks=pytest.mark.slow)])   # flat: torchtitan's keys, slow
def test_an_appstate_crosses_the_wire_as_dtensors_on_the_receivers_mesh(keys):
    """examples/hsdp_train.py's AppState (DCP recipe) over fully_shard on a 1 x 1 mesh: a kept
    state (3 AdamW steps) sent, received by a fresh AppState (another mesh object, an optimizer
    without state): every DTensor (parameters, exp_avg, exp_avg_sq) comes back a DTensor on the
    receiver's mesh with the sender's placements and bytes; set_state_dict loads it, and a step
    after it is equal on both. Flattened optimizer keys alike. With no such mesh: Unbound, after
    every message was read."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", _WIRE, ROOT, keys], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env=env)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    print(res.stdout)
    assert "dtensors: 12" in res.stdout, res.stdout   # 4 parameters, their exp_avg and exp_avg_sq
    assert "this call's objects have no such device mesh" in res.stdout, res.stdout


def test_a_receiver_that_cannot_take_a_state_reads_all_of_it_first():
    """A tensor that does not fit, a skeleton naming a class a state may not hold, a sender that
    cannot split its state: the receiver raises only after the last message of that state, so the
    next state on the same wire arrives whole (the sender never waits on it)."""
    import pickle

    import torch

    from ft_launcher.rank_monitor.rank_side.live import live_wire as W

    wire = []
    big = torch.arange(400_000, dtype=torch.float32)   # sent by itself, beside a chunk
    W.send_state({"w": torch.ones(3), "big": big}, torch.device("cpu"), wire.append)
    W.send_state({"next": torch.full((2,), 7.0)}, torch.device("cpu"), wire.append)
    msgs = iter(wire)

    def recv(t):
        t.view(-1).view(torch.uint8).copy_(next(msgs).reshape(-1).view(torch.uint8))

    with pytest.raises(W.LayoutMismatch, match=r"\['w'\]: torch.float32 \[3\] does not fit"):
        W.recv_state({("w",): torch.zeros(4)}, torch.device("cpu"), recv)
    state, _ = W.recv_state({}, torch.device("cpu"), recv)
    assert state["next"].tolist() == [7.0, 7.0] and next(msgs, None) is None

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    blob = pickle.dumps(({"x": Evil()}, [("x",)]))
    wire = [torch.tensor([len(blob), 1]), torch.frombuffer(bytearray(blob + (12).to_bytes(8, "little")),
                                                           dtype=torch.uint8), torch.zeros(12, dtype=torch.uint8)]
    W.send_state({"next": torch.ones(1)}, torch.device("cpu"), wire.append)
    msgs = iter(wire)
    with pytest.raises(pickle.UnpicklingError, match="names posix.system|names os.system"):
        W.recv_state({}, torch.device("cpu"), recv)
    assert W.recv_state({}, torch.device("cpu"), recv)[0]["next"].tolist() == [1.0]

    wire = []
    with pytest.raises(W.Refused):
        W.send_state({"f": lambda: 0}, torch.device("cpu"), wire.append)
    msgs = iter(wire)
    with pytest.raises(W.LayoutMismatch, match="the sender could not send its state"):
        W.recv_state({}, torch.device("cpu"), recv)
    assert next(msgs, None) is None


# ---- zero-copy commits of a Stateful, in one process ---------------------------------------------------
_ZERO = r"""
import os, sys, tempfile
import torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.checkpoint.state_dict import StateDictOptions
sys.path.insert(0, os.path.join(sys.argv[1], "examples"))
from hsdp_train import AppState, ModelWrapper, OptimizersContainer
import ft_launcher as ft
from ft_launcher.rank_monitor.rank_side.live import live_objects as O, live_wire as W

dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tempfile.mkdtemp(), "s"), 1), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
form, fsdp = sys.argv[2], sys.argv[3] == "fsdp"

def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.Tanh(), nn.Linear(64, 1))
    if fsdp:
        for m in (model[0], model[3], model):
            fully_shard(m, mesh=mesh)
    if form == "parts":   # torchtitan's containers: ModelWrapper, OptimizersContainer (flattened keys)
        opt = OptimizersContainer([model], torch.optim.AdamW, {"lr": 1e-2})
        return model, opt, {"model": ModelWrapper(model), "optimizer": opt}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    flat = StateDictOptions(flatten_optimizer_state_dict=True) if form == "app-flat" else None
    return model, opt, {"app": AppState(model, opt, flat)}

def step(model, opt, s):
    g = torch.Generator().manual_seed(s)
    x = torch.randn(8, 16, generator=g)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
    opt.step()

def local(t):
    return t.to_local() if W.is_dtensor(t) else t

def nbytes(ts):
    return sum(local(t).numel() * local(t).element_size() for t in ts)

def inner(opt):
    return getattr(opt, "optimizers", [opt])

def live_bytes(model, opt):
    return nbytes(list(model.parameters())) + nbytes(
        [v for o in inner(opt) for st in o.state.values() for v in st.values() if torch.is_tensor(v)])

def check_in_place(tracked, model, opt):
    live = {local(t).untyped_storage().data_ptr() for t in list(model.parameters()) + [
        v for o in inner(opt) for st in o.state.values() for v in st.values() if torch.is_tensor(v)]}
    held = [local(t).untyped_storage().data_ptr() for t in W.flat(tracked.committed()).values()]
    return sum(p in live for p in held)

buffers = nbytes(list(model_buffers for model_buffers in build()[0].buffers()))   # running mean, var, count

# the reference: 4 steps without a restart
ref_model, ref_opt, _ = build()
for s in range(1, 5):
    step(ref_model, ref_opt, s)

# 2 steps, each committed; the state dict's parameters and AdamW state are read in place, the buffers copied
model, opt, states = build()
tracked = {n: O.Tracked(n, o) for n, o in states.items()}
for s in (1, 2):
    step(model, opt, s)
    for t in tracked.values():
        t.snapshot()
copied = sum(t.copied for t in tracked.values())
in_place = sum(t.in_place for t in tracked.values())
assert copied == buffers, (copied, buffers)
assert in_place == live_bytes(model, opt) > 0, (in_place, live_bytes(model, opt))
assert sum(check_in_place(t, model, opt) for t in tracked.values()) == 6 + 18, "params and AdamW state held in place"
assert not any(t.note for t in tracked.values()), [t.note for t in tracked.values()]
committed = {n: t.committed() for n, t in tracked.items()}
digest = {n: W.digest(c)[0] for n, c in committed.items()}

# outside commit: step 3's forward moves BatchNorm's statistics, then the step fails before its commit
g = torch.Generator().manual_seed(3)
model(torch.randn(8, 16, generator=g) * 5)
assert {n: W.digest(t.committed())[0] for n, t in tracked.items()} == digest, "the committed state moved"

# an in-place restart: the next call's objects, a kept rank's move and load (LiveState._load's path)
model2, opt2, states2 = build()
live = ft.LiveState(**states2, rng=False)
fresh = {n: live.tracked[n].fresh() for n in sorted(states2)}
ready = {n: W.move_state(committed[n], fresh[n][0]) for n in sorted(states2)}
assert live._load(ready, fresh) == ""
del model, opt, states, tracked, committed, ready
assert {n: W.digest(t.committed())[0] for n, t in live.tracked.items()} == digest, "not the committed state"
assert sum(check_in_place(t, model2, opt2) for t in live.tracked.values()) == 24, "after the load: in place again"
for s in (3, 4):   # the steps again, each committed: still nothing but the buffers copied
    step(model2, opt2, s)
    for t in live.tracked.values():
        t.snapshot()
    assert sum(t.copied for t in live.tracked.values()) == buffers
for (k, a), b in zip(ref_model.state_dict().items(), model2.state_dict().values()):
    assert torch.equal(local(a), local(b)), k
print("copied per commit:", copied, "in place:", in_place)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("form,fsdp", [("app", "fsdp"), ("app", "plain"), ("app-flat", "fsdp"), ("parts", "fsdp")])
def test_a_stateful_s_commit_reads_parameters_and_optimizer_state_in_place(form, fsdp):
    """examples/hsdp_train.py's DCP AppState (nested and flattened optimizer keys) and its
    torchtitan-like containers over a Linear-BatchNorm-Linear model with AdamW, fully_shard on a
    1 x 1 mesh or a plain module: a commit copies only the BatchNorm buffers (520 bytes), the
    parameters and AdamW state are held in place (every one of the 24 tensors: AdamW's step counts too); a forward outside
    commit leaves the committed state as it was; an in-place restart moves it into the next call's
    objects (LiveState._load), whose commits again copy only the buffers, and two more steps end
    bit-equal to a run without the restart."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", _ZERO, ROOT, form, fsdp], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env=env)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "copied per commit: 520 in place:" in res.stdout, res.stdout


def test_a_state_copied_whole_is_said_at_the_first_commit_with_its_bytes():
    """A Stateful whose state_dict() clones its model's tensors cannot be read in place: its commit
    copies all 8,396,800 bytes and its note says why; an object holding no module or optimizer with
    1.2 MB of state says that; a small one (a position) says nothing."""
    import torch
    import torch.nn as nn

    from ft_launcher.rank_monitor.rank_side.live import live_objects as O

    class Copies:
        def __init__(self, model):
            self.model = model

        def state_dict(self):
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

        def load_state_dict(self, state_dict):
            self.model.load_state_dict(state_dict)

    class Position:
        def __init__(self, n):
            self.n = n

        def state_dict(self):
            return {"pos": torch.zeros(self.n)}

        def load_state_dict(self, state_dict):
            pass

    copies = O.Tracked("app", Copies(nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))))
    big, small = O.Tracked("loader", Position(300_000)), O.Tracked("sampler", Position(4))
    for t in (copies, big, small):
        t.snapshot()
        t.snapshot()   # the second commit copies into the first one's tensors: the same bytes
    assert (copies.copied, copies.in_place) == (8_396_800, 0)
    assert "'app': 8.4 MB of its state dict are copies that its state_dict() makes" in copies.note
    assert big.copied == 1_200_000 and "'loader': its state dict (1.2 MB) is copied at every commit" in big.note
    assert small.copied == 16 and small.note is None


# ---- end to end ---------------------------------------------------------------------------------------
def final(text):
    lines = [ln.split("FINAL ", 1)[1] for ln in text.splitlines() if "FINAL " in ln]
    return lines[-1] if lines else None


def events(logs, kind):
    return [e["detail"] for e in read_events(str(logs)) if e["kind"] == kind]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The fault-free run's FINAL line per (ranks, flags), once per module (1 agent)."""
    from harness import own_launcher

    cache = {}

    def checksum(nproc, flags):
        key = (nproc, tuple(map(str, flags)))
        if key not in cache:
            root = tmp_path_factory.mktemp("clean")
            with own_launcher(root) as helper:
                res = helper.run(["--standalone", "--nproc-per-node", nproc, "--log-dir", root / "logs", EXAMPLE,
                                  "--ckpt-dir", root / "ckpt"] + list(flags), timeout=240)
            assert res.returncode == 0, res.stderr[-3000:]
            cache[key] = final(res.stdout)
        return cache[key]

    return checksum


APP = ["--steps", 30, "--ckpt-every", 10]


def run_1x4(launcher, tmp_path, flags):
    res = launcher.run(["--standalone", "--nproc-per-node", 4, "--max-restarts", 1, "--log-dir", tmp_path / "logs",
                        EXAMPLE, "--ckpt-dir", tmp_path / "ckpt"] + flags, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


@pytest.mark.slow
@pytest.mark.parametrize("state", ["app", pytest.param("app-flat", marks=pytest.mark.slow),
                                   pytest.param("parts", marks=pytest.mark.slow)])
def test_hsdp_through_a_dcp_appstate_heals_a_killed_rank_exactly(launcher, tmp_path, clean, state):
    """1 x 4, mesh replicate 2 x shard 2, the state as one Stateful (`app`: DCP's recipe; `app-flat`:
    flattened optimizer keys; `parts`: torchtitan-like model and optimizer containers): rank 3
    killed at step 17 receives shard 1 from rank 1 as DTensors, set_state_dict loads them, the job
    resumes at 16 and ends with the fault-free run's parameters."""
    flags = APP + ["--state", state]
    res = run_1x4(launcher, tmp_path, flags + ["--fail-at-step", 17, "--fail-rank", 3])
    assert final(res.stdout) == clean(4, flags) and final(res.stdout) is not None, res.stdout[-2000:]
    live = events(tmp_path / "logs", "live_recovery")
    assert len(live) == 1 and live[0]["resume_step"] == 16, live
    assert per_rank(live[0]["sources"]) == {"0": "kept", "1": "kept", "2": "kept", "3": "peer 1"}, live
    assert "no live state" not in res.stderr and "Traceback" not in res.stderr, res.stderr[-3000:]


@pytest.mark.slow
def test_a_heal_whose_load_raises_falls_back_on_every_rank_with_one_line(launcher, tmp_path, clean):
    """As above, and the healed rank 3's AppState.load_state_dict raises: every rank's restore()
    returns None, rank 0 says in one line which rank, which object and what it raised; every rank
    loads the checkpoint of step 10 and the job ends exact, on its one restart."""
    flags = APP + ["--state", "app"]
    res = run_1x4(launcher, tmp_path, flags + ["--fail-at-step", 17, "--fail-rank", 3, "--fail-load-rank", 3])
    assert final(res.stdout) == clean(4, flags), res.stdout[-2000:]
    lines = [ln for ln in res.stderr.splitlines() if "no live state to resume from" in ln]
    assert len(lines) == 1, res.stderr[-3000:]
    assert ("on rank 3, load_state_dict() of 'app' raised RuntimeError: rank 3: load_state_dict fails on purpose"
            in lines[0]), lines
    assert "Traceback" not in res.stderr
    assert "resumed from the checkpoint at step 10 (cycle 1)" in res.stdout, res.stdout[-2000:]
    live = events(tmp_path / "logs", "live_recovery")
    assert len(live) == 1 and live[0]["resume_step"] is None, live
    restarts = events(tmp_path / "logs", "restart")
    assert len(restarts) == 1 and restarts[0]["restarts_used"] == 1, restarts


class Agents(ExampleAgents):
    """examples/hsdp_train.py on `nodes` agents x `nproc` ranks (+ `spares` hot spares) on this machine."""

    def __init__(self, launcher, root, nodes, nproc, flags, spares=0):
        self.prog = root / "progress"
        super().__init__(launcher, root, nodes, nproc, EXAMPLE, ["--ckpt-dir", root / "ckpt", "--progress-dir",
                                                                  self.prog] + list(flags), spares=spares)

    def run(self, lost=()):
        results = self.wait(bound=300, lost=lost)
        return "".join(r[1] for r in results), "".join(r[2] for r in results)


@pytest.mark.slow
def test_pure_fsdp_through_a_dcp_appstate_resumes_from_its_buddy_copy_exactly(launcher, tmp_path, clean):
    """2 agents x 1 rank, fully_shard over both (no replica), `--buddy-every 1 --state app`: rank 1
    killed at step 17 resumes from its copy of step 16 (its DTensors placed on its mesh), exact."""
    flags = ["--steps", 30, "--ckpt-every", 10, "--replicas", 1, "--buddy-every", 1, "--state", "app"]
    out, err = Agents(launcher, tmp_path, 2, 1, flags + ["--fail-at-step", 17, "--fail-rank", 1,
                                                         "--fail-how", "kill"]).launch().run()
    assert final(out) == clean(2, flags) and final(out) is not None, out[-2000:]
    live = events(tmp_path / "logs", "live_recovery")
    assert len(live) == 1 and live[0]["resume_step"] == 16 and live[0]["steps_redone"] <= 1, live
    assert per_rank(live[0]["sources"])["1"] in ("host copy", "buddy 0"), live
    assert "no live state" not in err, err[-3000:]


@pytest.mark.slow
def test_hsdp_a_lost_node_holding_one_replica_heals_from_the_other_on_a_spare(launcher, tmp_path, clean):
    """2 agents x 2 ranks + a spare agent, mesh replicate 2 x shard 2 (a node holds one whole replica),
    `--state app`: node 1 (its agent and ranks 2, 3) SIGKILLed while training; the spare takes ranks
    2, 3 and they heal from ranks 0, 1: exact, no step redone."""
    flags = ["--steps", 60, "--ckpt-every", 10, "--state", "app"]
    job = Agents(launcher, tmp_path, 2, 2, flags + ["--step-time", 0.05], spares=1).launch()
    job.add_spares()
    wait_for(lambda: any(c == 0 and s >= 20 for c, s, _ in progress(str(job.prog), 3)), 120, "rank 3 at step 20")
    for proc in node_tree(job.agents[1].pid):
        proc.kill()
    out, err = job.run(lost=(1,))
    assert final(out) == clean(4, flags) and final(out) is not None, (out[-2000:], err[-3000:])
    live = events(tmp_path / "logs", "live_recovery")
    assert len(live) == 1, live
    if live[0]["resume_step"] is None:   # explicit: the one line says why
        lines = [ln for ln in err.splitlines() if "no live state to resume from" in ln]
        assert len(lines) == 1, err[-3000:]
        pytest.fail(f"fell back: {lines[0]}")
    sources = per_rank(live[0]["sources"])
    assert sources["0"] == sources["1"] == "kept" and {sources["2"], sources["3"]} == {"peer 0", "peer 1"}, live


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("state", ["objects", "app"])
def test_hsdp_elastic_a_lost_node_comes_back_and_heals_from_its_replica_exactly(launcher, tmp_path, clean, state):
    """2 agents x 2 ranks, mesh replicate 2 x shard 2 (a node holds one whole replica), `--elastic
    --nnodes 1:2`, the state as `model=`/`optimizer=` (objects) or a DCP AppState (app), `--data
    shard` (replicas draw the same batch, so the model is the same on 1 or 2 replicas: a fault-free
    run of 4 ranks is the reference bit for bit). Node 1 (its agent and ranks 2, 3) SIGKILLed at
    step 15: ranks 0, 1 go on alone, in place. Node 1's agent started again: the job grows back to
    4 ranks, ranks 0, 1 kept, ranks 2, 3 heal from ranks 0, 1 (their optimizer state's DTensors
    sent on this call's 2 x 2 mesh, not the 1 x 2 one they were committed on), the replicas'
    digests agree, no checkpoint line, and every shard ends bit-equal to the fault-free run's."""
    flags = ["--steps", 120, "--ckpt-every", 10, "--data", "shard", "--state", state]
    job = Agents(launcher, tmp_path, 2, 2, flags + ["--step-time", 0.1])
    job.args = ["--elastic"] + job.args
    job.args[job.args.index("--nnodes") + 1] = "1:2"
    job.args[job.args.index("--rdzv-conf") + 1] = "join_timeout=30,last_call_timeout=20"
    job.launch()
    prog = str(job.prog)
    wait_for(lambda: any(c == 0 and s >= 15 for c, s, _ in progress(prog, 3)), 240, "rank 3 at step 15",
             interval=0.01)
    for proc in node_tree(job.agents[1].pid):
        proc.kill()
    shrunk = wait_for(lambda: events(tmp_path / "logs", "live_recovery"), 120, "the shrink's live recovery")
    wait_for(lambda: [s for c, s, _ in progress(prog, 0) if c == 1 and s >= (shrunk[0]["resume_step"] or 0) + 5], 120,
             "rank 0 five steps on 1 replica")
    job.agents.append(launcher.start(job.args, extra_env={"GROUP_RANK": "1"}))   # node 1 comes back
    out, err = job.run(lost=(1,))
    live = events(tmp_path / "logs", "live_recovery")
    assert len(live) == 2, (live, err[-3000:])
    lines = [ln for ln in err.splitlines() if "no live state to resume from" in ln]
    assert not lines, lines
    shrink, grow = live
    assert per_rank(shrink["sources"]) == {"0": "kept", "1": "kept"} and shrink["steps_redone"] == 0, shrink
    sources = per_rank(grow["sources"])
    assert sources["0"] == sources["1"] == "kept" and {sources["2"], sources["3"]} == {"peer 0", "peer 1"}, grow
    assert grow["resume_step"] is not None and grow["steps_redone"] == 0 and grow["check"]["bytes"] > 0, grow
    assert len(events(tmp_path / "logs", "elastic_join")) == 1
    for rank in (2, 3):   # the newcomers trained on from the resume step to the end
        assert [s for c, s, _ in progress(prog, rank) if c == 2] == list(range(grow["resume_step"] + 1, 121)), rank
    assert final(out) == clean(4, flags) and final(out) is not None, (out[-2000:], err[-3000:])
    print(f"\nshrink: {shrink}\ngrow: {grow}\n{final(out)}")
