"""Live state, two claims of docs/live-state.md end to end (real agents, monitors, ranks, rendezvous):

- `ft.LiveState(..., rng=True)` keeps the RNG state (torch's CPU generator, Python's `random`) as
  of each commit and heals it: examples/ddp_train.py --live-rng --noise draws input noise from
  torch's global generator and a loss weight from random.random() every step; 1 agent x 2 ranks,
  rank 0 killed at step 17 (or, slow, rank 1 raising at the end of step 17): the job ends with
  exactly the model of a fault-free run, and the replaced (or suspect) rank starts its first step
  after the restart with the RNG state the fault-free run had there (the digests the example logs
  per step), which only its peer held. Without rng=True (plain --live) the checksum differs: a
  restarted training function reseeds its generators.
- HSDP (examples/hsdp_train.py, torch's fully_shard on gloo, 2 replicas x 2 shards): rank 0 killed
  inside the FSDP forward pass of step 17 (a forward pre-hook on the second layer, after FSDP's
  all-gather for it), its peers inside that step's collectives: the job recovers live, rank 0
  heals from its shard in the other replica, and the job ends exactly as a fault-free run (slow).
- CUDA: the generator of the rank's current device only is kept, compared and loaded (a fake of
  two visible devices, torch.cuda's functions monkeypatched: no GPU needed).
"""
import os

import pytest
import torch

from conftest import ROOT, read_events
from harness import Job, started
from ft_launcher.agent.observation.live_recovery import per_rank

RNG_JOB = ["--live-rng", "--noise", 0.1, "--steps", 30, "--ckpt-every", 10, "--step-time", 0, "--seed", 11]
FAULT_STEP = 17


def rng_digests(prog, rank):
    """{cycle: {step: digest}} of the RNG state rank `rank` started each step with."""
    out = {}
    with open(os.path.join(prog, f"rng_rank_{rank}.txt")) as fh:
        for line in fh:
            cycle, step, digest = line.split()
            out.setdefault(int(cycle), {})[int(step)] = digest
    return out


def run(job):
    results, elapsed = job.wait()
    assert all(code == 0 for code, _, _ in results), "\n".join(r[2][-3000:] for r in results)
    return "".join(r[1] for r in results), elapsed


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["killed", pytest.param("raised", marks=pytest.mark.slow)])
def test_rng_state_is_kept_and_a_replaced_rank_receives_it_from_its_peer(launcher, tmp_path, fault):
    """killed: rank 0 dies at the start of step 17 (every rank held 0.5 s after step 16's
    commit); the job resumes at 16, rank 0 is a new process and receives model, optimizer and RNG state from rank 1. raised: rank 1 raises at the end of
    step 17 (after its commit; every rank holds 0.5 s there first, as in test_live_state); its
    state is suspect, the job resumes at 17 and rank 1 receives it from rank 0."""
    if fault == "killed":
        # every rank holds 0.5 s after its commit of step 16: rank 1 has committed it when rank 0
        # dies (on a busy machine it was once still before that commit: the job then rightly
        # resumed at 15, exact all the same, and this test's resume step raced)
        fault_rank, resume = 0, FAULT_STEP - 1
        args = ["--fail-at-step", FAULT_STEP, "--fail-rank", 0, "--hold", "step:0.5", "--hold-step", FAULT_STEP - 1]
    else:
        fault_rank, resume = 1, FAULT_STEP
        args = ["--raise-in", "step", "--hold", "step:0.5", "--hold-step", FAULT_STEP, "--fail-rank", 1]
    (tmp_path / "ref").mkdir()
    ref = Job(launcher, tmp_path / "ref", "1x2", job_args=RNG_JOB).launch()
    run(ref)
    (tmp_path / "fault").mkdir()
    job = Job(launcher, tmp_path / "fault", "1x2", job_args=RNG_JOB + args).launch()
    out, elapsed = run(job)

    assert job.final()["checksum"] == ref.final()["checksum"], "the RNG state was not kept: the model differs"
    assert job.final()["cycle"] == 1
    told = [e["detail"] for e in job.events() if e["kind"] == "live_recovery"]
    assert len(told) == 1 and told[0]["resume_step"] == resume and told[0]["steps_redone"] == 0, told
    peer = 1 - fault_rank
    assert per_rank(told[0]["sources"]) == {str(fault_rank): f"peer {peer}", str(peer): "kept"}, told
    assert f"resumed from live state at step {resume} (cycle 1)" in out, out[-3000:]
    before, after = started(job.events(), 0), started(job.events(), 1)
    assert after[peer] == (before[peer][0], True), (before, after)      # the peer kept its process
    if fault == "killed":
        assert after[fault_rank][0] != before[fault_rank][0], (before, after)   # a new process

    # The RNG state each step starts with: every rank draws the same stream in the fault-free run.
    ref_rng = [rng_digests(str(ref.prog), r)[0] for r in (0, 1)]
    assert ref_rng[0] == ref_rng[1] and sorted(ref_rng[0]) == list(range(1, 31))
    assert len(set(ref_rng[0].values())) == 30   # it moves every step: a reseeded rank would not match
    for rank in (0, 1):
        cycles = rng_digests(str(job.prog), rank)
        resumed = cycles[1]
        assert sorted(resumed) == list(range(resume + 1, 31)), (rank, sorted(resumed))
        # the first step after the restart already starts from the fault-free run's state there:
        # for the replaced or suspect rank, the state its peer sent
        assert resumed == {s: ref_rng[0][s] for s in resumed}, f"rank {rank}'s RNG state differs after the restart"
        assert all(cycles[0][s] == ref_rng[0][s] for s in cycles[0])
    print(f"\n{told[0]}\n{elapsed:.1f}s")


