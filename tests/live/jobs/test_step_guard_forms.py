"""The step guard on every loop form the docs show (issue 45), with corruption simulated where it
really lands (rank_side.live.sdc_sim): in one rank's gradient before the all-reduce (`backward`),
after it and after the loop's own clip_grad_norm_ (`reduced`), or in a parameter after the
optimizer step (`memory`); NaN, Inf, a flipped top exponent bit and finite flips.

Every whole job runs a real ft_launcher with real ranks (gloo) and ends either bit-equal to its
fault-free run (each rank's sha256 of its parameters, `digest` in final_rank_<r>.json or the shard
digests of examples/hsdp_train.py, compared against the fault-free run's) with the guard's lines
saying what happened, or with one line saying why not. The forms:
- `live.commit(step, loss=loss)` and `live.commit(step, loss=loss, grad_norm=clip_grad_norm_(...))`
  on DDP (examples/live_train.py), with 2 replicas (no majority: the re-run, the non-finite one,
  or the checkpoint decides) and 3 (the majority names the odd one);
- FSDP/HSDP through DCP's `AppState` and through torchtitan-shaped containers (examples/hsdp_train.py
  `--state app|parts`, 2 replicas x 2 shards);
- a GradScaler's routine overflow, a loss-less pipeline stage, a NaN at the very first step.

The default suite runs the verdict's pure parts, the digest and the target search, and two short
jobs (a transient before the all-reduce named and healed with `grad_norm=`; a first-step NaN that
ends with the data's line); the rest are `slow`.
"""
import json
import math

import pytest
import torch

from conftest import ROOT
from harness import ExampleAgents
from ft_launcher.rank_monitor.rank_side.live import guard_targets, replica_fingerprint as F, step_guard as G

LIVE = f"{ROOT}/examples/live_train.py"
HSDP = f"{ROOT}/examples/hsdp_train.py"
STEPS, FAULT = 40, 27


def sdc(spec, rank=1):
    return ["--ft-simulate-fault", "true", "--ft-simulated-fault-type", "rank_sdc", "--ft-simulated-fault-rank", rank,
            "--ft-simulated-sdc", spec]


class GuardRun:
    """One examples/live_train.py job (1 agent x `nproc`, --guard, a checkpoint every 20 steps)."""

    def __init__(self, launcher, root, nproc, job_args=(), ft_args=(), max_restarts=2, script=LIVE, nodes=1,
                 spares=0):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        base = ([*job_args, "--ckpt-dir", root / "ckpt"] if script == HSDP else
                ["--steps", STEPS, "--ckpt-every", 20, "--guard", "--ckpt-dir", root / "ckpt", *job_args])
        self.agents = ExampleAgents(launcher, root, nodes, nproc, script, base, ft_args=list(ft_args), spares=spares,
                                    max_restarts=max_restarts)
        self.world = nodes * nproc

    def run(self, bound=240, lost=()):
        self.agents.launch()
        if self.agents.spares:
            self.agents.add_spares()
        results = self.agents.wait(bound=bound, lost=lost)
        self.codes = [r[0] for r in results]
        self.out = "".join(r[1] for r in results)
        self.err = "".join(r[2] for r in results)
        return self

    def digests(self):
        return [json.loads((self.root / "ckpt" / f"final_rank_{r}.json").read_text())["digest"]
                for r in range(self.world)]

    def finals(self):
        return [json.loads((self.root / "ckpt" / f"final_rank_{r}.json").read_text()) for r in range(self.world)]

    def shards(self):
        line = [x for x in self.out.splitlines() if "FINAL" in x][-1]
        return line.split("shards=")[1].strip()

    def lines(self):
        return [e["detail"]["decision"] for e in self.agents.events() if e["kind"] == "step_guard"]

    def said(self):
        """The guard's lines and the fallback lines the ranks printed."""
        return self.lines() + [x for x in self.err.splitlines() if "every rank loads its checkpoint" in x]


