"""Per-rank hang detection: the RankMonitorServer beside each rank, the client the training
script uses, sections, heartbeats, timeouts and ft_state.json. Internal: users import ft_launcher."""
