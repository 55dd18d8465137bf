"""The suite on a machine that runs other work, and what it may change there:

- a test's leak check blames only files named after the processes that test started, never
  another job's (a file in /dev/shm or the temp dir that appears while the test runs);
- nothing outside the project and the temp dir changes unless asked: the SLURM fixture installs
  no package and adds no /etc/hosts line without FT_TEST_SYSTEM_SETUP=1, removes the line it added
  when asked, and .ci/run asks (so CI still runs the SLURM tests).
"""
import os
import subprocess
import sys
import tempfile

import pytest

import slurm_cluster
from conftest import ROOT, SCRIPTS


@pytest.fixture
def other_job():
    """Another job of this user on the machine, whose agent is a live process the test did not
    start; the files it makes while the test runs are removed after the test's own teardown
    (fixtures end in reverse order: this one after `launcher`'s leak check)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    made = []
    yield proc, made
    proc.kill()
    proc.wait()
    for path in made:
        if os.path.isdir(path):
            os.rmdir(path)
        elif os.path.exists(path):
            os.unlink(path)


def test_the_leak_check_blames_only_the_files_of_the_tests_own_processes(other_job, launcher, tmp_path):
    """While this test's job runs, another job's agent makes its monitor record in /dev/shm and its
    run dir in the temp dir, and leaves them there past this test's end: they are not this test's
    leak (the teardown's check used to blame every new `ft_launcher*` file on the machine)."""
    proc, made = other_job
    shm = f"/dev/shm/ft_launcher_{proc.pid}_0123abcd_local0"
    run_dir = os.path.join(tempfile.gettempdir(), f"ft_launcher-{proc.pid}")
    job = launcher.start(["--standalone", "--nproc-per-node", 1, "--ft-warm-reserves", 0,
                          os.path.join(SCRIPTS, "cycle_sleeper.py"), tmp_path / "out", 1])
    with open(shm, "wb") as fh:
        fh.write(b"\0" * 64)
    os.mkdir(run_dir)
    made += [shm, run_dir]
    _, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    # the teardown of `launcher` now checks this test's own files only, and passes


def test_the_slurm_fixture_edits_no_system_file_unless_asked(tmp_path, monkeypatch):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n")
    monkeypatch.delenv(slurm_cluster.SYSTEM_SETUP, raising=False)
    with pytest.raises(slurm_cluster.ClusterUnavailable, match=f"{slurm_cluster.SYSTEM_SETUP}=1 lets the tests map"):
        slurm_cluster.ensure_hosts(["ft-test-no-such-node-1"], hosts_file=str(hosts))
    assert hosts.read_text() == "127.0.0.1 localhost\n"
    # asked: the line is added (the name may still not resolve here: /etc/hosts is not this file),
    # and removed again, leaving the file as it was
    monkeypatch.setenv(slurm_cluster.SYSTEM_SETUP, "1")
    with pytest.raises(slurm_cluster.ClusterUnavailable, match="does not resolve after adding it"):
        slurm_cluster.ensure_hosts(["ft-test-no-such-node-1"], hosts_file=str(hosts))
    line = "127.0.0.1 ft-test-no-such-node-1" + slurm_cluster.HOSTS_MARK
    assert hosts.read_text() == "127.0.0.1 localhost\n" + line + "\n"
    slurm_cluster.remove_hosts_line(line, hosts_file=str(hosts))
    assert hosts.read_text() == "127.0.0.1 localhost\n"


def test_the_slurm_fixture_installs_no_package_unless_asked(monkeypatch):
    monkeypatch.delenv(slurm_cluster.SYSTEM_SETUP, raising=False)
    monkeypatch.setattr(slurm_cluster, "NEEDED_BINARIES", ("ft-test-no-such-binary",))
    ran = []
    monkeypatch.setattr(slurm_cluster.subprocess, "run", lambda *a, **k: ran.append(a))
    with pytest.raises(slurm_cluster.ClusterUnavailable, match=f"{slurm_cluster.SYSTEM_SETUP}=1 lets the tests install"):
        slurm_cluster.ensure_installed()
    assert ran == []   # no apt-get


def test_ci_asks_for_the_system_setup_and_requires_slurm():
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert "export FT_TEST_SYSTEM_SETUP=1 FT_REQUIRE_SLURM=1" in ci
    assert ci.index("export FT_TEST_SYSTEM_SETUP=1") < ci.index('bash -eo pipefail -c "$command"')