_REFS = {}


def reference(launcher, tmp_path, key, nproc, job_args=(), script=LIVE):
    """The fault-free run's digests (once per module and form)."""
    if key not in _REFS:
        run = GuardRun(launcher, tmp_path / f"ref_{key}", nproc, job_args, script=script).run()
        assert run.lines() == [], run.lines()
        _REFS[key] = run.shards() if script == HSDP else run.digests()
    return _REFS[key]


# ---- the default suite: the pure parts --------------------------------------------------------------------
def _table(rows):
    table = []
    for values in rows:
        row = [0.0] * G.COLS
        row[G.P_STEP], row[G.SEEN], row[G.LOSS_MAX], row[G.NORM_MAX], row[G.FP_K] = -1, 20, 1.0, 1.0, 1
        for k, v in values.items():
            row[k] = v
        table.append(row)
    return table


def test_the_verdict_names_the_rank_whose_own_backward_went_bad_and_spares_a_scalers_overflow():
    nan, inf = float("nan"), float("inf")
    # a NaN from rank 2's backward, all-reduced into every rank: every norm NaN, every loss finite
    v = G.judge(_table([{G.NORM: nan, G.LOCAL_NORM: 1.0}, {G.NORM: nan, G.LOCAL_NORM: 2.0},
                        {G.NORM: nan, G.LOCAL_NORM: nan}]), G.GuardConfig())
    assert v["fatal"] == [0, 1, 2] and v["suspect"] == 2
    # a flipped top exponent bit before the all-reduce: finite everywhere, but rank 1's own norm is past 2**60
    v = G.judge(_table([{G.NORM: 3e18, G.LOCAL_NORM: 0.5}, {G.NORM: 3e18, G.LOCAL_NORM: 6e18}]), G.GuardConfig())
    assert v["fatal"] == [1] and v["suspect"] == 1
    # a GradScaler's overflow: Inf gradients with a finite loss are the scaler's to skip
    v = G.judge(_table([{G.NORM: inf, G.LOCAL_NORM: inf, G.SCALER: 1}, {G.NORM: inf, G.SCALER: 1}]), G.GuardConfig())
    assert v["fatal"] == [] and v["scaled"] == [0, 1]
    # ...but not a NaN loss
    v = G.judge(_table([{G.NORM: inf, G.LOSS: nan, G.SCALER: 1}, {G.NORM: inf, G.SCALER: 1}]), G.GuardConfig())
    assert v["fatal"] == [0] and v["suspect"] == 0


def test_replicas_whose_digests_differ_are_found_and_the_majority_names_the_odd_one():
    same, odd = {G.FP_ON: 1, G.FP_ID: 7, G.FP_HI: 1, G.FP_LO: 2}, {G.FP_ON: 1, G.FP_ID: 7, G.FP_HI: 1, G.FP_LO: 3}
    assert G.judge(_table([same, same, same]), G.GuardConfig())["diverged"] == []
    d = G.judge(_table([same, odd, same]), G.GuardConfig())["diverged"]
    assert d == [{"ranks": [0, 1, 2], "good": [0, 2], "odd": [1]}]
    assert G.judge(_table([same, odd]), G.GuardConfig())["diverged"][0]["odd"] is None   # two: no majority
    other = {**odd, G.FP_ID: 8}   # another shard's replicas are not compared with these
    assert G.judge(_table([same, other, same, dict(other)]), G.GuardConfig())["diverged"] == []
    assert G.judge(_table([same, {**odd, G.FP_ON: 0}]), G.GuardConfig())["diverged"] == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_fingerprint_digest_changes_with_every_single_bit_flip(dtype):
    # every element of each layout the digest reads: whole int64 words and the elements past them
    # (15 elements), a slice at an odd offset, a transposed (not contiguous) view
    g = torch.Generator().manual_seed(0)
    bases = [torch.randn(5, 3, generator=g).to(dtype), torch.randn(5, 4, generator=g).to(dtype),
             torch.randn(3, 4, generator=g).to(dtype), torch.randn(4, generator=g).to(dtype)]

    def views(ts):   # (one view per base: an element seen twice would count 2 * 2**63 = 0 for bit 63)
        return [ts[0], ts[1][1:, 1:], ts[2].t(), ts[3]]

    base = int(F.digest(views(bases), torch.device("cpu")))
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[bases[0].element_size()]
    for which in range(4):
        for i in range(views(bases)[which].numel()):
            for bit in range(bases[0].element_size() * 8):
                flipped = [t.clone() for t in bases]
                x = views(flipped)[which]
                x[tuple(int(k) for k in torch.unravel_index(torch.tensor(i), x.shape))].view(ints).bitwise_xor_(
                    torch.tensor(1, dtype=ints) << bit)
                assert int(F.digest(views(flipped), torch.device("cpu"))) != base, (which, i, bit)
    hi, lo = F.halves(torch.tensor(base))
    assert (int(hi) << 32 | int(lo)) == base & ((1 << 64) - 1)


