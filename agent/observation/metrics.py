"""The node's Prometheus endpoint (`--metrics-port PORT`, off by default), served by
`prometheus_client` from a thread of the agent, on its own registry.

Counters and histograms come from the agent's events (one listener on the EventLog); section
times, goodput, cycle and timeouts come from the status snapshot (agent.observation.job_status) when scraped.
Nothing here runs on a rank. Metrics (every series labelled by this node's host):
- `ft_launcher_restarts_total`, `ft_launcher_failures_total`, `ft_launcher_hangs_total`
- `ft_launcher_recovery_seconds` (histogram): a failure noticed by this node -> its ranks stepping again
- `ft_launcher_section_seconds{section,rank}` (summary: `_sum` and `_count` of completed sections)
- `ft_launcher_goodput_ratio`: seconds in `step` that survived (steps redone after a restart from
  a checkpoint left out; agent.observation.job_status) over the agent's wall time (mean of local ranks)
- `ft_launcher_cycle`, `ft_launcher_restarts_used`, `ft_launcher_section_timeout_seconds{section}`
"""
from __future__ import annotations

import socket
from typing import Callable, Optional

RECOVERY_BUCKETS = (0.25, 0.5, 1, 2, 3, 5, 10, 20, 30, 60, 120, 300, 600)


class MetricsUnavailable(RuntimeError):
    """prometheus_client is missing, or the port cannot be bound (one line for the operator)."""


class Metrics:
    def __init__(self, port: int, host: str = "0.0.0.0"):
        try:
            from prometheus_client import (CollectorRegistry, Counter, Histogram, disable_created_metrics,
                                           start_http_server)
        except ImportError:
            raise MetricsUnavailable("--metrics-port needs prometheus_client (pip install prometheus_client)") from None
        disable_created_metrics()  # no `_created` twin per series: this process serves only this endpoint
        self.registry = CollectorRegistry(auto_describe=True)
        node = socket.gethostname()
        self.restarts = Counter("ft_launcher_restarts", "restarts this node took part in",
                                ["host"], registry=self.registry).labels(node)
        self.failures = Counter("ft_launcher_failures", "failures this node noticed (a rank's exit, a hang, a lost peer)",
                                ["host"], registry=self.registry).labels(node)
        self.hangs = Counter("ft_launcher_hangs", "hangs this node's monitors detected",
                             ["host"], registry=self.registry).labels(node)
        self.recovery = Histogram("ft_launcher_recovery_seconds",
                                  "a failure noticed by this node -> every local rank stepping again",
                                  ["host"], buckets=RECOVERY_BUCKETS, registry=self.registry).labels(node)
        self.host = node
        self._snapshot: Callable[[], dict] = dict
        self.registry.register(_SnapshotCollector(self))
        try:
            self.server, self.thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise MetricsUnavailable(f"--metrics-port {port}: cannot listen: {exc.strerror or exc}") from None
        self.port = self.server.server_port

    def attach(self, events, snapshot: Callable[[], dict]) -> None:
        """Count from `events`; serve the gauges from `snapshot()` (agent.observation.job_status)."""
        self._snapshot = snapshot
        events.listeners.append(self.on_event)

    def on_event(self, record: dict) -> None:
        kind, detail = record["kind"], record.get("detail") or {}
        if kind == "restart":
            self.restarts.inc()
        elif kind == "failure":
            self.failures.inc()
        elif kind == "hang":
            self.hangs.inc()
        elif kind == "stepping" and detail.get("after_failure") is not None:
            self.recovery.observe(detail["after_failure"])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _SnapshotCollector:
    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily, SummaryMetricFamily

        snap = self.metrics._snapshot() or {}
        host = self.metrics.host
        sections = SummaryMetricFamily("ft_launcher_section_seconds", "completed sections: seconds and count",
                                       labels=["host", "section", "rank"])
        for row in snap.get("section_totals", []):
            sections.add_metric([host, row["section"], str(row["rank"])], row["count"], row["total"])
        yield sections
        goodput = GaugeMetricFamily("ft_launcher_goodput_ratio", "seconds in steps never redone over wall time (local ranks)",
                                    labels=["host"])
        goodput.add_metric([host], float(snap.get("goodput", 0.0)))
        yield goodput
        cycle = GaugeMetricFamily("ft_launcher_cycle", "the job-wide restart cycle", labels=["host"])
        if snap.get("cycle") is not None:
            cycle.add_metric([host], snap["cycle"])
        yield cycle
        used = GaugeMetricFamily("ft_launcher_restarts_used", "restarts used of the job's budget",
                                 labels=["host", "max_restarts"])
        used.add_metric([host, str(snap.get("max_restarts", ""))], snap.get("restarts_used", 0))
        yield used
        timeouts = GaugeMetricFamily("ft_launcher_section_timeout_seconds", "section timeouts in effect",
                                     labels=["host", "section"])
        for name, value in ((snap.get("timeouts") or {}).get("sections") or {}).items():
            if value is not None:
                timeouts.add_metric([host, name], value)
        yield timeouts


def start(port: Optional[int]) -> Optional[Metrics]:
    return None if port is None else Metrics(port)
