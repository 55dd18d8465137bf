"""Code that runs inside a training rank: the client (shm_attachment: the rank's mapping of its
monitor's record; sections: the hot path, sections and heartbeats; nvrx_api: NVRx's
RankMonitorClient; preemption; warn_once), in-process restart, live state (live/), the exception hook and
the import record for warm reserves."""
