"""Section timeouts that protect nothing: said once per agent, early.

A section timeout only applies while a rank is inside that section (`ft_launcher.section(...)`).
A script that never enters one (it does not use the API, or calls it under other names) runs
unprotected by them, and a hang outside sections is found only by the out-of-section or heartbeat
timeouts, if any is set. When section timeouts are configured and no rank of this node has entered
any section `NO_SECTION_AFTER` seconds after its ranks started (a cycle's start: any script that
marks sections has entered its first, usually 'setup', by then), one line says so and what still
protects the ranks. Once said, or once a section is seen, it is never checked again: reading the
ranks' records costs nothing on their side, and nothing here runs once settled.
"""
from __future__ import annotations

import time
from typing import Optional

NO_SECTION_AFTER = 10.0   # seconds after a cycle's ranks started


def entered_a_section(monitor) -> bool:
    live = monitor.live()
    return bool(live) and any(s["enters"] for s in live["sections"].values())


class SectionUse:
    def __init__(self, events):
        self.events = events
        self.settled = False
        self.deadline: Optional[float] = None

    def cycle_start(self) -> None:
        if not self.settled:
            self.deadline = time.monotonic() + NO_SECTION_AFTER

    def poll(self, monitors: list, ft) -> None:
        if self.settled or self.deadline is None:
            return
        timed = {name: t for name, t in ft.rank_section_timeouts.items() if t}
        if not timed or any(entered_a_section(m) for m in monitors):
            self.settled = bool(timed)   # none configured yet: one may be learned or loaded later
            return
        if time.monotonic() < self.deadline:
            return
        self.settled = True
        shown = ", ".join(f"{name} {t:g} s" for name, t in sorted(timed.items()))
        if ft.rank_out_of_section_timeout:
            rest = f"outside them the out-of-section timeout ({ft.rank_out_of_section_timeout:g} s) applies"
        elif ft.rank_heartbeat_timeout or ft.initial_rank_heartbeat_timeout:
            rest = "outside them only the heartbeat timeouts find a hang"
        else:
            rest = "nothing finds a hang outside them (no out-of-section or heartbeat timeout is set)"
        self.events.event("no_section_entered", f"warning: no rank on this node has entered a section "
                          f"{NO_SECTION_AFTER:g} s after its start: the section timeouts ({shown}) apply "
                          f"only inside ft_launcher.section(...) blocks; {rest}",
                          after=NO_SECTION_AFTER, sections=sorted(timed))
