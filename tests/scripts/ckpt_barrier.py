"""A rank without torch whose checkpoint ends in a barrier, for the report's steps-redone count.

    python ckpt_barrier.py DIR STEPS CKPT_EVERY HANG_RANK HANG_STEP [--restartable]

Every step is a `step` section (10 ms); after every CKPT_EVERY-th step each rank enters
`checkpointing`: rank 0 writes DIR/ckpt.txt (the step), then every rank writes its mark for that
step and waits in the section until every rank's mark is there: a file barrier, which a peer that
never comes leaves waiting without an error (as a collective with a long timeout). In cycle 0,
rank HANG_RANK hangs in step HANG_STEP (it sleeps: only its step timeout finds it), so with
HANG_STEP a multiple of CKPT_EVERY rank 0 has written that step's checkpoint and waits for it in
the barrier. Each cycle resumes after the step in DIR/ckpt.txt; each rank appends
`cycle step` to DIR/progress_<rank>.txt per completed step. --restartable: under ft.restartable
(in-place restarts).
"""
import os
import sys
import time

import ft_launcher as ft

out, steps, every, hang_rank, hang_step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \
    int(sys.argv[5])


def train():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cycle = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    ckpt = os.path.join(out, "ckpt.txt")
    start = int(open(ckpt).read()) if os.path.exists(ckpt) else 0
    with open(os.path.join(out, f"progress_{rank}.txt"), "a", buffering=1) as progress:
        for step in range(start + 1, steps + 1):
            with ft.section("step"):
                time.sleep(0.01)
                if cycle == 0 and rank == hang_rank and step == hang_step:
                    while True:
                        time.sleep(3600)
            progress.write(f"{cycle} {step}\n")
            ft.heartbeat()
            if step % every == 0:
                with ft.section("checkpointing"):
                    if rank == 0:
                        with open(ckpt + ".tmp", "w") as fh:
                            fh.write(str(step))
                        os.replace(ckpt + ".tmp", ckpt)
                    open(os.path.join(out, f"mark_{step}_{rank}"), "w").close()
                    while not all(os.path.exists(os.path.join(out, f"mark_{step}_{r}")) for r in range(world)):
                        time.sleep(0.01)


os.makedirs(out, exist_ok=True)
(ft.restartable(train) if "--restartable" in sys.argv[6:] else train)()
