"""torchrun habits: every flag of the installed torch's torchrun parser (every spelling, and its
PET_* variable) is taken by ft_launcher's command line, and either acts or says in one line what
ft_launcher does instead; `-m module` finds a module in the current directory as `python -m` does;
with the static backend the ranks get the --master-addr the user gave."""
import os
import signal
import subprocess
import sys

import tempfile

import pytest

from conftest import ROOT
from ft_launcher import cli
from ft_launcher.flag_notes import TORCHRUN_NOTES


@pytest.fixture(autouse=True)
def _temp_dir_of_the_test(tmp_path, monkeypatch):
    """--redirects without --log-dir makes its log dir in the temp dir as the config is built: here, the test's."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

# a sample value per torchrun destination where a generic one would not do
SAMPLES = {"nnodes": "1", "nproc_per_node": "1", "rdzv_backend": "c10d", "rdzv_endpoint": "127.0.0.1:29411",
           "rdzv_id": "job7", "rdzv_conf": "join_timeout=5", "redirects": "3", "tee": "1", "local_ranks_filter": "0",
           "master_addr": "127.0.0.1", "local_addr": "127.0.0.1", "role": "trainer", "event_log_handler": "console",
           "logs_specs": "my_specs", "duplicate_stdout_filters": "apple,orange",
           "duplicate_stderr_filters": "apple", "signals_to_handle": "SIGTERM,SIGUSR1", "shutdown_timeout": "7",
           "max_restarts": "2", "monitor_interval": "0.5", "node_rank": "0", "master_port": "29412"}
# where a flag's value lands in the LaunchConfig (the flag acts)
EFFECT = {"nnodes": lambda c: (c.min_nodes, c.max_nodes) == (1, 1), "nproc_per_node": lambda c: c.nproc_per_node == 1,
          "rdzv_backend": lambda c: c.rdzv_backend == "c10d", "rdzv_endpoint": lambda c: c.rdzv_port == 29411,
          "rdzv_id": lambda c: c.rdzv_id == "job7", "rdzv_conf": lambda c: c.rdzv_conf["join_timeout"] == 5,
          "standalone": lambda c: c.standalone, "max_restarts": lambda c: c.max_restarts == 2,
          "monitor_interval": lambda c: c.monitor_interval == 0.5, "role": lambda c: c.role == "trainer",
          "module": lambda c: c.entry_kind == "module", "no_python": lambda c: c.entry_kind == "program",
          "run_path": lambda c: c.entry_kind == "run_path", "log_dir": lambda c: c.log_dir is not None,
          "redirects": lambda c: c.capture == {0: 3}, "tee": lambda c: c.tee == {0: 1},
          "local_ranks_filter": lambda c: c.local_ranks_filter == {0}, "node_rank": lambda c: c.order_key == 0,
          "master_addr": lambda c: c.rdzv_host == "127.0.0.1", "master_port": lambda c: c.rdzv_port == 29412,
          "local_addr": lambda c: c.local_addr == "127.0.0.1", "shutdown_timeout": lambda c: c.term_timeout == 7,
          "signals_to_handle": lambda c: c.signals == (signal.SIGTERM, signal.SIGUSR1),
          "start_method": lambda c: True}  # accepted for compatibility: ranks are always fresh processes


def torchrun_actions():
    from torch.distributed.run import get_args_parser

    return [a for a in get_args_parser()._actions if a.option_strings and a.dest != "help"]


def _sample(action, tmp_path):
    if action.nargs == 0:
        return []
    if action.dest == "log_dir":
        return [str(tmp_path / "logs")]
    if action.choices:
        return [str(list(action.choices)[0])]
    return [SAMPLES.get(action.dest, "x")]


def _outcome(argv, capsys):
    """(LaunchConfig or None, the one-line error or None, stderr lines) of our parser on argv."""
    try:
        cfg, error = cli.launch_config(argv), None
    except cli.UsageError as exc:
        cfg, error = None, str(exc)
    return cfg, error, capsys.readouterr().err.splitlines()


def _check(action, flag, cfg, error, err):
    dest = action.dest
    assert error is None or ("\n" not in error and "unrecognized" not in error), (flag, error)
    notes = [l for l in err if l.startswith("ft_launcher: note:")]
    if dest == "virtual_local_rank":  # the one torchrun flag we refuse, in one line saying what we do
        assert error and error.startswith("--virtual-local-rank is not supported: every rank sees every GPU"), error
    elif dest in TORCHRUN_NOTES:  # accepted; one line says what ft_launcher does instead
        assert error is None and len(notes) == 1 and f"--{dest.replace('_', '-')}:" in notes[0], (flag, err)
    else:
        assert error is None and not notes, (flag, error, err)
        assert EFFECT[dest](cfg), (flag, cfg)


def test_every_torchrun_flag_and_spelling_is_taken(tmp_path, capsys, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path)
    for var in [v for v in os.environ if v.startswith(("PET_", "SLURM_"))]:
        monkeypatch.delenv(var)
    actions = torchrun_actions()
    assert len(actions) >= 30 and {"virtual_local_rank", "signals_to_handle", "shutdown_timeout"} <= {a.dest for a in actions}
    checked = 0
    for action in actions:
        value = _sample(action, tmp_path)
        target = "json" if action.dest == "module" else str(script)
        for flag in action.option_strings:
            cfg, error, err = _outcome([flag, *value, target], capsys)
            _check(action, flag, cfg, error, err)
            checked += 1
        # and its PET_* variable, as torchrun reads it (PET_ + the destination in upper case)
        var = "PET_" + action.dest.upper()
        monkeypatch.setenv(var, value[0] if value else "1")
        cfg, error, err = _outcome([target], capsys)
        monkeypatch.delenv(var)
        assert not [l for l in err if "not a launcher flag" in l or "not supported by ft_launcher; ignored" in l], (var, err)
        _check(action, var, cfg, error, err)
    assert checked >= 55
    # etcd (and etcd-v2): a one-line error that says what to use instead
    for backend in ("etcd", "etcd-v2"):
        cfg, error, _ = _outcome(["--rdzv-backend", backend, "--rdzv-endpoint", "etcd:2379", str(script)], capsys)
        assert cfg is None and error.startswith(f"--rdzv-backend: {backend} is not supported: ft_launcher has no etcd") \
            and "--rdzv-backend c10d --rdzv-endpoint" in error, error
    cfg, error, _ = _outcome(["--signals-to-handle", "SIGNOPE", str(script)], capsys)
    assert error == "--signals-to-handle: unknown signal 'SIGNOPE'"


def test_module_in_the_cwd_and_master_addr_passed_through(launcher, tmp_path):
    """The installed `ft_launcher` command (its sys.path[0] is its bin dir, not the cwd) runs
    `-m localmod` from the cwd, as torchrun does; --master-addr reaches the ranks as MASTER_ADDR."""
    command = os.path.join(os.path.dirname(sys.executable), "ft_launcher")
    if not os.path.isfile(command):
        pytest.skip("no installed ft_launcher command beside this python")
    (tmp_path / "localmod.py").write_text(
        "import os\nopen('env_' + os.environ['RANK'], 'w').write(os.environ['MASTER_ADDR'] + ' ' + os.environ['MASTER_PORT'])\n")
    port = __import__("conftest").free_port()
    env = launcher.env({"PYTHONPATH": ROOT})  # no empty entry (the cwd) on the launcher's own path
    res = subprocess.run([command, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                          "-m", "localmod"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = sorted([p.name[4:]] + p.read_text().split() for p in tmp_path.glob("env_*"))  # two ranks' lines interleave
    assert [r[0] for r in rows] == ["0", "1"], res.stdout
    assert {r[1] for r in rows} == {"127.0.0.1"}, rows   # as given (it was this host's FQDN, e.g. localhost)
    assert len({r[2] for r in rows}) == 1  # one worker store per cycle (a free port, not --master-port: docs/flags-and-configuration.md)


def test_signals_to_handle_forwards_sigusr1_and_stops_the_job(launcher, tmp_path):
    """torchrun's --signals-to-handle: a listed signal to the agent goes to every rank, then the job stops."""
    script = tmp_path / "wait_usr1.py"
    script.write_text("import os, signal, sys, time\n"
                      "def got(sig, frame):\n    open(os.path.join(sys.argv[1], 'got_' + os.environ['RANK']), 'w').write(str(sig))\n"
                      "    sys.exit(0)\n"
                      "signal.signal(signal.SIGUSR1, got)\n"
                      "open(os.path.join(sys.argv[1], 'ready_' + os.environ['RANK']), 'w').close()\n"
                      "time.sleep(60)\n")
    proc = launcher.start(["--standalone", "--nproc-per-node", "2", "--signals-to-handle", "SIGTERM,SIGUSR1",
                           "--term-timeout", "10", script, tmp_path])
    __import__("conftest").wait_for(lambda: len(list(tmp_path.glob("ready_*"))) == 2 or proc.poll() is not None,
                                    60, "both ranks ready")
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=30)
    got = {p.name: p.read_text() for p in tmp_path.glob("got_*")}
    assert got == {"got_0": str(int(signal.SIGUSR1)), "got_1": str(int(signal.SIGUSR1))}, (got, err[-2000:])
    assert "received SIGUSR1: forwarding to the ranks" in err and proc.returncode == 128 + signal.SIGUSR1, err[-2000:]
