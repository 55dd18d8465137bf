"""`python -m ft_launcher`, with every call the agent's main thread makes into ft_launcher.agent's
modules recorded ("module.Qualified.name", the module by its own name without its package, in order) and written as JSON to $FT_TEST_WALK_FILE at
exit: tests/agent/unit/test_node_state.py follows one failure's walk through the agent's parts with it."""
import atexit
import json
import os
import sys

PREFIX = "ft_launcher.agent."
calls = []


def qualname(frame):
    """Class.method (co_qualname, Python 3.11+; on 3.10 from `self`)."""
    code = frame.f_code
    if hasattr(code, "co_qualname"):
        return code.co_qualname
    owner = frame.f_locals.get("self")
    return f"{type(owner).__qualname__}.{code.co_name}" if owner is not None else code.co_name


def record(frame, event, _arg):
    if event == "call":
        module = frame.f_globals.get("__name__", "")
        if module.startswith(PREFIX):
            calls.append(f"{module.rsplit('.', 1)[1]}.{qualname(frame)}")


def write():
    sys.setprofile(None)
    with open(os.environ["FT_TEST_WALK_FILE"], "w") as fh:
        json.dump(calls, fh)


atexit.register(write)
sys.setprofile(record)   # the main thread only: the agent's loop runs there

from ft_launcher.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
