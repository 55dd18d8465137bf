"""Code that runs in a rank monitor process: the deadline-driven RankMonitorServer."""
