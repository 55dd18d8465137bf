"""torchtitan 0.3.0's own trainer under ft_launcher, on this CPU (README.md beside this file).

cpu_train.py runs `torchtitan.train.main` (its llama3 debug model, FSDP over 2 ranks on gloo, its
dataloader, AdamW, LR schedule and DCP checkpoint every 10 steps) with ft_launcher's adapter
(ft_launcher.integrations.torchtitan). Rank 1 is SIGKILLed as step 14 starts; the job must end at
step 22 with exactly the parameters (SHA-256 of every gathered parameter) and the loss of the
fault-free run:
- from torchtitan's checkpoint (a restart of both ranks, steps 11-13 trained again);
- with live state (`LiveState` over torchtitan's checkpointer states, `buddy_every=1`: pure FSDP
  has no replica): rank 0 keeps its state in place, rank 1 loads its host copy, the job resumes
  at step 13 (no completed step trained again);
- HSDP 2x2 with live state but no buddy copy: the killed rank heals its model and optimizer shard
  from its replica and its dataloader position (its own) from its record in host memory; the job
  resumes at step 13, exactly;
- the step guard on torchtitan's own step (the adapter's `loss=`/`grad_norm=`): a NaN in rank 1's
  gradient at step 14, before FSDP's reduce-scatter, never committed, the step re-run, exact.
- HSDP 2x2 over 2 agents with `--elastic --nnodes 1:2`: the second node (replica group 1) lost at
  step 8, ranks 0, 1 go on in place as one group (0 steps redone), the node comes back, its ranks
  heal from the replicas (0 steps redone), and the end equals the same course run fault-free in
  three pieces chained by checkpoints (4, 2, then 4 ranks).
Each run takes 1-2 minutes on 2 cores: the module is `slow`, and skips with one reason where
torchtitan 0.3.0 (with triton and tokenizers) is not installed. The default test below (lazy
imports) needs none of it.
"""
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS, FAIL_STEP, FAIL_RANK, CKPT_EVERY = 22, 14, 1, 10
INSTALL = "pip install torchtitan==0.3.0 triton==3.9.0 tokenizers==0.23.3 (README.md beside this test)"


def _missing() -> str:
    for name in ("torchtitan", "triton", "tokenizers", "datasets"):
        if importlib.util.find_spec(name) is None:
            return f"{name} is not installed"
    from importlib.metadata import version

    if version("torchtitan") != "0.3.0":
        return f"torchtitan {version('torchtitan')} is installed, this test is written for 0.3.0"
    return ""


MISSING = _missing()


def needs_torchtitan(test):
    """A slow test of torchtitan's trainer: skipped, with one reason, where it is not installed. Its
    bound is 900 s, not the suite's 240: a test may first run a fault-free job for its fixture (an
    HSDP 2x2 one and its faulty run took over 240 s on 2 loaded cores)."""
    test = pytest.mark.timeout(900)(test)
    return pytest.mark.slow(pytest.mark.skipif(bool(MISSING), reason=f"torchtitan 0.3.0: {MISSING}: {INSTALL}")(test))


HSDP = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]


def run_titan(launcher, out, assets, fault=False, live=False, hsdp=False, buddy_every=1, timeout=420, ft_args=()):
    """cpu_train.py under ft_launcher, 2 ranks (FSDP) or 4 (`hsdp`: 2 replicas x 2 shards, the last
    rank killed); returns (completed process, per-rank step starts, per-rank results)."""
    os.makedirs(out, exist_ok=True)
    nproc = 4 if hsdp else 2
    env = {"TITAN_ASSETS": assets, "TITAN_OUT": str(out), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": os.path.join(str(out), "hf_cache")}
    if fault:
        env.update(TITAN_FAIL_STEP=str(FAIL_STEP), TITAN_FAIL_RANK=str(nproc - 1))
    if live:
        env.update(TITAN_LIVE="1", TITAN_BUDDY_EVERY=str(buddy_every))
    # warm reserves on (the default): a reserve imports only torch's and ft_launcher's modules ahead of
    # the script, so cpu_train.py's patch of torchtitan's device probe holds warm as cold (obstacle 9)
    proc = launcher.run(["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "1"] + list(ft_args) + [
                         "--log-dir", os.path.join(str(out), "logs"), os.path.join(HERE, "cpu_train.py"),
                         "--module", "titan_cpu_config", "--config", "cpu_debugmodel",
                         "--dump_folder", os.path.join(str(out), "dump"), "--training.steps", str(STEPS),
                         "--checkpoint.interval", str(CKPT_EVERY)] + (HSDP if hsdp else []),
                        timeout=timeout, extra_env=env)
    steps, results = {}, {}
    for rank in range(nproc):
        path = os.path.join(str(out), f"steps_rank{rank}.jsonl")
        steps[rank] = [json.loads(line)["step"] for line in open(path)] if os.path.exists(path) else []
        path = os.path.join(str(out), f"result_rank{rank}.json")
        results[rank] = json.load(open(path)) if os.path.exists(path) else None
    return proc, steps, results


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    if MISSING:
        pytest.skip(f"torchtitan 0.3.0: {MISSING}: {INSTALL}")
    sys.path.insert(0, HERE)
    from titan_assets import write_assets

    folder = str(tmp_path_factory.mktemp("titan_assets"))
    write_assets(folder)
    return folder


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory, assets):
    """The run without a fault: the parameters and loss a recovered run must end with."""
    from harness import own_launcher

    root = tmp_path_factory.mktemp("titan_fault_free")
    with own_launcher(root) as launcher:
        proc, steps, results = run_titan(launcher, root / "out", assets)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert steps[0] == list(range(1, STEPS + 1)), steps
    assert results[0] == results[1] and results[0]["step"] == STEPS, results
    return results[0]


