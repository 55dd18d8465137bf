"""ft_launcher's public API for training scripts: sections, heartbeats and NVRx's client.

Re-exports only; the implementation is rank_monitor.client. The same calls are cheap no-ops
(after one warning) when the script is not running under ft_launcher.
"""
from rank_monitor.client import FtSectionWarning, RankMonitorClient, heartbeat, section

__version__ = "0.1.0"

__all__ = ["section", "heartbeat", "RankMonitorClient", "FtSectionWarning"]
