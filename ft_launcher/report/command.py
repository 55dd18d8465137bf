"""`ft_launcher report LOGDIR... [-o FILE]`: the command line. Reads the log dirs
(ft_launcher.report.reading), analyses them (analysis), writes the HTML page (page, with the
timeline PNG) and prints the console summary (wording)."""
from __future__ import annotations

import os
import sys
from typing import Sequence

from ft_launcher.report.analysis import analyse
from ft_launcher.report.page import render_html
from ft_launcher.report.reading import ReportError, load
from ft_launcher.report.timeline import timeline_png
from ft_launcher.report.wording import console_summary

PROG = "ft_launcher report"


def main(argv: Sequence[str]) -> int:
    from ft_launcher.flags import UsageError, _Parser

    parser = _Parser(prog=PROG, description="An HTML report (timeline, goodput, incidents, timeout changes) "
                     "of a job from its log dirs, and a summary on the console.")
    parser.add_argument("log_dirs", nargs="+", metavar="LOGDIR", help="the job's --log-dir (several: one per node)")
    parser.add_argument("-o", "--output", default=None, help="the HTML file (default LOGDIR/report.html)")
    try:
        args = parser.parse_args(list(argv))
    except UsageError as exc:
        print(f"ft_launcher: error: {exc}", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("ft_launcher: error: report needs matplotlib: pip install 'ft_launcher[report]'", file=sys.stderr)
        return 2
    output = args.output or os.path.join(args.log_dirs[0], "report.html")
    try:
        events, statuses, notes = load(args.log_dirs)
        job = analyse(args.log_dirs, events, statuses, notes)
        page = render_html(job, timeline_png(job), os.path.dirname(os.path.abspath(output)))
        try:
            with open(output, "w") as fh:
                fh.write(page)
        except OSError as exc:
            raise ReportError(f"cannot write {output}: {exc.strerror or exc}") from None
    except ReportError as exc:
        print(f"ft_launcher: error: {exc}", file=sys.stderr)
        return 2
    print(console_summary(job, os.path.abspath(output)))
    return 0
