"""Seeing what happened and what is happening: `ft_launcher report` on a real job with a kill and a
hang, `ft_launcher status` and the Prometheus endpoint read during a running 2x2 job, the report
rendered by a real headless browser. Real launchers, real ranks, real faults."""
import html.parser
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
import uuid

import pytest

from conftest import EXAMPLE, LAUNCHER, ROOT, SCRIPTS, Launcher, free_port, read_events, wait_for, wait_until_gone

STEP_TIME = 0.03


def run_cli(args, cwd, env_extra=None, timeout=60):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(env_extra or {})
    return subprocess.run(LAUNCHER + [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


class _Tables(html.parser.HTMLParser):
    """The report's tables by id: rows of cell texts, each row with its class."""

    def __init__(self):
        super().__init__()
        self.tables, self.ids, self._table, self._row, self._cell = {}, {}, None, None, None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table":
            self._table = self.tables.setdefault(attrs.get("id"), [])
        elif tag == "tr" and self._table is not None:
            self._row = {"class": attrs.get("class"), "cells": []}
            self._table.append(self._row)
        elif tag in ("td", "th") and self._row is not None:
            self._cell = ""
        if attrs.get("id"):
            self.ids[attrs["id"]] = attrs

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data
        self._last = data

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._row["cells"].append(self._cell.strip())
            self._cell = None
        elif tag == "table":
            self._table = None


def first_progress(progress_dir, cycle):
    """{rank: time its first step of `cycle` ended}, from the ranks' own progress files."""
    out = {}
    for name in os.listdir(progress_dir) if os.path.isdir(progress_dir) else []:
        rank = int(name.split("_")[1].split(".")[0])
        with open(os.path.join(progress_dir, name)) as fh:
            times = [float(t) for c, _, t in (l.split() for l in fh if l.strip()) if int(c) == cycle]
        if times:
            out[rank] = min(times)
    return out


@pytest.fixture(scope="module")
def kill_and_hang_job(tmp_path_factory):
    """1 agent x 2 ranks. Cycle 0: a simulated rank_killed hits rank 1 one second after it starts
    (wherever it is: a kill needs no section). Cycle 1: once every rank steps, the test SIGSTOPs
    rank 1, a real hang that only the 2 s step timeout can find (rank 1 stopped in `step`, or rank 0
    waiting for it there). Cycle 2 finishes; the job ends 0."""
    tmp = tmp_path_factory.mktemp("kill_and_hang")
    helper = Launcher(uuid.uuid4().hex, tmp)
    logs = tmp / "logs"
    try:
        proc = helper.start(["--standalone", "--nproc-per-node", "2", "--max-restarts", "3", "--log-dir", logs,
                             "--ft-rank-section-timeouts", "setup:60,step:2,checkpointing:20",
                             "--ft-simulate-fault", "true", "--ft-simulated-fault-type", "rank_killed",
                             "--ft-simulated-fault-rank", "1", "--ft-simulated-fault-base-delay", "1",
                             EXAMPLE, "--steps", "150", "--step-time", STEP_TIME, "--ckpt-dir", tmp / "ckpt",
                             "--progress-dir", tmp / "progress"])
        # every rank has completed a step of cycle 1 (its progress line), so the hang lands mid-run
        wait_for(lambda: len(first_progress(tmp / "progress", 1)) == 2 or proc.poll() is not None,
                 150, "every rank stepping in cycle 1")
        started = [e for e in read_events(logs, "ranks_started") if e["cycle"] == 1]
        assert started, "no cycle 1"
        pid = next(r["pid"] for r in started[0]["detail"]["ranks"] if r["rank"] == 1)
        stopped_at = time.time()
        os.kill(pid, signal.SIGSTOP)
        out, err = proc.communicate(timeout=150)
    finally:
        helper.cleanup()
        left = wait_until_gone(helper.token, timeout=5)
        for p in left:
            p.kill()
    assert not left, f"processes left behind: {left}"
    assert proc.returncode == 0, err[-3000:]
    assert [(f["cycle"], f["detail"]["fault"]) for f in read_events(logs, "fault_injected")] == [(0, "rank_killed")]
    assert {h["cycle"] for h in read_events(logs, "hang")} == {1}
    return tmp, logs, stopped_at


@pytest.mark.slow
def test_report_of_a_kill_and_a_hang(kill_and_hang_job):
    tmp, logs, stopped_at = kill_and_hang_job
    res = run_cli(["report", logs, "-o", tmp / "report.html"], cwd=tmp)
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    page = (tmp / "report.html").read_text()
    assert "http://" not in page and "https://" not in page  # self-contained: nothing fetched
    assert re.search(r"<img id='timeline'[^>]*src='data:image/png;base64,[A-Za-z0-9+/=]{2000,}'", page)
    parsed = _Tables()
    parsed.feed(page)
    events = read_events(logs)
    fault = read_events(logs, "fault_injected")[0]
    starts = {e["cycle"]: e["time"] for e in read_events(logs, "ranks_started")}

    # incidents: cycle 0 a kill noticed by the agent, cycle 1 a hang noticed by a monitor
    rows = [r["cells"] for r in parsed.tables["incidents"] if r["class"] == "incident"]
    assert [r[0] for r in rows] == ["0", "1"]
    kill, hang = rows
    assert kill[2] == "1 (node 0)" and "killed by SIGKILL" in kill[3]
    assert "simulated rank_killed injected into rank 1" in kill[4]
    assert "the agent on node 0" in kill[5] and "exit status -9" in kill[5]
    assert "restarted every rank: cycle 1 (restart 1/3)" in kill[9] and "cycle 2 (restart 2/3)" in hang[9]
    # the hang's flight-recorder finding (what the agent said in its line) stands beside it
    found = [f for f in read_events(logs, "flight_recorder") if f["cycle"] == 1]
    assert kill[8] == "-" and found and hang[8] == found[0]["detail"]["summary"]
    assert hang[8].startswith("flight recorder: ") and f"    {hang[8]}" in res.stdout.splitlines()
    # the stopped rank 1, or rank 0 waiting for it in the same step, or both: their monitors notice
    assert "hung in section 'step'" in hang[3] and hang[4] == "a hang"
    assert "rank monitor" in hang[5] and "timeout 2 s" in hang[5] and "stack_local" in hang[7]
    # noticed: the kill at once; the hang when the step had been open for its 2 s timeout
    assert float(kill[6].split()[0]) < 1.0
    assert float(hang[6].split()[0]) == pytest.approx(2.0, abs=0.05)
    # recovery: from the fault to every rank's first step of the next cycle; that lies between the
    # ranks' start in that cycle and the end of their first step as the ranks themselves recorded it.
    # A hang counts from its section's entry, at most one step before the SIGSTOP.
    hang_start = read_events(logs, "hang")[0]
    hang_start = hang_start["time"] - hang_start["detail"]["elapsed"]
    assert stopped_at - 0.5 < hang_start < stopped_at + 0.5
    for cycle, row, at in ((0, kill, fault["time"]), (1, hang, hang_start)):
        recovery = float(row[10].split()[0])
        ended_first = max(first_progress(tmp / "progress", cycle + 1).values())
        assert starts[cycle + 1] - at - 0.02 <= recovery <= ended_first - at + 0.02, \
            (cycle, recovery, starts[cycle + 1] - at, ended_first - at)

    # goodput: seconds in completed steps over 2 ranks x the wall time; each step sleeps STEP_TIME
    goodput = float(re.search(r"goodput ([0-9.]+)%", page).group(1)) / 100
    summaries = read_events(logs, "cycle_summary")
    assert [s["cycle"] for s in summaries] == [0, 1, 2]
    step_total = sum(r["sections"].get("step", {}).get("total", 0) for s in summaries for r in s["detail"]["ranks"].values())
    wall = read_events(logs, "job_complete")[0]["time"] - min(e["time"] for e in read_events(logs, "cycle_start"))
    # goodput leaves out the steps redone after each restart (those after the cycle's last checkpoint)
    from ft_launcher import report
    job = report.analyse([logs], *report.load([logs]))
    redone = sum(r[1] for r in job.redone.values())
    assert goodput == pytest.approx((step_total - redone) / (2 * wall), abs=0.001)
    steps_done, distinct = {}, set()  # the ranks' own count of completed steps, per cycle; steps never redone
    for name in os.listdir(tmp / "progress"):
        for line in open(tmp / "progress" / name):
            key = (int(line.split()[0]), int(name.split("_")[1].split(".")[0]))
            steps_done[key] = steps_done.get(key, 0) + 1
            distinct.add((key[1], int(line.split()[1])))
    for s in summaries:
        for rank, info in s["detail"]["ranks"].items():
            counted = info["sections"].get("step", {}).get("count", 0)
            assert abs(counted - steps_done.get((s["cycle"], int(rank)), 0)) <= 1  # a stop may land between
    assert 0 < len(distinct) * STEP_TIME / (2 * wall) <= goodput < step_total / (2 * wall)

    # the console: one screen, the same facts
    lines = res.stdout.splitlines()
    assert len(lines) <= 25
    assert lines[0].startswith("job ") and "complete; 1 node(s), 2 rank(s), 3 cycle(s)" in lines[0]
    assert f"goodput {goodput * 100:.1f}%" in res.stdout and "incidents: 2" in res.stdout
    assert lines[-1] == f"report: {tmp / 'report.html'}"
    assert len([e for e in events if e["kind"] == "stepping"]) == 2  # cycles 1 and 2 (0 died first)


def test_report_of_a_running_job_and_bad_input(kill_and_hang_job, tmp_path):
    _, logs, _ = kill_and_hang_job
    data = (logs / "events.jsonl").read_bytes()
    cut = data.index(b'"kind": "restart"')  # mid-line, just after the first failure: a running job
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "events.jsonl").write_bytes(data[:cut])
    res = run_cli(["report", partial], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "running" in res.stdout.splitlines()[0] and "incidents: 1" in res.stdout
    assert "last line is incomplete" in res.stdout
    assert "(no decision recorded yet)" in res.stdout
    assert (partial / "report.html").exists()

    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "events.jsonl").write_bytes(data[:200] + b"\nnot json at all\n" + data[200:])
    empty = tmp_path / "empty"
    empty.mkdir()
    for args, message in ((["report", garbage], f"{garbage}/events.jsonl line 2: not an ft_launcher event"),
                          (["report", tmp_path / "nope"], f"log dir not found: {tmp_path / 'nope'}"),
                          (["report", empty], f"no events.jsonl in {empty}"),
                          (["report"], "the following arguments are required: LOGDIR")):
        res = run_cli(args, cwd=tmp_path)
        assert res.returncode == 2 and len(res.stderr.splitlines()) == 1, res.stderr
        assert res.stderr.startswith("ft_launcher: error: ") and message in res.stderr, res.stderr

    # without matplotlib: one line, exit 2 (a package that fails to import stands for a missing one)
    shadow = tmp_path / "shadow" / "matplotlib"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('not installed')\n")
    res = run_cli(["report", logs], cwd=tmp_path, env_extra={
        "PYTHONPATH": f"{tmp_path / 'shadow'}{os.pathsep}{ROOT}"})
    assert res.returncode == 2
    assert res.stderr.splitlines() == ["ft_launcher: error: report needs matplotlib: pip install 'ft_launcher[report]'"]


def _metrics(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def _one(values, prefix, **labels):
    found = [v for k, v in values.items() if k.startswith(prefix + "{")
             and all(f'{lk}="{lv}"' in k for lk, lv in labels.items())]
    assert len(found) == 1, (prefix, labels, [k for k in values if k.startswith(prefix)])
    return found[0]


def _events(dirs, kind):
    return [e for d in dirs for e in read_events(d, kind)]


@pytest.mark.slow   # status, metrics and report each have a shorter default test
def test_status_metrics_and_report_of_a_running_2x2_job(launcher, tmp_path):
    """2 agents x 2 ranks, one log dir per agent (as under SLURM without a shared dir), computed
    timeouts on, a simulated kill of rank 3 (node 1): status and /metrics read while the job runs
    again after the restart, the report merges both dirs."""
    dirs = [tmp_path / "logs0", tmp_path / "logs1"]
    port, ports = free_port(), [free_port(), free_port()]
    procs = [launcher.start(["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
                             "--rdzv-id", "ops2x2", "--node-rank", str(i), "--max-restarts", "1", "--log-dir", dirs[i],
                             "--metrics-port", ports[i], "--ft-rank-section-timeouts", "setup:60,step:10",
                             "--ft-calc-ft-timeouts", "true", "--ft-calc-min-observations", "5",
                             "--ft-simulate-fault", "true", "--ft-simulated-fault-type", "rank_killed",
                             "--ft-simulated-fault-rank", "3", "--ft-simulated-fault-base-delay", "5",
                             EXAMPLE, "--steps", "300", "--step-time", STEP_TIME, "--ckpt-dir", tmp_path / "ckpt"])
             for i in range(2)]
    # after the kill and the restart: both nodes' ranks stepping in cycle 1
    wait_for(lambda: len([e for e in _events(dirs, "stepping") if e["cycle"] == 1]) == 2, 150,
             "every rank stepping again in cycle 1")
    wait_for(lambda: all(r.get("steps", 0) > 0 and r.get("heartbeat_age") is not None
                         for d in dirs for f in os.listdir(d / "status") if f.endswith(".json")
                         for r in json.load(open(d / "status" / f))["ranks"]), 30, "status files showing steps")
    res = run_cli(["status", *dirs], cwd=tmp_path)
    assert all(p.poll() is None for p in procs), "the job ended before it could be read"
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("job 'ops2x2': running; 2 agent(s), 4 rank(s); cycle 1; restarts used 1/1"), lines
    # the step timeout shown: the configured 10 s or one the job computed (checked once the job is
    # over: a newer computed value can be applied between this read and reading the events)
    shown = re.match(r"timeouts: sections setup [0-9.]+s, step ([0-9.]+)s; out of section ", lines[1])
    assert shown, lines[1]
    rows = [l.split() for l in lines[3:-1]]
    assert [(r[0], r[4]) for r in rows] == [("0", "0"), ("0", "1"), ("1", "2"), ("1", "3")]
    sections = {r[6] for r in rows}
    assert sections <= {"step", "checkpointing", "(none)"} and "step" in sections, res.stdout
    for r in rows:  # heartbeat: every step sends one, so the last is recent
        assert r[-2] != "-" and float(r[-2].rstrip("s")) < 5, res.stdout
    # the report of the running job: the running cycle's steps come from the status files
    res = run_cli(["report", *dirs, "-o", tmp_path / "live.html"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "running (as of its last status update); 2 node(s), 4 rank(s), 2 cycle(s)" in res.stdout, res.stdout
    assert "incidents: 1" in res.stdout and "every rank stepping again" in res.stdout
    live = float(re.search(r"goodput ([0-9.]+)%", res.stdout).group(1))
    cycle0 = sum(r["sections"].get("step", {}).get("total", 0) for e in _events(dirs, "cycle_summary")
                  for r in e["detail"]["ranks"].values())
    assert live > 0 and "time in step" in res.stdout
    assert float(re.search(r"time in step ([0-9.]+) rank-s", res.stdout).group(1)) > cycle0  # cycle 1 counted

    metric_step_timeouts = []
    for node, mport in enumerate(ports):
        values = _metrics(mport)
        assert _one(values, "ft_launcher_restarts_total") == 1
        assert _one(values, "ft_launcher_failures_total") == (1 if node == 1 else 0)  # rank 3 lives on node 1
        assert _one(values, "ft_launcher_hangs_total") == 0
        assert _one(values, "ft_launcher_recovery_seconds_count") == 1
        assert 0 < _one(values, "ft_launcher_recovery_seconds_sum") < 120
        for rank in (2 * node, 2 * node + 1):
            assert _one(values, "ft_launcher_section_seconds_count", section="step", rank=rank) > 0
            assert _one(values, "ft_launcher_section_seconds_sum", section="step", rank=rank) > 0
        assert 0 < _one(values, "ft_launcher_goodput_ratio") < 1
        assert _one(values, "ft_launcher_cycle") == 1
        assert _one(values, "ft_launcher_restarts_used", max_restarts=1) == 1
        metric_step_timeouts.append(_one(values, "ft_launcher_section_timeout_seconds", section="step"))
    for proc in procs:
        proc.communicate(timeout=150)
        assert proc.returncode == 0
    steps_seen = {10.0} | {e["detail"]["new"] for e in _events(dirs, "timeout_computed") if e["detail"]["key"] == "section:step"}
    assert float(shown.group(1)) in {round(v, 6) for v in steps_seen} | {float(f"{v:g}") for v in steps_seen}, lines[1]
    assert all(v in steps_seen for v in metric_step_timeouts), (metric_step_timeouts, steps_seen)
    res = run_cli(["status", *dirs], cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.startswith("job 'ops2x2': finished (exit code 0)"), res.stdout

    # the report merges the two dirs: both nodes' lanes, the kill on node 1, the computed timeouts
    res = run_cli(["report", *dirs, "-o", tmp_path / "report.html"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "complete; 2 node(s), 4 rank(s), 2 cycle(s)" in res.stdout.splitlines()[0]
    parsed = _Tables()
    parsed.feed((tmp_path / "report.html").read_text())
    incident = [r["cells"] for r in parsed.tables["incidents"] if r["class"] == "incident"]
    assert len(incident) == 1 and incident[0][2] == "3 (node 1)" and "the agent on node 1" in incident[0][5]
    assert [r["cells"][0] for r in parsed.tables["ranks"][1:]] == ["0", "1", "2", "3"]
    computed = [(e["cycle"], e["detail"]["key"], e["detail"]["new"]) for e in _events(dirs, "timeout_computed")]
    assert computed, "no timeout was computed"
    # and the timeouts an agent took over from the store or ft_state.json (timeouts_loaded): when
    # a node applies another's computation at a cycle start depends on timing
    computed += [(e["cycle"], key, value) for e in _events(dirs, "timeouts_loaded")
                 for key, value in (e["detail"].get("timeouts") or {}).items()]
    shown = [(int(r["cells"][0]), r["cells"][1], float(r["cells"][3])) for r in parsed.tables["timeouts"][1:]]
    # the same changes (the report orders the merged dirs' events by time, not dir by dir)
    assert [(c, k, pytest.approx(v, rel=1e-2)) for c, k, v in sorted(computed)] == sorted(shown)


def test_status_without_a_job_and_a_busy_metrics_port_are_one_line_errors(launcher, tmp_path):
    res = run_cli(["status", tmp_path], cwd=tmp_path)
    assert res.returncode == 1
    assert res.stderr.splitlines() == [f"ft_launcher: error: no job found in {tmp_path} (no status/*.json: was "
                                       f"the job started with --log-dir there?)"]
    res = run_cli(["status", tmp_path / "nope"], cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.splitlines() == [f"ft_launcher: error: log dir not found: {tmp_path / 'nope'}"]
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = launcher.run(["--standalone", "--metrics-port", port, EXAMPLE], timeout=60)
    assert res.returncode == 2
    assert res.stderr.splitlines() == [f"ft_launcher: error: --metrics-port {port}: cannot listen: Address already in use"]
    res = launcher.run(["--standalone", "--metrics-port", "70000", EXAMPLE], timeout=60)
    assert res.returncode == 2
    assert res.stderr.splitlines() == ["ft_launcher: error: --metrics-port: expected a port 1-65535, got 70000"]


def _chromium():
    """A headless-capable chromium: found, else installed from the OS packages (root only, and
    only with FT_TEST_SYSTEM_SETUP=1)."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    from slurm_cluster import SYSTEM_SETUP, system_setup_allowed

    if not system_setup_allowed():   # a test run installs nothing unless asked (.ci/run asks)
        pytest.skip(f"no chromium; {SYSTEM_SETUP}=1 lets the tests install it with apt-get")
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("no chromium, and apt-get cannot install one here (not root, or no apt-get)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "chromium"]
    res = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:  # a stale package list: update once and retry
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=300)
        res = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
    if res.returncode != 0 or not shutil.which("chromium"):
        pytest.skip(f"chromium could not be installed from the OS packages: {res.stderr.strip()[-300:]}")
    return shutil.which("chromium")


def test_report_renders_in_a_headless_browser(kill_and_hang_job):
    tmp, logs, _ = kill_and_hang_job
    browser = _chromium()
    out = tmp / "shot"
    out.mkdir(exist_ok=True)
    page = out / "report.html"
    assert run_cli(["report", logs, "-o", page], cwd=tmp).returncode == 0
    shot = out / "report_screenshot.png"
    res = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                          "--window-size=1500,1700", f"--screenshot={shot}", f"file://{page}"],
                         capture_output=True, text=True, timeout=120, cwd=out,
                         env=dict(os.environ, HOME=str(out)))
    assert shot.exists(), res.stderr[-2000:]
    if os.environ.get("FT_SCREENSHOT_DIR"):   # to look at it: the suite itself leaves nothing in the temp dir
        keep = os.path.join(os.environ["FT_SCREENSHOT_DIR"], "ft_launcher_report_screenshot.png")
        shutil.copyfile(shot, keep)
        print(f"screenshot: {keep}")
    import matplotlib.image

    pixels = matplotlib.image.imread(str(shot))[:, :, :3]
    assert pixels.shape[0] >= 1000 and pixels.shape[1] >= 1400
    # the timeline was drawn by the browser: its stepping green (#2ca02c) and downtime red cover real area
    green = ((abs(pixels[:, :, 0] - 0x2c / 255) < 0.03) & (abs(pixels[:, :, 1] - 0xa0 / 255) < 0.03)
             & (abs(pixels[:, :, 2] - 0x2c / 255) < 0.03)).sum()
    assert green > 5000, green


@pytest.mark.slow   # two jobs; by default test_status_of_a_killed_agent_says_it_is_gone reads the same registry
def test_status_with_no_argument_finds_this_users_running_jobs(launcher, tmp_path):
    """Two jobs of this user (one with --log-dir, one without) are both shown by a bare
    `ft_launcher status` run from another dir; once they end, it says no job runs (exit 1), and
    their runtime entries are gone."""
    runtime = tmp_path / "runtime"
    env = {"FT_LAUNCHER_RUNTIME_DIR": str(runtime)}
    job = ["--standalone", "--nproc-per-node", "1", "--ft-rank-section-timeouts", "setup:60,step:30", EXAMPLE,
           "--steps", "2000", "--step-time", "0.05"]
    procs = [launcher.start(["--rdzv-id", "with_logs", "--log-dir", tmp_path / "logs"] + job
                            + ["--ckpt-dir", tmp_path / "ckpt_a"], extra_env=env),
             launcher.start(["--rdzv-id", "no_logs"] + job + ["--ckpt-dir", tmp_path / "ckpt_b"], extra_env=env)]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def shown():
        res = run_cli(["status"], cwd=elsewhere, env_extra=env)
        ok = (res.returncode == 0 and res.stdout.count("1 agent(s), 1 rank(s)") == 2
              and len(re.findall(r"  step {2,}", res.stdout)) == 2)   # each job's rank row in `step`
        return res if ok else None

    wait_for(shown, 90, "both jobs stepping in a bare `ft_launcher status`")
    res = shown()
    assert "job 'with_logs': running; 1 agent(s), 1 rank(s)" in res.stdout, res.stdout
    assert "job 'no_logs': running; 1 agent(s), 1 rank(s)" in res.stdout, res.stdout
    assert str(tmp_path / "logs" / "status") in res.stdout and str(runtime) in res.stdout
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        p.wait(timeout=60)
    assert not runtime.exists()   # the last agent removed the emptied dir
    res = run_cli(["status"], cwd=elsewhere, env_extra=env)
    assert res.returncode == 1 and res.stderr.startswith("ft_launcher: error: no running job of this user"), res.stderr
    res = run_cli(["status", tmp_path / "logs"], cwd=elsewhere, env_extra=env)   # a finished job: from its log dir
    assert res.returncode == 0 and "job 'with_logs': finished" in res.stdout, res.stdout


def _progress_steps(progress_dir):
    """{rank: [(cycle, step, time)]} from the ranks' own progress lines (written after each step)."""
    out = {}
    for name in os.listdir(progress_dir):
        rank = int(name.split("_")[1].split(".")[0])
        with open(os.path.join(progress_dir, name)) as fh:
            out[rank] = [(int(c), int(s), float(t)) for c, s, t in (l.split() for l in fh if l.strip())]
    return out


@pytest.mark.slow   # long (16 s); by default test_steps_redone_follow_the_checkpoint_resumed_from_on_every_restart_path counts the same steps
def test_goodput_counts_only_steps_never_redone(launcher, tmp_path):
    """Goodput = seconds in completed `step` sections never redone / (ranks x wall time). A fault-free
    job: its whole time in step. A job whose rank 0 dies in step 137 (checkpoint every 50): the 36
    steps 101-136 of cycle 0 are done again after resuming from step 100, so they and the downtime are
    loss; the report, the status file (what `status` and /metrics serve) say the same numbers."""
    from ft_launcher import report

    step_time = 0.02
    common = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
              "--ft-rank-section-timeouts", "setup:60,step:10,checkpointing:20"]
    # fault-free: goodput is the time in step
    res = launcher.run(common + ["--log-dir", tmp_path / "ok", EXAMPLE, "--steps", "60", "--step-time", step_time,
                                 "--ckpt-every", "25", "--ckpt-dir", tmp_path / "ck_ok"], timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    job = report.analyse([tmp_path / "ok"], *report.load([tmp_path / "ok"]))
    assert job.redone == {0: [0, 0.0], 1: [0, 0.0]}
    assert job.useful_seconds == job.step_seconds
    assert job.goodput == pytest.approx(sum(job.step_seconds.values()) / (2 * (job.end - job.start)), rel=1e-9)

    # a failure in step 137: resumed from the checkpoint of step 100
    logs, progress = tmp_path / "bad", tmp_path / "progress"
    res = launcher.run(common + ["--log-dir", logs, EXAMPLE, "--steps", "160", "--step-time", step_time,
                                 "--ckpt-every", "50", "--fail-at-step", "137", "--ckpt-dir", tmp_path / "ck",
                                 "--progress-dir", progress], timeout=150)
    assert res.returncode == 0, res.stderr[-3000:]
    done = _progress_steps(progress)
    for rank, rows in done.items():  # the ranks' own record: 1-136 in cycle 0, 101-160 in cycle 1
        assert [s for c, s, _ in rows if c == 0] == list(range(1, 137))
        assert [s for c, s, _ in rows if c == 1] == list(range(101, 161))
    job = report.analyse([logs], *report.load([logs]))
    summaries = {e["cycle"]: e["detail"]["ranks"] for e in read_events(logs, "cycle_summary")}
    for rank in (0, 1):
        steps, seconds = job.redone[rank]
        # rank 0 died in step 137; rank 1's step 137 may have ended too (by the exception its
        # all-reduce raised) before the agent stopped it
        assert steps == 36 or (rank == 1 and steps == 37), (rank, steps)
        ended = {s: t for c, s, t in done[rank] if c == 0}
        # 36 steps of at least step_time each, within the ranks' own clock from step 100 to 136
        assert 36 * step_time <= seconds
        if rank == 0:
            assert seconds <= ended[136] - ended[100] + 0.01
        total = sum(summaries[c][str(rank)]["sections"]["step"]["total"] for c in (0, 1))
        assert job.step_seconds[rank] == pytest.approx(total, abs=1e-6)
        assert job.useful_seconds[rank] == pytest.approx(total - seconds, abs=1e-6)
        assert summaries[0][str(rank)]["at_checkpoint"]["steps"] == 100
    wall = job.end - job.start
    assert job.goodput == pytest.approx(sum(job.useful_seconds.values()) / (2 * wall), rel=1e-9)
    # the downtime is loss too: no step completes between the failure and cycle 1's first step
    failure = read_events(logs, "failure")[0]["time"]
    stepping = [e for e in read_events(logs, "stepping") if e["cycle"] == 1][0]["detail"]["last_first_step"]
    assert job.goodput <= (sum(job.useful_seconds.values())) / (2 * (wall - (stepping - failure))) - 1e-4
    # status and Prometheus serve the agent's own count: the same useful seconds and redone steps
    (status,) = [json.load(open(logs / "status" / f)) for f in os.listdir(logs / "status")]
    for rank in (0, 1):
        assert status["useful_step_seconds"][str(rank)] == pytest.approx(job.useful_seconds[rank], abs=1e-5)
        assert status["redone_steps"][str(rank)]["steps"] == job.redone[rank][0]
    assert status["goodput"] == pytest.approx(sum(job.useful_seconds.values()) / (2 * (status["time"] - status["started"])),
                                              abs=1e-4)
    res = run_cli(["report", logs], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    redone = job.redone[0][0] + job.redone[1][0]
    assert f"goodput {job.goodput * 100:.1f}%" in res.stdout and f"{redone} steps (" in res.stdout, res.stdout


@pytest.mark.slow   # long (10-40 s); the default suite keeps a shorter test of the same path
def test_incident_of_a_simulated_hang_says_what_the_console_says(launcher, tmp_path):
    """A rank SIGSTOPped in step 60 (as a simulated rank_hung: placed by step, since a fault timed from
    the start landed in setup on a busy machine): the incident names the rank the agent blamed on its
    console line (and the rank column agrees), 'noticed after' is the monitor's own measure (the hung
    section's time open, as in the same line), and the stack dumps are links, relative to the report,
    that open."""
    logs = tmp_path / "logs"
    res = launcher.run(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", logs,
                        "--ft-rank-section-timeouts", "setup:60,step:2,checkpointing:20",
                        EXAMPLE, "--steps", "300", "--step-time", 0.02, "--ckpt-dir", tmp_path / "ck",
                        "--hang-in", "step", "--hang-by", "sigstop", "--fail-rank", 1, "--hold-step", 60], timeout=150)
    assert res.returncode == 0, res.stderr[-3000:]
    failure = read_events(logs, "failure")[0]
    blamed = failure["rank"]
    hang = next(h for h in read_events(logs, "hang") if h["rank"] == blamed)
    assert f"rank {blamed} on node 0 (127.0.0.1) hung in section 'step'" in res.stderr  # the console's blame
    out = tmp_path / "out"
    out.mkdir()
    rep = run_cli(["report", logs, "-o", out / "report.html"], cwd=tmp_path)
    assert rep.returncode == 0, rep.stderr
    page = (out / "report.html").read_text()
    parsed = _Tables()
    parsed.feed(page)
    (row,) = [r["cells"] for r in parsed.tables["incidents"] if r["class"] == "incident"]
    elapsed = f"{hang['detail']['elapsed']:.2f} s"
    assert row[2] == f"{blamed} (node 0)" and row[3] == f"rank {blamed} hung in section 'step'", row
    assert f"open {elapsed} > timeout 2 s" in row[5] and row[6] == elapsed, row
    line = next(l for l in rep.stdout.splitlines() if l.startswith("  cycle 0"))
    assert f"rank {blamed} hung" in line and f"open {elapsed} > timeout 2 s) after {elapsed};" in line, line
    # stack dumps: links relative to the report's folder, to the dump files in the log dir
    cell = re.search(r"<td class='stacks'>(.*?)</td>", page).group(1)
    hrefs = re.findall(r"<a href='([^']+)'>", cell)
    dumps = {os.path.basename(e["detail"]["stack_file"]) for e in read_events(logs, "stack_dump")}
    assert hrefs and {os.path.basename(h) for h in hrefs} == dumps, cell
    for href in hrefs:
        assert not os.path.isabs(href) and href.startswith("../logs/")
        assert os.path.isfile(os.path.join(out, href))


CKPT_BARRIER = os.path.join(SCRIPTS, "ckpt_barrier.py")


@pytest.mark.parametrize("path", ["cold", pytest.param("warm", marks=pytest.mark.slow),
                                  pytest.param("in_place", marks=pytest.mark.slow)])
def test_steps_redone_follow_the_checkpoint_resumed_from_on_every_restart_path(launcher, tmp_path, path):
    """Rank 1 hangs in step 20; rank 0 has written the step-20 checkpoint and waits for rank 1 in the
    checkpoint's barrier, its `checkpointing` section still open when the cycle ends (in place: left
    by the restart's exception). Every restart path (cold, warm reserves, in place) resumes from step
    20: no completed step is redone, and the report says so and why (it counted the steps since the
    last `checkpointing` that closed: 19 redone); rank 0 is drawn waiting on the failure, not stepping."""
    from ft_launcher import report

    out, logs = tmp_path / "out", tmp_path / "logs"
    flags = {"cold": ["--ft-warm-reserves", "0"], "warm": [], "in_place": []}[path]
    res = launcher.run(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", logs,
                        "--ft-rank-section-timeouts", "setup:30,step:2,checkpointing:60", *flags, CKPT_BARRIER, out,
                        40, 10, 1, 20] + (["--restartable"] if path == "in_place" else []), timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    started = {r["rank"]: r for r in [e for e in read_events(logs, "ranks_started") if e["cycle"] == 1][0]["detail"]["ranks"]}
    if path == "in_place":
        assert started[0]["in_place"] and not started[1]["in_place"]
    else:
        assert all(r["warm"] == (path == "warm") for r in started.values()), started
    # the truth, from the ranks' own records: cycle 1 began after step 20, and no step of cycle 0 came after it
    done = {r: [tuple(map(int, line.split())) for line in open(out / f"progress_{r}.txt")] for r in (0, 1)}
    for rank, rows in done.items():
        assert min(s for c, s in rows if c == 1) == 21 and max(s for c, s in rows if c == 0) == 20 - rank
    job = report.analyse([logs], *report.load([logs]))
    assert {r: v[0] for r, v in job.redone.items()} == {0: 0, 1: 0}
    assert job.useful_seconds == pytest.approx(job.step_seconds)
    (inc,) = job.incidents
    assert inc.resumed.startswith("resumed from its checkpoint after 20 steps of the cycle: 0 steps redone (rank 0 "
                                  "had been in its checkpointing section for "), inc.resumed
    waiting = [w for w in job.waiting if w["cycle"] == 0]
    assert [w["rank"] for w in waiting] == [0] and waiting[0]["end"] - waiting[0]["start"] >= 1.9
    rep = run_cli(["report", logs], cwd=tmp_path)
    assert rep.returncode == 0 and "of which 0 steps (0.0 rank-s) redone after restarts" in rep.stdout, rep.stdout


def _synthetic_hang_job():
    """The events of the README's job, as its agent wrote them (times in seconds from 1000): rank 1
    hangs in step; its monitor finds it; the restart resumes; the flight recorder's analysis ends
    after the last rank."""
    def ev(t, cycle, kind, rank=None, **detail):
        return {"time": 1000.0 + t, "node": 0, "rank": rank, "cycle": cycle, "kind": kind, "detail": detail}

    ranks = [{"rank": r, "local_rank": r, "pid": 10 + r, "warm": False, "in_place": False} for r in (0, 1)]
    summary = lambda steps: {str(r): {"sections": {"step": {"count": steps[r], "total": steps[r] * 0.01, "max": 0.01}},  # noqa: E731
                                      "at_checkpoint": {"steps": 150, "step_total": 1.5, "took": 0.01} if steps[r] > 150 else None}
                             for r in (0, 1)}
    return [ev(0, 0, "cycle_start", world_size=2), ev(0.04, 0, "ranks_started", ranks=ranks),
            ev(4.4, 0, "stepping", first_step={"0": 1004.4, "1": 1004.4}),
            ev(10.46, 0, "hang", 1, section="step", elapsed=5.0, timeout=5.0),
            ev(10.55, 0, "stack_dump", 1, stack_file="/x/stack_local1_11.txt"),
            ev(10.61, 0, "failure", 1, what="rank 1 hung in section 'step'", exitcode=-9),
            ev(10.87, 0, "cycle_summary", ranks=summary({0: 150, 1: 149})),
            ev(10.95, 0, "restart", next_cycle=1, restarts_used=1, rung="job"),
            ev(10.99, 1, "cycle_start", world_size=2), ev(11.01, 1, "ranks_started", ranks=ranks),
            ev(11.19, 1, "stepping", first_step={"0": 1011.19, "1": 1011.19}),
            ev(12.03, 1, "rank_exit", 1, exitcode=0), ev(12.04, 1, "rank_exit", 0, exitcode=0),
            ev(12.05, 1, "cycle_summary", ranks=summary({0: 150, 1: 150})),
            ev(18.62, 0, "flight_recorder", summary="flight recorder: gloo:barrier ... never completed"),
            ev(18.62, 1, "job_complete")]


def test_the_timeline_says_what_its_tail_is_and_no_marker_hides_the_hang():
    """The x-axis ran 6.6 s past the last bar with nothing to say why (the flight recorder's analysis,
    which the job's end waits for); the hang's marker sat behind the failure's and on the hung bar of
    its own colour."""
    import matplotlib.pyplot as plt

    from ft_launcher import report

    job = report.analyse(["x"], _synthetic_hang_job(), [], [])
    assert job.tail["start"] == pytest.approx(1012.04) and job.tail["end"] == pytest.approx(1018.62)
    text = report.console_summary(job, "r.html")
    assert "the last 6.6 s, after every rank had ended: the flight recorder's analysis of the hang in cycle 0" in text
    fig = report.timeline_figure(job)
    try:
        ax = fig.axes[0]
        fig.canvas.draw()
        marks = []
        for coll in ax.collections:
            if coll.get_gid() in ("hang", "stack_dump", "failure", "fault_injected"):
                (x, y), = coll.get_offsets()
                cx, cy = ax.transData.transform((x, y))
                radius = (coll.get_sizes()[0] ** 0.5) / 2 * fig.dpi / 72
                marks.append((coll.get_gid(), cx, cy, radius, coll.get_zorder()))
        hang = next(m for m in marks if m[0] == "hang")
        for other in marks:
            if other is not hang:   # no other marker covers it, and it is drawn above them all
                assert ((hang[1] - other[1]) ** 2 + (hang[2] - other[2]) ** 2) ** 0.5 >= hang[3] + other[3], other
                assert hang[4] > other[4]
        assert any("flight-recorder analysis" in t.get_text() for t in ax.texts)
    finally:
        plt.close(fig)


def test_a_script_without_a_step_section_gets_a_reason_for_its_zero_goodput(launcher, tmp_path):
    logs = tmp_path / "logs"
    res = launcher.run(["--standalone", "--nproc-per-node", "2", "--ft-warm-reserves", "0", "--log-dir", logs,
                        os.path.join(SCRIPTS, "cycle_sleeper.py"), tmp_path / "out", 0.2], timeout=60)
    assert res.returncode == 0, res.stderr
    rep = run_cli(["report", logs], cwd=tmp_path)
    assert rep.returncode == 0, rep.stderr
    line = next(l for l in rep.stdout.splitlines() if l.startswith("goodput "))
    assert line == ("goodput 0.0% (no rank ever completed a `step` section: goodput counts the time in completed "
                    "`step` sections; mark the training step with `with ft.section(\"step\"):` (or NVRx's client's "
                    "start_section(\"step\")))"), line


def test_status_of_a_killed_agent_says_it_is_gone(launcher, tmp_path):
    """The agent SIGKILLed (its ranks die with it, by the orphan watchdog): `ft_launcher status
    LOGDIR` no longer calls the job running; it says the agent is gone and when it was last heard
    from, in the job's line, one line for the agent and its rank's row."""
    logs, out = tmp_path / "logs", tmp_path / "out"
    proc = launcher.start(["--standalone", "--nproc-per-node", 1, "--rdzv-id", "killed", "--log-dir", logs,
                           os.path.join(SCRIPTS, "cycle_sleeper.py"), out, 600])
    wait_for(lambda: (out / "rank_0.txt").exists() and any(
        json.load(open(logs / "status" / f)).get("ranks") for f in os.listdir(logs / "status")),
        60, "the rank running and in the status file")
    res = run_cli(["status", logs], cwd=tmp_path)
    assert res.returncode == 0 and "job 'killed': running; 1 agent(s)" in res.stdout, res.stdout
    proc.kill()
    proc.communicate(timeout=30)
    res = run_cli(["status", logs], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert re.match(r"job 'killed': gone: its agent ended without finishing; last heard from \d+s ago, at "
                    r"\d\d:\d\d:\d\d; 1 agent\(s\)", lines[0]), res.stdout
    assert re.match(rf"agent gone: node 0 on {re.escape(socket.gethostname())} \(pid {proc.pid} no longer runs\); "
                    r"last heard from \d+s ago", lines[1]), res.stdout
    (row,) = [line for line in lines if f"({proc.pid})" in line and "agent gone" not in line]
    assert "gone, last heard" in row and "running" not in res.stdout and "silent" not in res.stdout, res.stdout