@pytest.mark.slow
def test_hsdp_a_rank_killed_inside_the_fsdp_forward_heals_from_the_other_replica(launcher, tmp_path):
    """examples/hsdp_train.py on 1 agent x 4 ranks (mesh replicate 2 x shard 2: ranks 0 and 2 hold
    shard 0): rank 0 exits inside step 17's forward pass, after FSDP's all-gather of the second
    layer; its peers are in that step's all-gathers, reduce-scatters and all-reduces. The healthy
    ranks restart in place at step 16, rank 0 receives shard 0 from rank 2, and the full parameters
    at the end equal a fault-free run's."""
    def go(name, extra):
        proc = launcher.start(["--standalone", "--nproc-per-node", 4, "--max-restarts", 1, "--log-dir",
                               tmp_path / name, os.path.join(ROOT, "examples", "hsdp_train.py"), "--steps", 30] + extra)
        out, err = proc.communicate(timeout=200)
        assert proc.returncode == 0, err[-3000:]
        return out, [ln.split("] ", 1)[1] for ln in out.splitlines() if "FINAL" in ln], read_events(str(tmp_path / name))

    _, clean, _ = go("clean", [])
    out, fault, evs = go("fault", ["--fail-at-step", FAULT_STEP, "--fail-rank", 0, "--fail-in", "forward"])
    assert f"rank 0: failing on purpose inside the forward pass of step {FAULT_STEP}" in out, out[-3000:]
    assert clean == fault and len(clean) == 1, (clean, fault)
    told = [e["detail"] for e in evs if e["kind"] == "live_recovery"]
    assert len(told) == 1 and told[0]["resume_step"] == FAULT_STEP - 1 and told[0]["steps_redone"] == 0, told
    assert per_rank(told[0]["sources"]) == {"0": "peer 2", "1": "kept", "2": "kept", "3": "kept"}, told
    before, after = started(evs, 0), started(evs, 1)
    assert all(after[r] == (before[r][0], True) for r in (1, 2, 3)), (before, after)
    assert after[0][0] != before[0][0], (before, after)


