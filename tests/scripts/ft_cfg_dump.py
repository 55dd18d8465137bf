"""Rank script: write the fault-tolerance configuration this rank received from the launcher
(RankMonitorClient.cfg, as the rank monitor hands it over) to <out dir>/cfg_<RANK>.json."""
import dataclasses
import json
import os
import sys

from ft_launcher import RankMonitorClient

client = RankMonitorClient()
client.init_workload_monitoring()
cfg = dataclasses.asdict(client.cfg)
cfg["rank_termination_signal"] = int(cfg["rank_termination_signal"])
with open(os.path.join(sys.argv[1], f"cfg_{os.environ['RANK']}.json"), "w") as fh:
    json.dump(cfg, fh)
