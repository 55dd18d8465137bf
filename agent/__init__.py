"""The per-node agent: rendezvous on torch's TCPStore, spawning ranks and monitors, restarts.
Internal: users import ft_launcher."""
