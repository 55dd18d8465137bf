"""Live state, in the training rank: `ft.LiveState` (live_state), each object's committed state
(live_objects; each kind of object's form, live_kinds), the wire and digests (live_wire), who heals
from whom (live_plan), a restore's steps (step_exchange; restore_transfer, one transport per source:
transport; restore_verify; restore_report), buddy copies in a peer's host memory (buddy_copy), the
step guard (step_guard and what it reads). It stands on the rank's side below it (rank_side: the
in-place restart, a commit that counts once its GPU work is done, gpu_commit; torch's DTensor caches
forgotten at a restart, dtensor_cycle), which never imports it (tests/house/test_agent_layers.py).
The user guide is docs/live-state.md."""
