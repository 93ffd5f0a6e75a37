"""The rollout's random streams: `FSDPShardingManager`'s ``swap_rng`` and ``restore_rng`` stages.

Generation draws from its own stream, seeded ``SyncConfig.seed + dp rank`` (equal on the TP ranks
of a group, so they sample the same tokens); on entry the trainer's stream is kept and the
generation one put in its place, on exit the generation one is kept for the next block and the
trainer's put back.

What is swapped: torch's CPU generator and, where CUDA is initialized, the current CUDA device's
(the generation stream's CUDA half exists where CUDA was initialized when the manager was made).
Not swapped: Python's `random` and numpy's generators, and other CUDA devices': draws from those
inside the block go on in the trainer's streams.

Making the generation stream touches no global generator: it is seeded on private
`torch.Generator` objects, so the trainer's CPU and CUDA states, every CUDA device's, and a seed
torch queued for CUDA's lazy initialization (``torch.manual_seed`` before CUDA starts) are left
as they were. (``torch.manual_seed`` would seed every CUDA device, or queue that seed in place of
the trainer's.)

Not here: when the stages run, and their agreement across ranks (the manager).
"""

from __future__ import annotations

import torch

__all__ = ["RolloutRng", "fresh_states", "current_states", "set_states"]


def _cuda_live() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def fresh_states(seed: int) -> tuple:
    """``(CPU state, current CUDA device's state or None)`` as ``torch.manual_seed(seed)`` would
    leave them, made on private generators: no global generator is touched."""
    cpu = torch.Generator().manual_seed(seed).get_state()
    cuda = None
    if _cuda_live():
        device = torch.device("cuda", torch.cuda.current_device())
        cuda = torch.Generator(device=device).manual_seed(seed).get_state()
    return cpu, cuda


def current_states() -> tuple:
    """The live ``(CPU state, current CUDA device's state or None)``."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state() if _cuda_live() else None)


def set_states(states: tuple) -> None:
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1])


class RolloutRng:
    """The generation stream and, while a ``with`` block runs, the trainer's (module docstring)."""

    def __init__(self, seed: int) -> None:
        self.generation = fresh_states(seed)
        self.trainer: tuple | None = None

    def swap(self) -> None:
        """Keep the trainer's stream; make the generation one live."""
        if self.trainer is None:
            self.trainer = current_states()
        else:       # the last block's restore did not run: the trainer's is still kept, and
            self.generation = current_states()     # the live stream is the generation one
        set_states(self.generation)

    def restore(self) -> None:
        """Keep the generation stream for the next block; make the trainer's live again."""
        if self.trainer is not None:
            self.generation = current_states()
            set_states(self.trainer)
            self.trainer = None
