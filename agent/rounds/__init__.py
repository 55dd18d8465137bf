"""Rounds and the store: the job-wide TCPStore, the round protocol the agents run on it (join,
close, interrupt, verdicts), keep-alive, the move to a successor store when its host is lost, and
what the infrastructure (SLURM, NVLink segments) says about a node's place."""
