"""ft_launcher.rank_command: the command every rank runs, and its target checked before launch
(a missing script, a shell script without --no-python, a module that is not there: one line)."""
import sys

import pytest

from ft_launcher.flags import UsageError, build_parser
from ft_launcher.rank_command import entry_kind, entrypoint, hooked_entrypoint
from ft_launcher.rank_monitor.config import FaultToleranceConfig


def args(*argv):
    return build_parser().parse_args(list(argv))


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print(1)\n")
    (tmp_path / "mymod.py").write_text("print(1)\n")
    (tmp_path / "run.sh").write_text("#!/bin/bash\nif then\n")
    (tmp_path / "folder").mkdir()
    return tmp_path


def test_each_kind_of_target_runs_as_its_flag_says(here):
    py = sys.executable
    assert entrypoint(args("train.py", "--steps", "1")) == [py, "-u", "train.py", "--steps", "1"]
    assert entrypoint(args("-m", "mymod", "x")) == [py, "-u", "-m", "mymod", "x"]   # found in the cwd
    assert entrypoint(args("--run-path", "train.py"))[:3] == [py, "-u", "-c"]
    assert entrypoint(args("--no-python", "run.sh", "a")) == ["run.sh", "a"]
    assert [entry_kind(args(*f, "train.py")) for f in ((), ("-m",), ("--run-path",), ("--no-python",))] == [
        "script", "module", "run_path", "program"]


def test_a_wrong_target_is_one_line(here):
    for argv, line in ((("missing.py",), "training script not found: missing.py"),
                       (("folder",), "training script folder is a directory, not a file"),
                       (("-m", "no_such_module"), "module not found: no_such_module"),
                       (("--no-python", "no_such_program"), "program not found: no_such_program"),
                       (("--no-python", "-m", "train.py"), "--no-python and --module cannot be combined")):
        with pytest.raises(UsageError) as raised:
            entrypoint(args(*argv))
        assert str(raised.value) == line
    with pytest.raises(UsageError, match=r"^training script run.sh is not a Python script \(it starts with "
                                         r"'#!/bin/bash'; python cannot parse it: SyntaxError at line 2\): to run "
                                         r"it as a program, add --no-python$"):
        entrypoint(args("run.sh"))


def test_the_exception_hook_wraps_python_targets_only(here, capsys):
    hooked = FaultToleranceConfig(install_exception_hook=True)
    assert hooked_entrypoint(args("train.py"), FaultToleranceConfig()) == entrypoint(args("train.py"))
    command = hooked_entrypoint(args("train.py", "a"), hooked)
    assert command[:3] == [sys.executable, "-u", "-c"] and command[-3:] == ["script", "train.py", "a"]
    assert "excepthook" in command[3]
    assert not capsys.readouterr().err
    assert hooked_entrypoint(args("--no-python", "run.sh"), hooked) == ["run.sh"]
    assert capsys.readouterr().err == ("ft_launcher: install_exception_hook: --no-python runs no Python of ours "
                                       "first; the hook is not installed (a rank's exit code still reports its "
                                       "failure)\n")