@pytest.mark.slow
def test_three_replicas_of_a_script_that_seeds_torch_only_heal_exactly(launcher, tmp_path):
    """examples/ddp_train.py --live-rng without --noise seeds torch only and never touches Python's
    `random`: each rank's stream is its own, from os.urandom, and nothing draws from it. 1 agent x
    3 ranks, rank 0 killed at step 17: rank 0 heals from a peer, and the three replicas' differing,
    unused Python streams neither make the job fall back to its checkpoint nor reach the healed
    rank; the job ends with exactly the model of a fault-free run."""
    job_args = ["--live-rng", "--steps", 30, "--ckpt-every", 10, "--step-time", 0, "--seed", 11]
    (tmp_path / "ref").mkdir()
    ref = Job(launcher, tmp_path / "ref", "1x3", job_args=job_args).launch()
    run(ref)
    (tmp_path / "fault").mkdir()
    job = Job(launcher, tmp_path / "fault", "1x3", job_args=job_args + [
        "--fail-at-step", FAULT_STEP, "--fail-rank", 0, "--hold", "step:0.5", "--hold-step", FAULT_STEP - 1]).launch()
    out, _ = run(job)
    told = [e["detail"] for e in job.events() if e["kind"] == "live_recovery"]
    assert len(told) == 1 and told[0]["resume_step"] == FAULT_STEP - 1 and told[0]["steps_redone"] == 0, (told, out[-3000:])
    assert per_rank(told[0]["sources"])["0"].startswith("peer "), told
    assert "differ in '_rng'" not in out, out[-3000:]
    assert job.final()["checksum"] == ref.final()["checksum"] and job.final()["cycle"] == 1


class _TwoGpus:
    """A process that sees two CUDA devices (CUDA_VISIBLE_DEVICES left whole) and draws on `current`:
    each device's generator state, as torch.cuda's functions read and set them."""

    def __init__(self, current, states):
        self.current, self.states = current, dict(states)

    def install(self, monkeypatch):
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(cuda, "device_count", lambda: 2)
        monkeypatch.setattr(cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(cuda, "get_rng_state", lambda device="cuda": self.states[self._index(device)].clone())
        monkeypatch.setattr(cuda, "set_rng_state", lambda state, device="cuda": self.states.__setitem__(
            self._index(device), state.clone()))

        def every_device(*args):
            raise AssertionError("the generators of every visible device were read or set")
        monkeypatch.setattr(cuda, "get_rng_state_all", every_device)
        monkeypatch.setattr(cuda, "set_rng_state_all", every_device)

    def _index(self, device):
        if isinstance(device, int):
            return device
        device = torch.device(device)
        return self.current if device.index is None else device.index


def test_cuda_rng_is_the_current_devices_only_so_replicas_on_different_gpus_agree(monkeypatch):
    """Two replicas on one node, rank 0 on cuda:0 and rank 1 on cuda:1, seeded alike: each drew the
    same stream on its own device, and each sees the other device's generator as it was seeded. The
    kept state is the current device's generator alone, so the replicas' states (and their digests,
    as the check after a heal compares them) agree; a rank that heals from rank 1's state on cuda:0
    loads it into its current device, the other device's generator untouched."""
    from ft_launcher.rank_monitor.rank_side.live import live_rng
    from ft_launcher.rank_monitor.rank_side.live import live_wire as W

    seeded, drawn = torch.arange(16, dtype=torch.uint8), torch.arange(16, 32, dtype=torch.uint8)
    states = []
    for rank in (0, 1):
        gpus = _TwoGpus(rank, {rank: drawn, 1 - rank: seeded})
        gpus.install(monkeypatch)
        states.append(live_rng.Rng().state_dict())
    assert all(torch.equal(s["cuda"], drawn) for s in states), states
    assert W.digest(live_rng.Rng.unused(states[0])) == W.digest(live_rng.Rng.unused(states[1]))

    healed = _TwoGpus(0, {0: seeded, 1: seeded})   # a replaced rank on cuda:0
    healed.install(monkeypatch)
    live_rng.Rng().load_state_dict(states[1])
    assert torch.equal(healed.states[0], drawn) and torch.equal(healed.states[1], seeded), healed.states