def test_the_targets_are_found_through_dcps_appstate_torchtitan_shaped_containers_and_a_grad_scaler():
    class AppState:   # PyTorch's DCP recipe
        def __init__(self, model, optimizer):
            self.model, self.optimizer = model, optimizer

        def state_dict(self):
            return {}

        def load_state_dict(self, sd):
            pass

    class Container(torch.optim.Optimizer):   # torchtitan's OptimizersContainer shape
        def __init__(self, parts):
            self.optimizers = [torch.optim.AdamW(m.parameters()) for m in parts]
            torch.optim.Optimizer.__init__(self, [p for m in parts for p in m.parameters()], {})

    class ModelWrapper:   # torchtitan's ModelWrapper shape
        def __init__(self, parts):
            self.model = parts

    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    app = guard_targets.find({"app": AppState(torch.nn.Sequential(a, b), torch.optim.SGD([*a.parameters()], 0.1))})
    assert app.found and [id(p) for p in app.params] == [id(p) for p in a.parameters()]   # what the optimizer updates
    tt = guard_targets.find({"model": ModelWrapper([a, b]), "optimizer": Container([a, b])})
    assert len(tt.optimizers) == 2 and len(tt.params) == 4 and len(tt.modules) == 2
    scaler = torch.amp.GradScaler("cpu")
    assert guard_targets.find({"model": a, "scaler": scaler}).scaler_enabled()
    assert not guard_targets.find({"loader": object()}).found


def test_where_torchs_fsdp2_internals_are_not_as_read_the_watch_says_so_once_and_falls_back(capsys):
    """A module that is an FSDPModule without the FSDP state this torch keeps: one line, no error,
    and the hooks stay on the parameters themselves (today's fallback: the reduced gradients)."""
    from torch.distributed.fsdp import FSDPModule
    from ft_launcher.rank_monitor.rank_side.live import backward_watch as W

    odd = torch.nn.Linear(3, 2)
    odd.__class__ = type("FSDPLinear", (FSDPModule, torch.nn.Linear), {})
    W._SAID[0] = False
    for _ in range(2):
        watch = W.BackwardWatch(list(odd.parameters()), 1, modules=[odd])
        odd(torch.ones(1, 3)).sum().backward()
        assert float(watch.local(torch.device("cpu"))) > 0
        watch.remove()
    said = [x for x in capsys.readouterr().err.splitlines() if "backward watch cannot reach FSDP2" in x]
    assert len(said) == 1 and "a bad rank is not named" in said[0], said


