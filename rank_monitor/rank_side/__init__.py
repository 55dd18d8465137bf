"""Code that runs inside a training rank: the client (sections, heartbeats, NVRx's API), in-process
restart, live state, the exception hook and the import record for warm reserves."""
