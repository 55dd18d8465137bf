"""The command every rank runs (a script, `-m` module, `--run-path` script or `--no-python` program),
checked before anything starts: the target exists and is what the flags say it is; with
install_exception_hook, wrapped by rank_monitor.rank_side.excepthook.
"""
from __future__ import annotations

import os
import shutil
import sys
from typing import List, Optional

from ft_launcher.flags import PROG, UsageError


def entrypoint(args) -> List[str]:
    script, rest = args.training_script, list(args.training_script_args)
    if args.no_python:
        if args.module:
            raise UsageError("--no-python and --module cannot be combined")
        if not (os.path.isfile(script) or shutil.which(script)):
            raise UsageError(f"program not found: {script}")
        return [script] + rest
    if args.module:
        import importlib.util

        sys.path.insert(0, os.getcwd())  # `python -m` (how each rank runs it) looks in the cwd first
        try:
            found = importlib.util.find_spec(script.split(".")[0]) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path.remove(os.getcwd())
        if not found:
            raise UsageError(f"module not found: {script}")
        return [sys.executable, "-u", "-m", script] + rest
    if os.path.isdir(script):
        raise UsageError(f"training script {script} is a directory, not a file")
    if not os.path.isfile(script):
        raise UsageError(f"training script not found: {script}")
    not_python = _not_python(script)
    if not_python:
        raise UsageError(f"training script {script} is not a Python script ({not_python}): to run it as a "
                         f"program, add --no-python")
    if args.run_path:
        runner = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
        return [sys.executable, "-u", "-c", runner, script] + rest
    return [sys.executable, "-u", script] + rest


def _not_python(script: str) -> Optional[str]:
    """Why `script` is a program rather than Python (a shell script passed without --no-python,
    which every rank would fail with a SyntaxError), or None. Only a file that python cannot
    compile counts, and only with a non-Python `#!` line or a shell's file extension."""
    try:
        with open(script, "rb") as fh:
            source = fh.read(1 << 20)
    except OSError:
        return None
    first = source.split(b"\n", 1)[0].decode("utf-8", errors="replace").strip()
    shebang = first[2:].strip() if first.startswith("#!") else None
    if shebang is not None and "python" in shebang:
        return None
    if shebang is None and not script.endswith((".sh", ".bash", ".zsh")):
        return None
    try:
        compile(source, script, "exec")
        return None
    except (SyntaxError, ValueError) as exc:
        lineno = getattr(exc, "lineno", None)
        where = f"python cannot parse it: {type(exc).__name__}" + (f" at line {lineno}" if lineno else "")
        return f"it starts with '#!{shebang}'; {where}" if shebang else where


def hooked_entrypoint(args, ft) -> List[str]:
    """The rank's command; with install_exception_hook, through rank_monitor.rank_side.excepthook."""
    command = entrypoint(args)
    if not ft.install_exception_hook:
        return command
    if args.no_python:
        print(f"{PROG}: install_exception_hook: --no-python runs no Python of ours first; the hook is "
              "not installed (a rank's exit code still reports its failure)", file=sys.stderr)
        return command
    from ft_launcher.rank_monitor.rank_side import excepthook
    from ft_launcher.rank_monitor.own_modules import package_parent

    return excepthook.command(entry_kind(args), command, args.training_script,
                              list(args.training_script_args), package_parent())


def entry_kind(args) -> str:
    """How the cold command runs the target (see LaunchConfig.entry_kind)."""
    if args.no_python:
        return "program"
    return "module" if args.module else "run_path" if args.run_path else "script"
