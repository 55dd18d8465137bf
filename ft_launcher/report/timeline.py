"""The report's timeline, drawn with matplotlib (an optional dependency: `ft_launcher[report]`):
one lane per rank, one bar per cycle: grey while starting, green while stepping, orange where the
failed rank hung (from its hung section's entry), yellow where the other ranks waited on the
failure (from the fault to their stop); the downtime (fault to every rank stepping again) shaded
red; the tail after the last rank ended labelled with what it was.

Markers sit where they do not cover each other: the fault and the hang above the bar, the
failure on it, the stack dump below it; the hang drawn last, with an edge, so that no bar or
marker hides it.
"""
from __future__ import annotations

import io
from typing import List, Tuple

from ft_launcher.report.analysis import Job

GREY, GREEN, ORANGE, WAIT, RED, BLUE = "#c7c7c7", "#2ca02c", "#ff7f0e", "#e6c229", "#d62728", "#1f77b4"
BAR = 0.55
# event kind -> (marker, colour, size in points^2, offset from the lane's centre, z-order)
MARKS = {"fault_injected": ("X", RED, 90, 0.42, 7), "hang": ("v", ORANGE, 80, 0.42, 8),
         "stack_dump": ("D", "#9467bd", 30, -0.42, 6), "failure": ("o", "#000000", 40, 0.0, 6)}


def _hung_spans(job: Job, index: dict) -> List[Tuple[float, float, int]]:
    """(from, to, lane) for every hang: from the hung section's entry to the end of the rank's bar."""
    spans = []
    for h in (e for e in job.events if e["kind"] == "hang"):
        y = index.get((h["node"], h.get("rank")))
        bar = next((b for b in job.bars if (b["node"], b["rank"], b["cycle"]) == (h["node"], h.get("rank"), h["cycle"])),
                   None)
        if y is None or bar is None:
            continue
        since = h["time"] - float(h["detail"].get("elapsed") or 0.0)
        if since < bar["end"]:
            spans.append((since, bar["end"], y))
    return spans


def timeline_figure(job: Job):
    """The timeline as a matplotlib figure (the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    lanes = job.lanes or [(n, 0) for n in job.nodes]
    index = {lane: i for i, lane in enumerate(lanes)}
    height = 1.6 + 0.55 * len(lanes)
    fig, ax = plt.subplots(figsize=(12, height), dpi=110)
    t0 = job.start
    for inc in job.incidents:  # downtime: from the fault to every rank stepping again
        stop = inc.recovered_time if inc.recovered_time is not None else job.end
        ax.axvspan(inc.fault_time - t0, stop - t0, color=RED, alpha=0.13, lw=0)
    hung = _hung_spans(job, index)
    for bar in job.bars:
        y = index.get((bar["node"], bar["rank"]))
        if y is None:
            continue
        first = bar["first_step"] if bar["first_step"] is not None and bar["first_step"] < bar["end"] else None
        ax.barh(y, (first or bar["end"]) - bar["start"], left=bar["start"] - t0, height=BAR, color=GREY,
                edgecolor="none")
        if first is not None:
            ax.barh(y, bar["end"] - first, left=first - t0, height=BAR, color=GREEN, edgecolor="none")
            if bar.get("steps"):   # the label in the part that stepped
                stalled = [s for s in job.waiting if (s["node"], s["rank"], s["cycle"]) == (bar["node"], bar["rank"], bar["cycle"])]
                stalled += [{"start": a} for a, b, yy in hung if yy == y and bar["start"] <= a < bar["end"]]
                until = min([s["start"] for s in stalled] + [bar["end"]])
                ax.text((first + max(first, until)) / 2 - t0, y, f"{bar['steps']} step{'s' if bar['steps'] != 1 else ''}",
                        fontsize=7, color="white", ha="center", va="center", clip_on=True)
    for span in job.waiting:   # blocked on the failure: no step of theirs could complete
        y = index.get((span["node"], span["rank"]))
        if y is not None:
            ax.barh(y, span["end"] - span["start"], left=span["start"] - t0, height=BAR, color=WAIT, edgecolor="none")
    for since, end, y in hung:  # a hung rank is not stepping: from its section's entry
        ax.barh(y, end - since, left=since - t0, height=BAR, color=ORANGE, edgecolor="none")
    if job.tail:
        ax.axvspan(job.tail["start"] - t0, job.tail["end"] - t0, color="#888888", alpha=0.08, lw=0)
        ax.text((job.tail["start"] + job.tail["end"]) / 2 - t0, -0.55, "after the ranks:\n" + _tail_label(job),
                fontsize=7, color="#444444", ha="center", va="bottom")
    for i, (number, c) in enumerate(sorted(job.cycles.items())):  # labels alternate in height
        ax.axvline(c["start"] - t0, color="#555555", lw=0.8, ls=":")
        ax.text(c["start"] - t0, len(lanes) - 0.45 + 0.25 * (i % 2), f" cycle {number}", fontsize=8, va="bottom",
                color="#333333")
    for e in job.events:
        if e["kind"] not in MARKS:
            continue
        marker, color, size, offset, z = MARKS[e["kind"]]
        rank = e.get("rank")
        ys = [index[(e["node"], rank)]] if (e["node"], rank) in index else \
            [i for (n, _), i in index.items() if n == e["node"]][:1]
        for y in ys:
            ax.scatter(e["time"] - t0, y + offset, marker=marker, s=size, color=color, zorder=z,
                       edgecolors="black" if e["kind"] == "hang" else "none", linewidths=0.6, gid=e["kind"])
    for e in (e for e in job.events if e["kind"] == "restart"):
        ax.axvline(e["time"] - t0, color=BLUE, lw=1.2, ls="--")
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([f"node {n} rank {r}" for n, r in lanes], fontsize=9)
    ax.set_ylim(-0.75, len(lanes) + 0.1)
    ax.set_xlim(0, max(1.0, job.end - t0) * 1.01)
    ax.set_xlabel("seconds since the first cycle started")
    ax.grid(axis="x", alpha=0.3)
    handles = [Patch(color=GREY, label="starting (no step yet)"), Patch(color=GREEN, label="stepping"),
               Patch(color=ORANGE, label="hung (no step completes)"),
               Patch(color=WAIT, label="waiting on the failure (blocked)"),
               Patch(color=RED, alpha=0.2, label="downtime (fault -> all stepping)"),
               Line2D([], [], marker="X", color=RED, ls="", label="fault injected"),
               Line2D([], [], marker="v", color=ORANGE, markeredgecolor="black", ls="", label="hang detected"),
               Line2D([], [], marker="D", color="#9467bd", ls="", label="stack dump"),
               Line2D([], [], marker="o", color="#000000", ls="", label="failure"),
               Line2D([], [], color=BLUE, ls="--", label="restart")]
    if job.tail:
        handles.append(Patch(color="#888888", alpha=0.2, label="after the ranks ended"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.set_title(f"job {job.run_id}: {job.state}, goodput {job.goodput * 100:.1f}%"
                 + (" (no `step` section)" if job.no_step else ""), fontsize=10)
    return fig


def _tail_label(job: Job) -> str:
    return "flight-recorder analysis" if "flight recorder" in job.tail["why"] else "agents finishing"


def timeline_png(job: Job) -> bytes:
    import matplotlib.pyplot as plt

    fig = timeline_figure(job)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()
