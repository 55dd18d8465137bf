"""The step guard before commit (issue 40, rank_monitor/rank_side/live/step_guard.py): a step whose
loss or gradient is not finite is not committed and is re-run from memory; a re-run tells a
transient fault from the data; a spike is said once. Whole jobs run examples/live_train.py
(`--guard`: `live.commit(step, loss=loss)`; DDP on gloo, torchdata's StatefulDataLoader, a
checkpoint every 50 steps) on 2 agents x 2 ranks, with real agents, monitors and rendezvous:

1. A transient NaN in rank 1's gradient at step 137 (the simulated fault `rank_sdc`, no change to the
   script): the step is not committed, it is re-run in the same processes, no process is replaced,
   the final model is bit-equal to the fault-free run's, and every step is done once.
3. A poisoned sample at step 137 in rank 1's batch (NaN on any hardware): the re-run hits again,
   rank 1 moves (exit 16) and hits again: the job stops with one line naming the step, the rank
   and the loader position (exit 93); with `--skip-bad-batches` it goes on and says which batch.
5. A loss spike (targets x1000 on one rank, in the skip run) is said once and training goes on.
2. A persistent corruption on node 1 from step 137 (rank_sdc with `node` persistence): the re-run
   hits again, rank 2 exits 16 (the agent swaps it with its sibling slot), hits again with its
   sibling on node 1: node 1 leaves (exit 17), a hot spare takes its place and heals live, and the
   final model is bit-equal to the fault-free run's; diagnosed on the third run of step 137.

The default suite runs only the first test: the guard's verdict over two real gloo ranks (threads
of this process, ProcessGroupGloo), the simulated fault's NaN and bit flip, and the loader's words.
"""
import datetime
import json
import math
import threading

import pytest
import torch
import torch.distributed as dist

from conftest import EXAMPLE as DDP_EXAMPLE, ROOT
from harness import JOB, ExampleAgents, Job, progress
from ft_launcher.rank_monitor.rank_side.live import sdc_sim as S, step_guard as G

LIVE = f"{ROOT}/examples/live_train.py"
STEPS, FAULT = 150, 137
BASE = ["--steps", STEPS, "--ckpt-every", 50, "--guard"]
SDC = ["--ft-simulate-fault", "true", "--ft-simulated-fault-type", "rank_sdc", "--ft-simulated-fault-rank", 1]


# ---- the default suite: the verdict on two gloo ranks ----------------------------------------------------
def _rows_on_two_ranks(values):
    """Each rank's row (LOSS, NORM from `values[r]`) exchanged by one all_reduce over a real 2-rank
    gloo group (one thread per rank); -> the table each rank read."""
    store, tables = dist.HashStore(), {}

    def rank(r):
        pg = dist.ProcessGroupGloo(dist.PrefixStore("guard", store), r, 2, datetime.timedelta(seconds=20))
        row = torch.zeros(G.COLS, dtype=torch.float64)
        row[G.LOSS], row[G.NORM], row[G.P_STEP], row[G.SEEN] = values[r][0], values[r][1], -1, 20
        row[G.LOSS_MAX], row[G.NORM_MAX] = 1.0, 1.0
        tables[r] = G.exchange(row, 2, r, all_reduce=lambda t: pg.allreduce([t]).wait())

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return tables


@pytest.mark.timeout(60)
def test_every_rank_reads_the_same_verdict_and_the_suspect_is_the_rank_whose_own_value_is_not_finite():
    cfg = G.GuardConfig()
    tables = _rows_on_two_ranks({0: (0.5, 1.0), 1: (0.5, float("nan"))})   # rank 1's gradient only
    assert repr(tables[0]) == repr(tables[1]) and math.isnan(tables[0][1][G.NORM])
    v = G.judge(tables[0], cfg)
    assert v["fatal"] == [1] and v["suspect"] == 1 and v["pending"] is None
    # a NaN before the all-reduce is on every rank's gradient: the suspect is the rank whose loss is NaN
    v = G.judge(_rows_on_two_ranks({0: (0.5, float("nan")), 1: (float("nan"), float("nan"))})[0], cfg)
    assert v["fatal"] == [0, 1] and v["local"] == [1] and v["suspect"] == 1
    v = G.judge(_rows_on_two_ranks({0: (0.5, float("inf")), 1: (0.5, float("inf"))})[1], cfg)
    assert v["suspect"] == -1   # every rank alike: no rank to move
    v = G.judge(_rows_on_two_ranks({0: (0.5, 1.0), 1: (50.0, 1.0)})[0], cfg)   # 50 > 10 x the maximum 1.0
    assert v["fatal"] == [] and [r for r, _ in v["spikes"]] == [1] and "loss 50" in v["spikes"][0][1]
    assert G.judge(tables[0], G.GuardConfig(spike_fatal=True))["fatal"] == [1]