@pytest.fixture(scope="module")
def hsdp_fault_free(tmp_path_factory, assets):
    """The HSDP 2x2 run without a fault."""
    from harness import own_launcher

    root = tmp_path_factory.mktemp("titan_hsdp_fault_free")
    with own_launcher(root) as launcher:
        proc, steps, results = run_titan(launcher, root / "out", assets, hsdp=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(results[r] == results[0] for r in range(4)) and results[0]["step"] == STEPS, results
    return results[0]


def _commits_copy_no_model_or_optimizer(out, nproc):
    """Every rank's LiveState, after the heal (the call that ran to the end): its commits read the
    model's parameters and the optimizer's state in place (the adapter's `_ModelState`: before, the
    debugmodel's fused attention projection was gathered and copied at every commit, 4.7 MB per
    rank); a commit copies only small state (the RNG's 5 KB)."""
    for rank in range(nproc):
        stats = json.load(open(os.path.join(str(out), f"stats_rank{rank}.json")))["live"]
        assert stats["commit_bytes_by"]["model"] == 0 and stats["commit_bytes_by"]["optimizer"] == 0, stats
        assert stats["commit_bytes"] <= 16384 and stats["in_place_bytes"] >= 0.99 * _state_bytes(out, rank), stats


def _state_bytes(out, rank):
    return json.load(open(os.path.join(str(out), f"stats_rank{rank}.json")))["state_bytes"]


def _after_fault(steps):
    """The steps a rank trained after the fault (its step sequence from where it went back)."""
    i = steps.index(FAIL_STEP)
    return steps[i + 1:]


@needs_torchtitan
def test_a_killed_rank_resumes_from_torchtitans_checkpoint_exactly(launcher, tmp_path, assets, fault_free):
    proc, steps, results = run_titan(launcher, tmp_path / "out", assets, fault=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"rank {FAIL_RANK} on node 0 (127.0.0.1) was killed by SIGKILL" in proc.stderr, proc.stderr[-3000:]
    resumed = CKPT_EVERY + 1   # torchtitan's checkpoint of step 10
    for rank in (0, 1):
        assert steps[rank][:FAIL_STEP] == list(range(1, FAIL_STEP + 1)), steps
        assert _after_fault(steps[rank]) == list(range(resumed, STEPS + 1)), steps
    assert results[0] == results[1] == fault_free, (results, fault_free)


@needs_torchtitan
def test_a_killed_rank_heals_from_its_buddy_copy_exactly(launcher, tmp_path, assets, fault_free):
    proc, steps, results = run_titan(launcher, tmp_path / "out", assets, fault=True, live=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "live recovery: resumed at step 13 (0 completed step(s) redone" in proc.stderr, proc.stderr[-3000:]
    _commits_copy_no_model_or_optimizer(tmp_path / "out", 2)
    for rank in (0, 1):
        assert _after_fault(steps[rank]) == list(range(FAIL_STEP, STEPS + 1)), steps
    assert results[0] == results[1] == fault_free, (results, fault_free)


def test_the_adapter_imports_nothing_of_torchtitan_or_torch_until_installed():
    """`import ft_launcher` and the adapter's module stay cheap: torchtitan and torch are imported
    only by `install()`."""
    code = ("import sys; import ft_launcher, ft_launcher.integrations.torchtitan as t; "
            "print(sorted(m for m in ('torch', 'torchtitan') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": ROOT}).stdout
    assert out.strip() == "[]", out


@needs_torchtitan
def test_hsdp_a_killed_rank_heals_from_its_replica_exactly(launcher, tmp_path, assets, hsdp_fault_free):
    """HSDP 2x2 (replicate 2 x shard 2), live state without buddy copies or a checkpoint fallback,
    rank 3 SIGKILLed as step 14 starts: its model and optimizer shard comes from its replica (rank 1,
    the same FSDP shard in the other replica group), its dataloader position (its data-parallel
    rank's alone: the adapter's `per_rank`) from its own record in the node's host memory, never
    rank 1's. The job resumes at step 13, no completed step trained again, and ends with exactly
    the fault-free run's parameters and loss. (Before: the adapter's `shard=<dp rank>` made the
    whole state rank 3's alone, and the job fell back to torchtitan's checkpoint of step 10.)"""
    proc, steps, results = run_titan(launcher, tmp_path / "out", assets, fault=True, live=True, hsdp=True,
                                     buddy_every=0)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 3 on node 0 (127.0.0.1) was killed by SIGKILL" in proc.stderr, proc.stderr[-3000:]
    assert "no live state to resume from" not in proc.stderr, proc.stderr[-3000:]
    assert "live recovery: resumed at step 13 (0 completed step(s) redone" in proc.stderr, proc.stderr[-3000:]
    assert "rank 3 from peer rank 1" in proc.stderr, proc.stderr[-3000:]
    _commits_copy_no_model_or_optimizer(tmp_path / "out", 4)
    for rank in range(4):
        assert steps[rank][:FAIL_STEP] == list(range(1, FAIL_STEP + 1)), steps
        assert _after_fault(steps[rank]) == list(range(FAIL_STEP, STEPS + 1)), steps
    assert all(results[r] == hsdp_fault_free for r in range(4)), (results, hsdp_fault_free)


@needs_torchtitan
def test_a_transient_nan_in_torchtitans_step_is_never_committed_and_ends_exactly(launcher, tmp_path, assets,
                                                                                 fault_free):
    """The adapter's LiveState guards torchtitan's own step: `loss=` is what forward_backward_step
    returned, `grad_norm=` what torchtitan's clip_grad_norm_ returned. A NaN in rank 1's gradient at
    step 14, in its backward before FSDP's reduce-scatter, is caught before the optimizer step,
    never committed; the step is re-run from the live state of
    step 13 and the job ends with exactly the fault-free run's parameters and loss. (Before: the
    adapter passed neither, the NaN was committed, and torchtitan's "Loss is not finite" came
    after its optimizer step.)"""
    sdc = ["--ft-simulate-fault", "true", "--ft-simulated-fault-type", "rank_sdc", "--ft-simulated-fault-rank", "1",
           "--ft-simulated-sdc", "nan:14:once"]
    proc, steps, results = run_titan(launcher, tmp_path / "out", assets, live=True, ft_args=sdc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if "rank 0: step 14: " in ln]
    assert len(lines) == 2, lines or proc.stderr[-3000:]
    assert "gradient norm nan" in lines[0] and "not committed; re-running it from memory" in lines[0], lines
    assert "the re-run on the same devices is clean: a transient fault" in lines[1], lines
    assert "Loss is not finite" not in proc.stderr and "no live state to resume from" not in proc.stderr
    for rank in (0, 1):
        assert steps[rank].count(14) == 2 and steps[rank][-1] == STEPS, steps
    assert results[0] == results[1] == fault_free, (results, fault_free)


@needs_torchtitan
def test_a_nan_after_torchtitans_norm_is_committed_then_found_and_the_job_loads_its_checkpoint(launcher, tmp_path,
                                                                                              assets, fault_free):
    """Pure FSDP has no replica to compare with: a NaN lands in rank 1's gradient shard at step 14
    after torchtitan's clip_grad_norm_ (`reduced`: the guard's `grad_norm=` is finite), so step 14
    is committed with a NaN in rank 1's shard, and step 15 is NaN. At that hit the guard finds the
    committed state not finite on rank 1: no re-run from it, no move to other hardware; the live
    state is abandoned and torchtitan loads its checkpoint of step 10, with one line; the job ends
    with exactly the fault-free run's parameters and loss. (Before: a re-run, an exit 16, then "the
    data or the model", exit 93.)"""
    sdc = ["--ft-simulate-fault", "true", "--ft-simulated-fault-type", "rank_sdc", "--ft-simulated-fault-rank", "1",
           "--ft-simulated-sdc", "nan:14:once:reduced"]
    proc, steps, results = run_titan(launcher, tmp_path / "out", assets, live=True, ft_args=sdc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the data or the model" not in proc.stderr, proc.stderr[-3000:]
    found = [ln for ln in proc.stderr.splitlines() if "the state committed at step 14 is not finite on rank 1" in ln]
    assert found and "every rank loads its checkpoint" in found[0], proc.stderr[-3000:]
    assert "exited 16" not in proc.stderr, proc.stderr[-3000:]   # found at the first hit: no move to other hardware
    for rank in (0, 1):   # 11-14 trained again from the checkpoint, once: the `once` fault fires once per job
        assert steps[rank][-1] == STEPS and steps[rank].count(CKPT_EVERY + 1) == 2, steps
    assert results[0] == results[1] == fault_free, (results, fault_free)


ELASTIC_STEPS, ELASTIC_KILL = 40, 8


@needs_torchtitan
def test_hsdp_elastic_a_lost_replica_group_goes_on_and_grows_back(launcher, tmp_path, assets):
    """torchtitan's trainer, HSDP 2 x 2 over 2 agents x 2 ranks, `--elastic --nnodes 1:2`, live
    state without buddy copies: node 1 (replica group 1, ranks 2, 3, and its agent) SIGKILLed as
    rank 2 reaches step 8. Ranks 0, 1 go on at once in place on one replica group (the adapter keeps
    dp_shard 2 and makes dp_replicate 1; their loaders keep their parts of the 4-way split): no
    completed step redone. Node 1's agent started again: the job grows back to 2 x 2, ranks 0, 1
    kept, ranks 2, 3 heal model and optimizer from ranks 0, 1 (their loaders start their parts as
    built: no record of theirs survived, said in one line), the replicas' digests agree, no step
    redone, and the job ends with all four ranks' models bit-equal (the two replicas agree) and
    equal, parameters and loss, to the same course run fault-free in three pieces chained by
    torchtitan's checkpoints (_elastic_reference: 2 x 2 to the shrink's step, 1 x 2 to the grow's,
    2 x 2 to the end with groups 1's loaders as built)."""
    from harness import ExampleAgents

    from ft_launcher.agent.observation.live_recovery import per_rank

    out = tmp_path / "out"
    out.mkdir()
    env = {"TITAN_ASSETS": assets, "TITAN_OUT": str(out), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(out / "hf_cache"), "TITAN_LIVE": "1", "TITAN_BUDDY_EVERY": "0"}
    agents = ExampleAgents(launcher, tmp_path, 2, 2, os.path.join(HERE, "cpu_train.py"),
                           ["--module", "titan_cpu_config", "--config", "cpu_debugmodel",
                            "--dump_folder", out / "dump", "--training.steps", ELASTIC_STEPS,
                            "--checkpoint.interval", CKPT_EVERY] + HSDP,
                           ["--elastic", "--ft-rank-section-timeouts", "setup:300,step:120,checkpointing:300"],
                           max_restarts=3)
    agents.args[agents.args.index("--nnodes") + 1] = "1:2"
    agents.args[agents.args.index("--rdzv-conf") + 1] = "join_timeout=60,last_call_timeout=30"
    i = agents.args.index("--ft-warm-reserves")   # warm reserves on, the default (cpu_train.py works warm)
    del agents.args[i:i + 2]
    start = launcher.start

    def start_with_env(args, extra_env=None, **kw):
        return start(args, extra_env={**env, **(extra_env or {})}, **kw)
    launcher.start = start_with_env
    agents.launch()

    def rows(rank):
        path = out / f"steps_rank{rank}.jsonl"
        return [json.loads(line) for line in open(path)] if path.exists() else []

    from conftest import node_tree, wait_for

    wait_for(lambda: any(r["step"] >= ELASTIC_KILL for r in rows(2)), 600, f"rank 2 at step {ELASTIC_KILL}",
             interval=0.05)
    for proc in node_tree(agents.agents[1].pid):
        proc.kill()
    killed = time.time()
    wait_for(lambda: [e for e in agents.events() if e["kind"] == "live_recovery"], 300, "the shrink's live recovery")
    shrink = [e for e in agents.events() if e["kind"] == "live_recovery"][0]["detail"]
    resume = shrink["resume_step"] or 0
    wait_for(lambda: any(r["step"] >= resume + 4 and r["t"] > killed for r in rows(0)), 300,
             "rank 0 four steps on one replica group")
    agents.agents.append(launcher.start(agents.args, extra_env={"GROUP_RANK": "1"}))   # node 1 comes back
    results = agents.wait(bound=700, lost=(1,))
    err = "".join(r[2] for r in results)
    evs = agents.events()
    live = [e["detail"] for e in evs if e["kind"] == "live_recovery"]
    assert len(live) == 2, (live, err[-4000:])
    assert "no live state to resume from" not in err, err[-4000:]
    shrink, grow = live
    assert per_rank(shrink["sources"]) == {"0": "kept", "1": "kept"} and shrink["steps_redone"] == 0, shrink
    assert "torchtitan on 2 ranks: 1 replica group(s) of 2" in err, err[-4000:]
    sources = per_rank(grow["sources"])
    assert sources["0"] == sources["1"] == "kept" and {sources["2"], sources["3"]} == {"peer 0", "peer 1"}, grow
    assert grow["resume_step"] is not None and grow["steps_redone"] == 0 and grow["check"]["bytes"] > 0, grow
    assert len([ln for ln in err.splitlines() if "starts as built (per_rank_fresh)" in ln]) == 2, err[-4000:]
    interrupted = {shrink["resume_step"] + 1, grow["resume_step"] + 1}   # started, cut by the restart, run again
    for rank in (0, 1):   # kept: one process, every completed step once, none redone
        steps = [r["step"] for r in rows(rank)]
        assert steps == sorted(steps) and sorted(set(steps)) == list(range(1, ELASTIC_STEPS + 1)), steps
        assert all(steps.count(k) == 1 or k in interrupted for k in set(steps)), steps
        assert len({r["pid"] for r in rows(rank)}) == 1, rows(rank)
    for rank in (2, 3):   # the newcomers trained on from the resume step to the end
        new = [r["step"] for r in rows(rank) if r["t"] > killed]
        assert new == list(range(grow["resume_step"] + 1, ELASTIC_STEPS + 1)), (rank, new)
    finals = [json.load(open(out / f"result_rank{r}.json")) for r in range(4)]
    assert all(f["step"] == ELASTIC_STEPS for f in finals), finals
    assert len({f["checksum"] for f in finals}) == 1, finals   # replica 0 == replica 1, bit for bit
    first_after = min(r["t"] for r in rows(0) if r["t"] > killed)
    asked = [e["time"] for e in evs if e["kind"] == "elastic_join"]
    assert len(asked) == 1, asked
    back = max(min(r["t"] for r in rows(k) if r["step"] > grow["resume_step"] and r["t"] > asked[0])
               for k in range(4)) - asked[0]
    print(f"\nnode lost -> rank 0's next step starts: {first_after - killed:.2f} s; asked to grow -> every rank's "
          f"first step on 2 x 2 starts: {back:.2f} s\nshrink: {shrink}\ngrow: {grow}")
    reference = _elastic_reference(launcher, tmp_path / "reference", assets, shrink["resume_step"], grow["resume_step"])
    assert finals[0] == reference, (finals[0], reference)


def _elastic_reference(launcher, root, assets, shrunk_at, grown_at):
    """The elastic run's model as three fault-free runs chained by torchtitan's checkpoints (interval
    1): 2 x 2 to step `shrunk_at`; 1 x 2 (the adapter keeps dp_shard 2 and the 4-way split; ranks 0,
    1 load data-parallel ranks 0, 1's positions) to `grown_at`; 2 x 2 to the end, ranks 2, 3's
    loader positions absent from that checkpoint (saved on 2 ranks), so as built (DCP's partial
    load). -> rank 0's result (step, loss, parameters' digest)."""
    dump = root / "dump"
    args = [os.path.join(HERE, "cpu_train.py"), "--module", "titan_cpu_config", "--config", "cpu_debugmodel",
            "--dump_folder", dump, "--training.steps", ELASTIC_STEPS, "--checkpoint.interval", 1,
            "--checkpoint.keep_latest_k", 2] + HSDP
    for piece, (nproc, stop) in enumerate([(4, shrunk_at), (2, grown_at), (4, 0)]):
        out = root / f"piece{piece}"
        out.mkdir(parents=True)
        env = {"TITAN_OUT": str(out), "TITAN_LIVE": "0", "TITAN_STOP_AFTER": str(stop), "TITAN_PARTIAL_LOAD": "1"}
        proc = launcher.run(["--standalone", "--nproc-per-node", nproc, "--log-dir", out / "logs"] + args,
                            timeout=420, extra_env=env)
        assert proc.returncode == 0, (piece, proc.stderr[-3000:])
    return json.load(open(out / "result_rank0.json"))
