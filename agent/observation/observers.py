"""The node's observers, as one part of the agent: what the operator sees of this node's job.

It holds each observer (they keep their own jobs) and calls them at a cycle's phases:
- `status` (agent.observation.job_status): the status file, stepping and cycle summaries;
- `live_news` (agent.observation.live_recovery): what the ranks' `LiveState.restore()` did;
- `section_use` (agent.observation.section_use): sections the script never uses;
- `stragglers` (agent.observation.stragglers): slow ranks and nodes;
- `learner` (agent.observation.timeout_learning): computed timeouts and ft_state.json;
- NVRx's cycle-info file (agent.observation.nvrx_cycle_info), written by group rank 0.
The agent keeps the decisions; this part only watches and tells.
"""
from __future__ import annotations

from typing import Optional

from ft_launcher.agent.observation import nvrx_cycle_info, nvrx_logs
from ft_launcher.agent.observation.job_status import JobStatus
from ft_launcher.agent.observation.section_use import SectionUse
from ft_launcher.agent.observation.stragglers import StragglerWatch
from ft_launcher.agent.observation.timeout_learning import TimeoutLearner, default_state_path
from ft_launcher.agent.observation import live_recovery


class Observers:
    def __init__(self, cfg, events, metrics=None) -> None:
        self.cfg = cfg
        self.events = events
        self.status = JobStatus(cfg, events)   # status file, stepping/cycle_summary events
        self.live_news = live_recovery.News(self.status, events)   # what the ranks' LiveState.restore() did
        if metrics is not None:
            metrics.attach(events, lambda: self.status.snapshot)
        self.section_use = SectionUse(events)
        self.stragglers = StragglerWatch(cfg.ft, events)
        self.learner = TimeoutLearner(cfg.ft, default_state_path(cfg.ft, cfg.log_dir), events)
        self.cycle_info: Optional[nvrx_cycle_info.CycleInfoWriter] = None

    def cycle_starting(self, rnd) -> None:
        """Before the cycle's ranks start: NVRx's cycle info (group rank 0), the live news' cycle."""
        cfg = self.cfg
        if rnd.group_rank == 0 and cfg.ft.cycle_info_dir:
            if self.cycle_info is None:
                self.cycle_info = nvrx_cycle_info.CycleInfoWriter(cfg.ft.cycle_info_dir, self.events.disk_warning)
            self.cycle_info.start(rnd.number, rnd.active, rnd.spares, cfg.applog_prefix and
                                  nvrx_logs.cycle_log_file(cfg.applog_prefix, rnd.number))
        self.live_news.begin_cycle(rnd.number, rnd.rank_offset)

    def ranks_started(self, rnd, restarts: int, group, monitors) -> None:
        self.section_use.cycle_start()
        self.status.cycle_start(rnd, restarts, group, monitors)

    def poll(self, monitors) -> None:
        """Every pass of the agent's loop while ranks run."""
        self.status.sample()
        self.live_news.poll(monitors)
        self.section_use.poll(monitors, self.cfg.ft)

    def cycle_ended(self) -> None:
        """The cycle's summary and NVRx's cycle info are closed."""
        self.status.cycle_end()
        if self.cycle_info is not None:
            self.cycle_info.end()
