"""Per-rank hang detection: the RankMonitorServer beside each rank, the client the training
script uses, sections, heartbeats, timeouts and ft_state.json. Internal: users import ft_launcher.

Split by the process the code runs in (docs/architecture.md):
- `rank_side/`: inside a training rank (the client's hot path, NVRx's RankMonitorClient, in-process
  restart, live state, the exception hook);
- `monitor_side/`: in a rank monitor process (the deadline-driven server, NVRx's socket peers);
- `agent_side/`: in the agent (its handle on one monitor process);
- `config/`: the fault-tolerance configuration, every key declared once.
The modules at this level are what more than one of those processes read or write: the shared
memory layout, the wire formats and restricted unpickling, ft_state.json, timeouts, atomic files."""