def test_under_fsdp2_and_hsdp_the_watch_sees_each_ranks_own_gradient_before_the_reduce_scatter(launcher, tmp_path):
    """tests/scripts/fsdp_backward_watch.py: fully_shard over 2 ranks as pure FSDP and as HSDP (2
    replicas x 1 shard). A NaN that rank 1's own backward makes, and the simulated fault's `backward`
    place, are in rank 1's watch and not in rank 0's, though the reduce-scatter (and HSDP's
    all-reduce) spreads them to rank 0's gradients; a clean backward is clean on both. The watch
    starts before the first forward (no unsharded parameter yet) and again after it."""
    from ft_launcher.rank_monitor.rank_side.live.backward_watch import bad

    script = f"{ROOT}/tests/scripts/fsdp_backward_watch.py"
    res = launcher.run(["--standalone", "--nproc-per-node", 2, "--log-dir", tmp_path / "logs", script, tmp_path])
    assert res.returncode == 0, res.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"watch_{r}.json").read_text()) for r in range(2)]
    for mesh in ("fsdp", "hsdp"):
        r0, r1 = ranks[0][mesh], ranks[1][mesh]
        for step in ("1", "2", "4"):   # rank 1's own NaN, the simulated one, its own under a new watch
            assert bad(r1[step]["local"]) and not bad(r0[step]["local"]) and r0[step]["local"] > 0, (mesh, step, ranks)
            assert not r0[step]["reduced_finite"], (mesh, step, ranks)   # spread to rank 0 after the watch saw it
        assert r1["2"]["injected"] and "rank 1's gradient at step 2 (backward, once)" in r1["2"]["injected"], ranks
        assert r0["2"]["injected"] is None and r1["1"]["injected"] is None, ranks
        assert all(0 < r[mesh]["3"]["local"] and not bad(r[mesh]["3"]["local"]) for r in ranks), ranks


def test_a_rewind_puts_back_the_rng_the_buffers_and_a_scalers_unscale():
    """What a step re-run in place (commit's run=) puts back: what a forward and backward moved
    since the commit, so the re-run draws and normalises as the first run did."""
    from ft_launcher.rank_monitor.rank_side.live.live_objects import Tracked
    from ft_launcher.rank_monitor.rank_side.live.live_rng import Rng

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    tracked = [Tracked(n, o) for n, o in (("model", model), ("opt", opt), ("rng", Rng()), ("scaler", scaler))]
    for t in tracked:
        t.snapshot()   # the commit
    stats = [b.clone() for b in model[1].buffers()]

    def forward_backward():
        out = model(torch.randn(8, 4))
        scaler.scale(out.sum()).backward()
        scaler.unscale_(opt)
        return out

    first = forward_backward()
    assert not torch.equal(next(model[1].buffers()), stats[0])   # the forward moved the statistics
    assert all(t.rewind(dry=True) for t in tracked)
    for t in tracked:
        t.rewind()
    assert all(torch.equal(a, b) for a, b in zip(model[1].buffers(), stats))
    opt.zero_grad()
    assert torch.equal(forward_backward(), first)   # the same draws, the same statistics, unscale_ again


# ---- short whole jobs (default) ----------------------------------------------------------------------------
@pytest.mark.timeout(400)
@pytest.mark.parametrize("watch", ["after_hit", "every_step"])
def test_grad_norm_form_a_nan_from_rank_1s_backward_is_re_run_and_ends_bit_equal(launcher, tmp_path, watch):
    """The default watches each rank's own backward from the re-run on (no pass per step): a
    once-only NaN is re-run, clean, unnamed; then the next one within the window is named.
    watch_every_step names the first one."""
    form = ["--grad-norm"]
    ref = reference(launcher, tmp_path, "2_norm", 2, form)
    every = ["--watch-every-step"] if watch == "every_step" else []
    run = GuardRun(launcher, tmp_path / "sdc", 2, form + every, sdc(f"nan:{FAULT}:once")).run()
    assert run.codes == [0], run.err[-3000:]
    assert run.digests() == ref
    lines = run.lines()
    assert len(lines) == 2, lines
    if watch == "every_step":
        assert lines[0].startswith(f"step {FAULT}: ") and "on rank 1 (made in rank 1's own backward, before " \
                                                         "the all-reduce): not committed" in lines[0], lines
        assert "a transient fault on rank 1" in lines[1] and "node 0 device 1" in lines[1], lines
    else:
        assert lines[0].startswith(f"step {FAULT}: ") and "on ranks 0, 1 (each rank's own backward is watched " \
                                                         "in the re-run, to name the rank): not committed" in lines[0]
        assert "a transient fault;" in lines[1], lines
    assert all(f["cycle"] == 0 for f in run.finals())   # in place: no process replaced


