"""The reference engine's GPU placement and CUDA memory calls (a mixin of `ReferenceEngine`).

Where its workers run (``base_gpu_id``, as SGLang's ``--base-gpu-id``) and the allocator peaks a
bench row reads. Not here: the workers' own CUDA memory (`regions`), starting them (`procs`).
"""

from __future__ import annotations

import torch

__all__ = ["GPUCalls"]


class GPUCalls:
    """Needs ``device``, ``tp_size``, ``base_gpu_id`` and ``_per_worker`` of the engine."""

    def gpu_ids(self) -> list[int]:
        """The CUDA device index of each TP worker, as this process numbers them ([] on CPU)."""
        n = torch.cuda.device_count() if self.device == "cuda" else 0
        return [(self.base_gpu_id + i) % n for i in range(self.tp_size)] if n else []

    def reset_peak_memory_stats(self) -> None:
        """CUDA workers: restart the allocator's peaks (`memory_stats`' ``max_allocated``/``max_reserved``)."""
        self._per_worker("reset_peak_memory")
