"""bench/live_recovery.py: its flags, and one tiny case end to end (needs no TorchFT)."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from harness import bench_module

live_recovery = bench_module("live_recovery")


def test_flags():
    args = live_recovery.parse_args(["--dry-run"])
    assert (args.reps, args.kill_at, args.steps, args.ckpt_every, args.only) == (1, 8, 12, 5, ["ckpt"])
    args = live_recovery.parse_args(["--only", "ckpt,torchrun", "--kill-at", "37", "--reps", "2"])
    assert (args.only, args.steps, args.reps) == (["ckpt", "torchrun"], 67, 2)
    assert "--kill-at-step" in live_recovery.script_args(args, kill=True)
    assert "--live" in live_recovery.script_args(args, kill=False, live=True)


@pytest.mark.parametrize("argv, says", [
    (["--only", "ckpt,nope"], "unknown contender(s) nope"),
    (["--only", "ckpt", "--kill-at", "50", "--steps", "40"], "--kill-at must be between"),
    (["--only", "ckpt", "--reps", "0"], "--reps must be at least 1"),
])
def test_bad_flags_say_why(argv, says, capsys):
    with pytest.raises(SystemExit) as exc:
        live_recovery.parse_args(argv)
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


def test_torchft_absent_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(live_recovery, "torchft_available", lambda: False)
    with pytest.raises(SystemExit):
        live_recovery.parse_args(["--only", "torchft"])
    assert "torchft is not installed" in capsys.readouterr().err
    args = live_recovery.parse_args(["--only", "ckpt"])
    assert args.only == ["ckpt"]


@pytest.mark.slow
def test_dry_run(launcher, tmp_path):
    """One tiny ft_launcher case: rank 1 killed at step 8, checkpoint at 5: 3 steps redone (6..8),
    every rank stepping again, the state from disk; nothing left behind (the fixture checks)."""
    env = launcher.env({"TMPDIR": str(tmp_path)})
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "live_recovery.py"), "--dry-run"],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stdout + out.stderr
    row = [line for line in out.stdout.splitlines() if line.startswith("| ft_launcher ckpt restore |")]
    assert row, out.stdout
    cells = [c.strip() for c in row[0].strip("|").split("|")]
    assert cells[3] == "3" and cells[5] == "disk" and cells[-1] == "1/1", row[0]
    assert float(cells[1]) > 0
    assert not [n for n in os.listdir(tmp_path) if n.startswith("ftbench_")], "scratch dirs left behind"


@pytest.mark.slow
def test_live_overhead_dry_run(launcher, tmp_path):
    """bench/live_overhead.py --dry-run: 4 real 2-rank jobs (DDP and a DCP AppState over fully_shard,
    each with and without a LiveState). With it, a commit copies only the RNG state (torch's CPU
    generator: 5,056 bytes; no buffers, no tensor hyperparameters) and reads every byte of each
    rank's parameters and AdamW state in place; nothing is left behind."""
    import json

    env = launcher.env({"TMPDIR": str(tmp_path)})
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "live_overhead.py"), "--dry-run", "--json",
                          str(tmp_path / "o.json")], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads((tmp_path / "o.json").read_text())
    assert [(r["form"], r["live"]) for r in rows] == [("ddp", False), ("ddp", True), ("app", False), ("app", True)]
    for row in rows:
        assert len(row["ranks"]) == 2 and all(r["peak_rss_kb"] > 0 for r in row["ranks"]), row
        if row["live"]:
            assert all(r["commit_bytes"] == 5056 and r["in_place_bytes"] == r["state_bytes"] > 0
                       for r in row["ranks"]), row
    assert "peak RSS MiB" in out.stdout, out.stdout
    assert not [n for n in os.listdir(tmp_path) if n.startswith("ftbench_")], "scratch dirs left behind"