@pytest.mark.timeout(400)
@pytest.mark.parametrize("form", [[], ["--grad-norm"], ["--batchnorm"], ["--dropout", "0.1"]],
                         ids=["loss", "grad_norm", "batchnorm", "dropout"])
def test_with_run_a_transient_is_re_run_in_place_and_ends_bit_equal(launcher, tmp_path, form):
    """live.commit(step, run=forward_backward): the guard's re-run calls the loop's forward and
    backward again inside the commit (the RNG and BatchNorm's statistics put back to the commit),
    not the training function: the job ends bit-equal to the fault-free run of the plain form, with
    no restore in between. (With a GradScaler a NaN gradient is the scaler's skip, not a re-run:
    test_a_grad_scalers_overflow_is_skipped_by_the_scaler_not_taken_for_corruption.)"""
    key = "2_" + "_".join(a.strip("-") for a in form)
    ref = reference(launcher, tmp_path, key, 2, form)
    run = GuardRun(launcher, tmp_path / "sdc", 2, form + ["--rerun-in-place"], sdc(f"nan:{FAULT}:once")).run()
    assert run.codes == [0], run.err[-3000:]
    assert run.digests() == ref, run.lines()
    lines = run.lines()
    assert len(lines) == 2 and lines[0].startswith(f"step {FAULT}: ") and "not committed" in lines[0], lines
    assert "a transient fault" in lines[1], lines
    assert "resumed from live state" not in run.out, run.out[-3000:]   # the training function was not re-entered
    assert all(f["cycle"] == 0 for f in run.finals())


@pytest.mark.timeout(400)
def test_under_fsdp2_a_nan_from_rank_1s_backward_is_named_re_run_and_ends_bit_equal(launcher, tmp_path):
    """examples/live_train.py --fsdp (fully_shard over 2 ranks, no replica), watch_every_step: the
    reduce-scatter spreads rank 1's NaN to rank 0's shard, and the watch (on FSDP2's unsharded
    parameters) still names rank 1; the re-run is clean and the job ends bit-equal."""
    form = ["--grad-norm", "--fsdp"]
    ref = reference(launcher, tmp_path, "2_norm_fsdp", 2, form)
    run = GuardRun(launcher, tmp_path / "sdc", 2, form + ["--watch-every-step"], sdc(f"nan:{FAULT}:once")).run()
    assert run.codes == [0], run.err[-3000:]
    assert run.digests() == ref
    lines = run.lines()
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"step {FAULT}: ") and "on rank 1 (made in rank 1's own backward, before the " \
                                                     "all-reduce): not committed" in lines[0], lines
    assert "a transient fault on rank 1" in lines[1], lines


@pytest.mark.timeout(400)
def test_where_one_rank_commits_without_run_every_rank_re_runs_by_restart_never_a_hang(launcher, tmp_path):
    """run= on rank 0 only: the ranks agree (one all_reduce) that the step cannot be re-run in place,
    and every rank re-runs it through the restart, as without run=; bit-equal."""
    ref = reference(launcher, tmp_path, "2_", 2, [])
    run = GuardRun(launcher, tmp_path / "sdc", 2, ["--rerun-in-place", "--plain-commit-rank", 1],
                   sdc(f"nan:{FAULT}:once")).run(bound=200)
    assert run.codes == [0], run.err[-3000:]
    assert run.digests() == ref, run.lines()
    assert "a transient fault" in run.lines()[-1], run.lines()
    assert "resumed from live state" in run.out, run.out[-2000:]


