"""What the operator and the job's tools see: one line and one events.jsonl object per event, the
status file and Prometheus gauges, stragglers, section use, timeouts learned across the job, and
NVRx's log and cycle-info layouts."""
