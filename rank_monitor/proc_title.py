"""Name a helper process for `ps` (`ft_launcher: rank_monitor local_rank=3`) without hiding its
environment: setproctitle would otherwise reuse the environment's memory for a long title, which
blanks /proc/<pid>/environ, and tools that find a job's processes by an environment tag (the
test suite's orphan check, operators' scripts) would no longer see them. The title is then
limited to the length of the original command line, which is long enough for ours.
"""
import os


def set_title(title: str) -> None:
    os.environ.setdefault("SPT_NOENV", "1")   # read when setproctitle first runs
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(title)