@pytest.mark.timeout(300)
def test_a_nan_at_the_first_step_ends_with_the_datas_line_never_in_a_loop(launcher, tmp_path):
    run = GuardRun(launcher, tmp_path, 2, ["--poison-step", 1, "--poison-rank", 1]).run(bound=200, lost=(0,))
    assert run.codes == [93], run.err[-3000:]
    stop = [x for x in run.err.splitlines() if "sent ShutdownWorkload" in x]
    assert stop and "step 1: " in stop[0] and "on rank 1, reproducible on other hardware" in stop[0], run.err[-3000:]
    assert len([x for x in run.lines() if "not committed" in x]) <= 2, run.lines()


# ---- whole jobs (slow) ---------------------------------------------------------------------------------------
CASES = [   # (replicas, form, fault, what the lines say); a fault the fingerprint finds ends bit-equal
    # when its digest is due at the next step (fingerprint_every=1: the contract); at a larger K the
    # heal says that the result may differ (test_a_late_digest_heals_and_says_the_result_may_differ)
    (3, "norm", "nan:{}:once:reduced", "heals from a good replica"),
    (3, "norm", "expflip:{}:once:reduced", "heals from a good replica"),
    (3, "loss", "bitflip:{}:once:memory", "heals from a good replica"),
    (3, "norm", "mantflip:{}:once:memory", "heals from a good replica"),
    (3, "loss", "inf:{}:once", "a transient fault;"),   # unnamed: the watch is on from the re-run
    (3, "norm", "bitflip:{}:once", "a transient fault;"),
    (2, "loss", "nan:{}:once:reduced", "a transient fault on rank 1"),   # its own norm names it
    (2, "norm", "nan:{}:once:reduced", "heals from a good replica"),
    (2, "loss", "mantflip:{}:once:memory", "none is known good: every rank loads its checkpoint"),
]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("replicas,form,fault,says", CASES, ids=[f"{r}x-{f}-{s.split(':')[0]}-{(s.split(':')[3:] or ['backward'])[0]}"
                                                              for r, f, s, _ in CASES])
def test_ddp_every_place_and_kind_ends_bit_equal_with_its_line(launcher, tmp_path, replicas, form, fault, says):
    job = ["--grad-norm"] if form == "norm" else []
    ref = reference(launcher, tmp_path, f"{replicas}_{form}", replicas, job)
    every = ["--fingerprint-every", 1] if "heals" in says or "none is known" in says else []
    run = GuardRun(launcher, tmp_path / "sdc", replicas, job + every, sdc(fault.format(FAULT))).run()
    assert run.codes == [0], run.err[-3000:]
    assert run.digests() == ref, (run.digests(), ref, run.said())   # every replica equal, and equal to the fault-free run
    assert any(says in x for x in run.said()), run.said()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_late_digest_heals_and_says_the_result_may_differ(launcher, tmp_path):
    """fingerprint_every=4: a finite flip in rank 1's gradient after the all-reduce at step 29 (its
    update then differs) is found by step 32's digest (of the state as of step 31), after rank 1's
    gradients went into its peers' updates at steps 30-31: the replicas heal equal, and the line
    says the result may differ from a run without the fault."""
    run = GuardRun(launcher, tmp_path, 3, ["--grad-norm", "--fingerprint-every", 4],
                   sdc("expflip:29:once:reduced")).run()
    assert run.codes == [0], run.err[-3000:]
    assert len(set(run.digests())) == 1, run.digests()
    heal = [x for x in run.lines() if "heals from a good replica" in x]
    assert heal and heal[0].startswith("step 32: ") and "may differ from a run without the fault" in heal[0], run.lines()


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("state,fault,says", [
    ("app", "nan:10:once:reduced", "heals from a good replica"),
    ("app", "expflip:10:once:memory", "every rank loads its checkpoint"),
    ("parts", "bitflip:10:once:reduced", "heals from a good replica"),
])
def test_hsdp_through_dcps_appstate_and_torchtitan_shaped_containers(launcher, tmp_path, state, fault, says):
    job = ["--steps", 24, "--guard", "--grad-norm", "--ckpt-every", 8, "--state", state]
    ref = reference(launcher, tmp_path, f"hsdp_{state}", 4, job, script=HSDP)
    run = GuardRun(launcher, tmp_path / "sdc", 4, job, sdc(fault), script=HSDP).run(bound=400)
    assert run.codes == [0], run.err[-3000:]
    assert run.shards() == ref, (run.shards(), ref, run.said())
    assert any(says in x for x in run.said()), run.said()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hsdp_through_appstate_names_the_rank_whose_own_backward_made_a_nan(launcher, tmp_path):
    """2 replicas x 2 shards through DCP's AppState, watch_every_step: a NaN in rank 1's backward is
    in its unsharded gradient before the reduce-scatter (and the replicas' all-reduce) spreads it;
    the guard names rank 1, the re-run is clean, and the shards end bit-equal."""
    job = ["--steps", 24, "--guard", "--grad-norm", "--ckpt-every", 8, "--state", "app"]
    ref = reference(launcher, tmp_path, "hsdp_app", 4, job, script=HSDP)
    run = GuardRun(launcher, tmp_path / "sdc", 4, job + ["--watch-every-step"], sdc("nan:10:once"),
                   script=HSDP).run(bound=400)
    assert run.codes == [0], run.err[-3000:]
    assert run.shards() == ref, (run.shards(), ref, run.said())
    lines = run.lines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("step 10: ") and "on rank 1 (made in rank 1's own backward" in lines[0], lines
    assert "a transient fault on rank 1" in lines[1], lines


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_grad_scalers_overflow_is_skipped_by_the_scaler_not_taken_for_corruption(launcher, tmp_path):
    run = GuardRun(launcher, tmp_path, 2, ["--scaler", "--grad-norm"], sdc(f"inf:{FAULT}:once")).run()
    assert run.codes == [0], run.err[-3000:]
    assert run.lines() == [], run.lines()   # no re-run, no stop: the scaler skipped the step and lowered its scale
    finals = run.finals()
    assert len({f["digest"] for f in finals}) == 1
    assert finals[0]["scale"] < 2.0 ** 16, finals[0]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("in_place", [False, True], ids=["restart", "run"])
