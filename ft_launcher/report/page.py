"""The report's HTML page: one self-contained file (the timeline PNG embedded as base64: nothing
is fetched to view it): the goodput and what it counted, the timeline, the incidents with links to
their stack dumps, the cycles, each rank's time in step, the timeout changes."""
from __future__ import annotations

import base64
import html
import os
import time
import urllib.parse
from typing import Optional, Sequence

from ft_launcher.report.analysis import Job
from ft_launcher.report.wording import fmt, goodput_words, num, tail_words

_CSS = """body{font-family:sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse;margin:.5em 0}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;font-size:13px}th{background:#f0f0f0}
.num{text-align:right}.big{font-size:20px;font-weight:bold}code{background:#f4f4f4}"""


def _stack_link(path: str, dirs: Sequence[str], out_dir: Optional[str]) -> str:
    """A stack dump as a link relative to the report's folder: the recorded path, or the file of
    that name in one of the log dirs (a log dir copied or moved since). A bare name when neither
    exists or the report's folder is unknown."""
    e = html.escape
    found = next((c for c in [path] + [os.path.join(d, os.path.basename(path)) for d in dirs] if os.path.isfile(c)),
                 None)
    if found is None or out_dir is None:
        return e(os.path.basename(path))
    href = os.path.relpath(os.path.abspath(found), os.path.abspath(out_dir))
    return f"<a href='{e(urllib.parse.quote(href))}'>{e(os.path.basename(path))}</a>"


def render_html(job: Job, png: bytes, out_dir: Optional[str] = None) -> str:
    """The page; `out_dir` (the folder the page is written to) makes stack dumps relative links."""
    e = html.escape
    wall = job.end - job.start
    rows = [("job", job.run_id), ("state", job.state), ("log dirs", ", ".join(job.dirs)),
            ("nodes", len(job.nodes)), ("ranks", job.world_size), ("cycles", len(job.cycles)),
            ("wall time", f"{wall:.1f} s"),
            ("restarts", f"{len([e for e in job.events if e['kind'] == 'restart'])}" +
             (f" of {job.max_restarts}" if job.max_restarts is not None else "")),
            ("generated", time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))]
    out = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>ft_launcher report: {e(job.run_id)}</title>"
           f"<style>{_CSS}</style></head><body>",
           f"<h1>ft_launcher report: job {e(job.run_id)}</h1>",
           f"<p class='big' id='goodput'>goodput {job.goodput * 100:.1f}%</p>",
           f"<p id='goodput-parts'>{e(goodput_words(job))} ({job.world_size} ranks x {wall:.1f} s wall time). "
           "Goodput counts completed <code>step</code> sections that were never redone: steps after the "
           "checkpoint (or live-state step) a restart resumed from are done again.</p>",
           "<table id='summary'>" + "".join(f"<tr><th>{e(str(k))}</th><td>{e(str(v))}</td></tr>" for k, v in rows)
           + "</table>",
           "<h2>Timeline</h2>",
           f"<img id='timeline' alt='timeline' style='max-width:100%' src='data:image/png;base64,"
           f"{base64.b64encode(png).decode()}'>",
           (f"<p id='tail'>{e(tail_words(job))}.</p>" if job.tail else ""),
           f"<h2>Incidents ({len(job.incidents)})</h2>"]
    if job.incidents:
        out.append("<table id='incidents'><tr><th>cycle</th><th>at</th><th>rank</th><th>what happened</th>"
                   "<th>cause</th><th>noticed by</th><th>after</th><th>stack dumps</th><th>flight recorder</th>"
                   "<th>what was done</th>"
                   "<th>every rank stepping again after</th><th>resumed</th></tr>")
        for inc in job.incidents:
            out.append(
                f"<tr class='incident'><td>{inc.cycle}</td><td class='num'>+{inc.fault_time - job.start:.1f} s</td>"
                f"<td>{e(str(inc.rank))} (node {e(str(inc.node))})</td><td>{e(inc.what)}</td><td>{e(inc.cause)}</td>"
                f"<td>{e(inc.noticed_by)}</td><td class='num detected'>{inc.detected_after:.2f} s</td>"
                f"<td class='stacks'>{'<br>'.join(_stack_link(p, job.dirs, out_dir) for p in inc.stack_dumps) or '-'}</td>"
                f"<td class='flight-recorder'>{e(inc.flight_recorder or '-')}</td><td>{e(inc.action)}</td><td class='num recovery'>{fmt(inc.recovery)}</td>"
                f"<td class='resumed'>{e(inc.resumed or '-')}</td></tr>")
        out.append("</table>")
    else:
        out.append("<p>None: no cycle ended in a failure.</p>")
    out.append("<h2>Cycles</h2><table id='cycles'><tr><th>cycle</th><th>started</th><th>ended</th><th>ranks</th>"
               "<th>every rank stepping</th></tr>")
    for number, c in sorted(job.cycles.items()):
        stepping = "-" if c["stepping"] is None else f"+{c['stepping'] - job.start:.1f} s ({c['stepping'] - c['start']:.2f} s after its start)"
        out.append(f"<tr><td>{number}</td><td>+{c['start'] - job.start:.1f} s</td><td>+{c['end'] - job.start:.1f} s</td>"
                   f"<td>{c['world_size']}</td><td>{e(stepping)}</td></tr>")
    out.append("</table><h2>Time in step per rank</h2><table id='ranks'><tr><th>rank</th><th>seconds in step</th>"
               "<th>steps redone (seconds)</th><th>seconds in steps never redone</th><th>share of wall time</th></tr>")
    for rank, secs in sorted(job.step_seconds.items()):
        steps, lost = job.redone.get(rank, [0, 0.0])
        kept = job.useful_seconds.get(rank, 0.0)
        out.append(f"<tr><td>{rank}</td><td class='num'>{secs:.1f}</td><td class='num'>{steps} ({lost:.1f})</td>"
                   f"<td class='num'>{kept:.1f}</td><td class='num'>{kept / max(wall, 1e-9) * 100:.1f}%</td></tr>")
    out.append("</table><h2>Timeout changes</h2>")
    if job.timeout_changes:
        out.append("<table id='timeouts'><tr><th>cycle</th><th>timeout</th><th>old</th><th>new</th><th>why</th></tr>")
        for c in job.timeout_changes:
            out.append(f"<tr><td>{c['cycle']}</td><td>{e(str(c['key']))}</td><td>{e(num(c['old']))}</td>"
                       f"<td>{e(num(c['new']))}</td><td>{e(c['why'])}</td></tr>")
        out.append("</table>")
    else:
        out.append("<p>No computed timeout changed (computed timeouts are on with <code>--ft-calc-ft-timeouts true</code>).</p>")
    for note in job.notes:
        out.append(f"<p><i>{e(note)}</i></p>")
    out.append("</body></html>\n")
    return "\n".join(out)


