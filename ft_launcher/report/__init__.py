"""`ft_launcher report LOGDIR... [-o FILE]`: what happened in a job, from its events.jsonl (one log
dir, or several merged: one per node under SLURM), as one self-contained HTML file (the timeline
is a PNG drawn with matplotlib, embedded as base64: no network needed to view it) and a one-screen
summary on the console.

Works on a finished job and on a running one: a last line still being written is skipped, and the
running cycle's time in `step` comes from the agents' status files (agent.observation.job_status).

Its parts, one job each:
- reading: the log dirs' events and status files;
- analysis: cycles, bars, incidents (which rank, what happened, who noticed after how long, the
  stack dumps, the flight recorder's finding, what was done, how long until every rank stepped
  again, where the next cycle resumed), goodput and the steps redone on every restart path,
  timeout changes;
- wording: the console summary and the lines the page shares;
- timeline: the PNG; page: the HTML; command: the command line.
matplotlib is an optional dependency (`pip install ft_launcher[report]`).
"""
from ft_launcher.report.analysis import Incident, Job, analyse
from ft_launcher.report.command import PROG, main
from ft_launcher.report.page import render_html
from ft_launcher.report.reading import END_KINDS, ReportError, load, read_events
from ft_launcher.report.timeline import timeline_figure, timeline_png
from ft_launcher.report.wording import console_summary, goodput_words, incident_line, live_words

__all__ = ["END_KINDS", "Incident", "Job", "PROG", "ReportError", "analyse", "console_summary", "goodput_words",
           "incident_line", "live_words", "load", "main", "read_events", "render_html", "timeline_figure",
           "timeline_png"]