def test_a_loss_less_pipeline_stage_joins_every_guard_collective(launcher, tmp_path, in_place):
    """Rank 1 commits with no loss (a stage without one): it still joins the guard's table, so
    rank 0's checked commits never hang, and a NaN in rank 1's backward is still re-run, transient
    (with run=, whose function returns None on rank 1: in place)."""
    extra = ["--rerun-in-place"] if in_place else []
    run = GuardRun(launcher, tmp_path, 2, ["--no-loss-rank", 1, *extra], sdc(f"nan:{FAULT}:once")).run(bound=200)
    assert run.codes == [0], run.err[-3000:]
    lines = run.lines()
    assert len(lines) == 2 and "watched in the re-run" in lines[0] and "a transient fault;" in lines[1], lines
    assert len(set(run.digests())) == 1
    assert ("resumed from live state" in run.out) != in_place, run.out[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_persistent_bit_flip_on_node_1_names_its_device_and_the_node_leaves_for_a_spare(launcher, tmp_path):
    """The issue's silent case: 2 agents x 1 rank plus a hot spare, a top exponent bit flipped in
    rank 1's backward on every step from FAULT on (its node), `grad_norm=` given."""
    job = ["--grad-norm"]
    ref = reference(launcher, tmp_path, "2_norm", 2, job)
    run = GuardRun(launcher, tmp_path / "sdc", 1, job + ["--step-time", 0.5], sdc(f"bitflip:{FAULT}:node"), nodes=2,
                   spares=1, max_restarts=3).run(bound=500, lost=(1,))   # (cycle 0's slow steps: the spare waits by then)
    assert run.codes[1] == 93, run.err[-3000:]   # node 1 left the job
    assert run.digests() == ref, (run.digests(), ref, run.said())
    lines = run.lines()
    assert len(lines) == 3, lines
    # the first hit is every rank's alike; the watched re-run hits again and names rank 1
    assert "watched in the re-run" in lines[0] and "on rank 1): reproducible" in lines[1] \
        and "moves to other hardware (exit 16)" in lines[1], lines
    assert "a persistent hardware fault on node 1 (device 0 first), which has left the job" in lines[2], lines
    live = [e["detail"] for e in run.agents.events() if e["kind"] == "live_recovery"]
    assert live and all(d["resume_step"] == FAULT - 1 and d["steps_redone"] == 0 for d in live), live


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_seeded_sdc_soak_ends_with_no_silent_divergence(tmp_path):
    """bench/sdc_soak.py with a few seeded faults (the note's figure is its 50-fault run): each
    ends bit-equal to its fault-free run or with a line saying why not."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, f"{ROOT}/bench/sdc_soak.py", "--faults", "6", "--seed", "7"],
                          capture_output=True, text=True, timeout=1400, cwd=tmp_path)
    assert done.returncode == 0 and "silent divergence: 0" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]


def test_a_flip_in_memory_after_the_last_comparison_is_said_at_the_jobs_end(launcher, tmp_path):
    """A flip in rank 1's parameters at the last step: no later commit compares it during the run;
    the replicas' last comparison (end_fingerprint, at destroy_process_group) names rank 1."""
    run = GuardRun(launcher, tmp_path, 3, ft_args=sdc(f"mantflip:{STEPS}:once:memory")).run()
    assert run.codes == [0], run.err[-3000:]
    digests = run.digests()
    assert digests[0] == digests[2] != digests[1], digests
    end = [x for x in run.lines() if "at the job's end" in x]
    assert len(end) == 1 and "(rank 1 against ranks 0, 2)" in end[0] and "not exact" in end[0], run.lines()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pure_fsdp_a_fault_after_the_loops_norm_is_never_taken_for_the_data(launcher, tmp_path):
    """Pure FSDP (1 replica x 2 shards, no buddy copy), `grad_norm=clip_grad_norm_(...)`: a NaN lands
    in rank 1's gradient shard after the loop's own norm (`reduced`), so the guard's figures are
    finite and step 10 is committed with a NaN in rank 1's shard. Step 11 is NaN on every rank: at
    that hit the committed state is checked on every rank; rank 1's is not finite, so the live state
    is abandoned and every rank loads its checkpoint (step 8) with one line naming rank 1, and the
    job ends bit-equal to the fault-free run. (Before: a re-run from memory hit again and the job
    stopped with the data's line, exit 93, where torchrun would have lived.)"""
    job = ["--steps", 24, "--guard", "--grad-norm", "--ckpt-every", 8, "--state", "app", "--replicas", 1]
    ref = reference(launcher, tmp_path, "fsdp_app", 2, job, script=HSDP)
    run = GuardRun(launcher, tmp_path / "sdc", 2, job, sdc("nan:10:once:reduced"), script=HSDP).run(bound=400)
    assert run.codes == [0], run.err[-3000:]
    assert run.shards() == ref, (run.shards(), ref, run.said())
    said = run.said()
    assert not any("the data or the model" in x for x in said), said
    poisoned = [x for x in said if "not finite" in x and "every rank loads its checkpoint" in x]
    assert poisoned and "not finite on rank 1" in poisoned[0], said
    assert not any("re-running it from memory" in x for x in said), said   # found at the first hit