def test_the_simulated_fault_puts_a_nan_an_inf_or_a_flipped_bit_where_its_place_says(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    g = torch.full((3,), 0.25)
    monkeypatch.setenv(S.ENV_SDC, "bitflip:7:device:1")   # four parts: the backward place
    spec = S.spec()
    assert spec.place == "backward" and not spec.due(6, "backward") and not spec.due(7, "reduced")
    assert spec.due(7, "backward") and spec.due(8, "backward")   # device: every step from then on
    S.corrupt(g, "bitflip")
    assert g[0].item() == 2.0 ** 126 and g[1].item() == 0.25   # 2**-2 -> 2**126
    for kind, value in (("expflip", 0.125), ("mantflip", 0.375), ("inf", float("inf"))):   # 0.25 = 1.0 x 2**-2
        g = torch.full((2,), 0.25)
        S.corrupt(g, kind)
        assert g.tolist() == [value, 0.25], kind
    monkeypatch.setenv(S.ENV_SDC, "nan:7:once:*:memory")
    spec = S.spec()
    assert spec.due(7, "memory") and not spec.due(7, "memory")   # once
    g = torch.zeros(2, dtype=torch.float64)
    S.corrupt(g, "nan")
    assert math.isnan(g[0].item()) and g[1].item() == 0.0
    monkeypatch.setenv(S.ENV_SDC, "nan:7:device:0:reduced")
    assert not S.spec().due(7, "reduced")   # another slot's device
    assert S.parse("nan:x:once:1") is None and S.parse("rot:1:once:1") is None
    assert S.parse("nan:1:once:1:elsewhere") is None
    words = G.describe_position({"loader": {"_num_yielded": 36, "_sampler_iter_state": {"samples_yielded": 576,
                                                                                         "epoch": 0}}})
    assert words.startswith("num_yielded=36") and "samples_yielded=576" in words and "epoch=0" in words


def test_a_once_fault_fires_once_per_job_not_again_in_the_processes_an_exit_16_starts(monkeypatch, tmp_path):
    """`once`: the first process that fires it marks its agent's directory; a later process on the
    same node (after an exit 16 or a fallback: a new Spec, as a new process parses) does not fire it."""
    from ft_launcher.rank_monitor import buddy_store

    monkeypatch.setenv(buddy_store.ENV_PREFIX, str(tmp_path / "local1"))
    first, later = S.parse("nan:7:once:*:reduced"), S.parse("nan:7:once:*:reduced")
    assert first.due(7, "reduced") and not later.due(7, "reduced")
    assert (tmp_path / S.ONCE_MARK).exists()
    assert S.parse("nan:7:device:*:reduced").due(7, "reduced")   # device and node persist: every process

# ---- whole jobs (slow) -------------------------------------------------------------------------------------
class GuardJob(Job):
    """2 agents x 2 ranks running examples/live_train.py."""

    def __init__(self, launcher, root, ft_args=(), job_args=(), max_restarts=2):
        root.mkdir(parents=True, exist_ok=True)
        super().__init__(launcher, root, "2x2", ft_args, BASE + list(job_args), max_restarts=max_restarts)
        i = self.args.index(DDP_EXAMPLE)
        self.args[i:i + len(JOB)] = [LIVE]

    def ended(self):
        results, _ = self.wait(240)
        return [r[0] for r in results], "".join(r[2] for r in results)

    def finals(self):
        return [json.loads((self.ckpt / f"final_rank_{r}.json").read_text()) for r in range(self.world)]

    def guard_lines(self):
        return [e["detail"]["decision"] for e in self.events() if e["kind"] == "step_guard"]


_FAULT_FREE = {}


def fault_free(launcher, root):
    """The fault-free run's final models (per rank), once per module."""
    if not _FAULT_FREE:
        job = GuardJob(launcher, root / "fault_free")
        job.launch()
        codes, err = job.ended()
        assert codes == [0, 0], err[-3000:]
        assert job.guard_lines() == [], job.guard_lines()
        _FAULT_FREE["finals"] = job.finals()
    return _FAULT_FREE["finals"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_transient_nan_in_rank_1s_gradient_is_re_run_in_place_and_ends_bit_equal(launcher, tmp_path):
    ref = fault_free(launcher, tmp_path)
    # (watch_every_step: the first transient is named; the default names it from the re-run on)
    job = GuardJob(launcher, tmp_path / "sdc", SDC + ["--ft-simulated-sdc", f"nan:{FAULT}:once"],
                   ["--watch-every-step"])
    job.launch()
    codes, err = job.ended()
    assert codes == [0, 0], err[-3000:]
    finals = job.finals()
    assert [f["checksum"] for f in finals] == [f["checksum"] for f in ref], (finals, ref)
    assert [f["loss"] for f in finals] == [f["loss"] for f in ref]
    assert all(f["cycle"] == 0 for f in finals)   # no restart: no process replaced
    lines = job.guard_lines()
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"step {FAULT}: gradient norm nan on rank 1 (made in rank 1's own backward, before "
                               f"the all-reduce): not committed; re-running"), lines
    assert "a transient fault on rank 1" in lines[1] and "node 0 device 1" in lines[1], lines
    kinds = [e["kind"] for e in job.events()]
    assert "live_recovery" not in kinds and kinds.count("ranks_started") == 2, kinds
    for rank in range(job.world):   # every step once, the re-run step included (progress is written after commit)
        assert [s for _, s, _ in progress(job.prog, rank)] == list(range(1, STEPS + 1)), rank


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_poisoned_sample_stops_the_job_with_one_line_naming_step_rank_and_loader_position(launcher, tmp_path):
    job = GuardJob(launcher, tmp_path, job_args=["--poison-step", FAULT, "--poison-rank", 1])
    job.launch()
    codes, err = job.ended()
    assert codes == [93, 93], err[-3000:]
    stop = [line for line in err.splitlines() if "sent ShutdownWorkload" in line and line.startswith("ft_launcher: error")]
    assert stop, err[-3000:]
    assert (f"step {FAULT}: " in stop[0] and "on rank 1, reproducible on other hardware" in stop[0]
            and "the data or the model" in stop[0] and "loader position" in stop[0] and "yielded=" in stop[0]), stop
    lines = job.guard_lines()
    assert "moves to other hardware (exit 16)" in lines[1], lines


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_with_skip_bad_batches_the_poisoned_batch_is_skipped_and_a_spike_is_said_once(launcher, tmp_path):
    job = GuardJob(launcher, tmp_path, job_args=["--poison-step", FAULT, "--poison-rank", 1, "--skip-bad-batches",
                                                  "--spike-step", 100])
    job.launch()
    codes, err = job.ended()
    assert codes == [0, 0], err[-3000:]
    lines = job.guard_lines()
    spikes = [line for line in lines if "spike" in line]
    assert len(spikes) == 1 and spikes[0].startswith("step 100: spike on ") and "rank 1: loss " in spikes[0], spikes
    assert spikes[0].endswith("not fatal, training goes on"), spikes
    skipped = [line for line in lines if "skipping that batch" in line]
    assert len(skipped) == 1 and f"step {FAULT}:" in skipped[0] and "rank 1's batch at loader position" in skipped[0]
    finals = job.finals()
    assert all(math.isfinite(f["checksum"]) for f in finals) and len({f["checksum"] for f in finals}) == 1


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_persistent_corruption_on_node_1_is_diagnosed_in_3_runs_of_the_step_and_a_spare_heals_live(
        launcher, tmp_path):
    ref = fault_free(launcher, tmp_path)
    root = tmp_path / "node"
    agents = ExampleAgents(launcher, root, 2, 2, LIVE, [*BASE, "--ckpt-dir", root / "ckpt", "--progress-dir",
                                                        root / "progress"],
                           ft_args=SDC[:-1] + [2, "--ft-simulated-sdc", f"nan:{FAULT}:node"], spares=1, max_restarts=3)
    agents.launch()
    agents.add_spares()
    results = agents.wait(bound=400, lost=(1,))
    assert results[1][0] == 93, results[1][2][-3000:]   # node 1 left the job
    finals = [json.loads((root / "ckpt" / f"final_rank_{r}.json").read_text()) for r in range(4)]
    assert [f["checksum"] for f in finals] == [f["checksum"] for f in ref], (finals, ref)
    assert [f["loss"] for f in finals] == [f["loss"] for f in ref]
    events = agents.events()
    lines = [e["detail"]["decision"] for e in events if e["kind"] == "step_guard"]
    assert len(lines) == 3 and all(line.startswith(f"step {FAULT}: ") for line in lines), lines
    assert "not committed" in lines[0] and "moves to other hardware (exit 16)" in lines[1], lines
    assert "a persistent hardware fault on node 1" in lines[2], lines
    live = [e["detail"] for e in events if e["kind"] == "live_recovery"]
    assert live and all(d["resume_step"] == FAULT - 1 for d in live), live
    for rank in (0, 1):   # the ranks of node 0 are kept: every step once
        assert [s for _, s, _ in progress(root / "progress", rank)] == list(range(1, STEPS + 1)), rank
