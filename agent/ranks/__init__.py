"""The node's processes: the ranks (environment, start, exit, stop within a bound), their rank
monitors, the warm reserves that replace a rank, the ranks carried into the next cycle in their
own process, the orphan watchdog, and where each rank's output goes."""
