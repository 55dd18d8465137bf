"""The per-node agent: rendezvous on torch's TCPStore, spawning ranks and monitors, restarts.
Internal: users import ft_launcher.

`agent.py` runs the node's life (the loop over rounds, signals, exit codes) and orchestrates four parts,
one folder each (docs/architecture.md draws them):
- `rounds/`: the job's store and the round protocol the agents run on it (join, close, interrupt,
  verdict), keep-alive, the move to a successor store, and elastic's room (`elastic.py`: MIN/MAX,
  shrink, grow, the spare's wait);
- `ranks/`: the node's processes: ranks, their monitors, warm reserves, ranks carried in place;
- `recovery/`: one cycle and what follows it: `node_cycle.py` (a cycle run, a spare's wait),
  supervisor, failure causes, hang blame, health checks, the one decider (the restart policy) and
  `cycle_end.py` (the outcome in, a typed next step out);
- `observation/`: what the operator and tools read: events, status, metrics, stragglers.
Beside them: `launch_config.py` (what the command line asked for) and `node_state.py` (the
node's states and the allowed changes)."""
