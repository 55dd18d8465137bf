"""How a helper process (a rank monitor, the orphan watchdog, a warm reserve) starts one of our
modules so that nothing in the user's directory can stand in for it.

`python -m agent.ranks.orphan_watchdog` put the current directory first on sys.path: a user's
`agent.py`, `agent/` or `rank_monitor.py` there was imported, or run, in place of ours. Our
modules are imported as `ft_launcher.agent.*` and `ft_launcher.rank_monitor.*` (the one name the
project owns), and a helper starts as `python -c BOOT ...`, where BOOT drops the current
directory from sys.path and puts first the directory that holds the ft_launcher in use (a source
checkout's root, or site-packages), so the helper imports the same code as the agent.
"""
from __future__ import annotations

import os
import sys
from typing import List, Sequence

_PREFIX = ("import sys\n"
           "if sys.path[:1] == ['']: del sys.path[0]\n"
           "sys.path.insert(0, {root!r})\n")
_RUN_MODULE = ("import runpy\n"
               "sys.argv[:] = sys.argv[1:]\n"
               "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n")


def package_parent() -> str:
    """The directory that holds the ft_launcher package this process imported."""
    return os.path.dirname(os.path.dirname(os.path.abspath(sys.modules["ft_launcher"].__file__)))


def code_command(code: str, args: Sequence[str] = (), flags: Sequence[str] = ()) -> List[str]:
    """`python FLAGS -c CODE ARGS...`, CODE run with our packages first and no current directory
    on sys.path (sys.argv is ['-c', *ARGS], as for any -c program)."""
    return [sys.executable, *flags, "-c", _PREFIX.format(root=package_parent()) + code, *args]


def module_command(module: str, args: Sequence[str] = (), flags: Sequence[str] = ()) -> List[str]:
    """Like `python FLAGS -m MODULE ARGS...` for one of our modules, without the current directory
    on sys.path."""
    return code_command(_RUN_MODULE, [module, *args], flags)
