"""Live state, in the training rank: `ft.LiveState` (live_state), each object's committed state
(live_objects), the wire and digests (live_wire), who heals from whom (live_plan), buddy copies in
a peer's host memory (buddy_copy), a commit that counts once its GPU work is done (gpu_commit), and
torch's DTensor caches forgotten at a restart (dtensor_cycle). The user guide is docs/live-state.md."""
