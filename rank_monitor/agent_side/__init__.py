"""Code that runs in the agent: its handle on one rank monitor process (spawn, channel, reports)."""
