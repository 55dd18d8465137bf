"""What a rank sees in its environment in the cycle after a rank exited 16 ("resume to
disambiguate on a different GPU", Megatron's rerun state machine; the SDC guard's "move the suspect
to other hardware"). The agent sets them (agent.recovery.rerun_exits decides, agent.ranks.node_ranks
places); every rank of that cycle gets the first three, a rank that was moved also the last.

- `FT_LAUNCHER_RERUN_OF`: the cycle whose rank exited 16, then the checkpoint iteration it was at
  when the agent knows it (`checkpoint_iteration_file`), e.g. `3` or `3:1370`.
- `FT_LAUNCHER_RERUN_RANK`: the global rank that exited 16.
- `FT_LAUNCHER_RERUN_SUSPECT`: the hardware it exited on, `<host>:<device>` (device: the entry of
  CUDA_VISIBLE_DEVICES at its slot, else the slot's index, which is LOCAL_RANK).
- `FT_LAUNCHER_RERUN_MOVED`: on a rank placed on other hardware for this re-run, the hardware it left
  (`<host>:<device>`); it now runs on its slot's device (LOCAL_RANK), on its node or a spare.
Nothing is set in a cycle that does not follow a 16. Free of torch; read them with os.environ.
"""

ENV_RERUN_OF = "FT_LAUNCHER_RERUN_OF"
ENV_RERUN_RANK = "FT_LAUNCHER_RERUN_RANK"
ENV_RERUN_SUSPECT = "FT_LAUNCHER_RERUN_SUSPECT"
ENV_RERUN_MOVED = "FT_LAUNCHER_RERUN_MOVED"
ALL = (ENV_RERUN_OF, ENV_RERUN_RANK, ENV_RERUN_SUSPECT, ENV_RERUN_MOVED)
