"""The RNG state as a LiveState object (`rng=True`): torch's CPU generator, the current device's
CUDA generator and Python's `random`, and what of it replicas must agree on."""
from __future__ import annotations

NAME = "_rng"   # its name among a LiveState's objects


class Rng:
    """The RNG state as of the last commit (torch's CPU generator, the CUDA generator of the rank's
    current device, Python's `random`): a LiveState object (`rng=True`, the default). Its
    state_dict() is a new snapshot each call (new tensors, an immutable tuple): Tracked keeps it
    without a copy.

    CUDA: the current device's generator only (torch.cuda.current_device(), the one the rank set and
    draws from). The launcher leaves CUDA_VISIBLE_DEVICES whole, so every rank sees every GPU of its
    node and the generators of the others are its neighbours' streams: kept and compared, replicas
    on different GPUs would never agree (every heal would fail its check). Loaded into the loading
    rank's own current device.

    Python's `random` is often left unseeded (scripts seed torch), so each rank's state differs,
    from os.urandom, while nothing draws from it. Its state is marked `python_drawn` once it has
    changed between two snapshots (a draw since the first commit; a restored mark is kept). A
    stream nothing drew from is not loaded (the rank keeps the state its own start gave it: a
    replaced rank ran the script's seeding, if any, as its fault-free self did, and an unseeded one
    is as good as any) and not compared between replicas (`unused`); one that was drawn from is
    loaded and compared as the torch streams are, so per-rank streams still fall back."""

    def __init__(self) -> None:
        self._python_last = None     # Python's state at the last snapshot or load
        self._python_drawn = False   # it changed between two of them (or the loaded state says so)

    def state_dict(self) -> dict:
        import random

        import torch

        python = random.getstate()
        if self._python_last is not None and python != self._python_last:
            self._python_drawn = True
        self._python_last = python
        state = {"torch": torch.get_rng_state(), "python": python, "python_drawn": self._python_drawn}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
        return state

    def load_state_dict(self, state: dict) -> None:
        import random

        import torch

        torch.set_rng_state(state["torch"].cpu())
        self._python_drawn = bool(state.get("python_drawn", True))
        if self._python_drawn:
            random.setstate(state["python"])
        self._python_last = random.getstate()
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"].cpu(), torch.cuda.current_device())

    @staticmethod
    def unused(state: dict) -> dict:
        """`state` without Python's stream where nothing drew from it (what replicas must agree on)."""
        if isinstance(state, dict) and state.get("python_drawn") is False:
            return {k: v for k, v in state.items() if k != "python"}
        return state
