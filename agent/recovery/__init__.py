"""Recovery decisions: what ended a cycle (the supervisor, typed failures), who hung and where
(hang blame, flight recorder), whether the node is fit (health checks), and the verdict: which rung
of the ladder the job takes, or stopping for good (restart policy, no_restart). Simulated faults
and the live-recovery news live here too."""
