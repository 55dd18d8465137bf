"""PR_SET_PDEATHSIG=SIGKILL for the calling process: it dies when its parent does. Called by a
rank monitor for itself, and between fork and exec for a rank where util-linux `setpriv` is
missing (agent.ranks.workers)."""
import ctypes
import signal

PR_SET_PDEATHSIG = 1


def set_pdeathsig() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass
