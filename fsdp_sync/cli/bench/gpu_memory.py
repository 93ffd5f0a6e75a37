"""CUDA memory of a bench row: the trainer's and the engine's allocator peaks during one sync.

/proc's RSS says nothing of GPU memory, so a CUDA row is measured by torch's allocator: before the
sampled sync every counter restarts (this process, and each engine worker through
`ReferenceEngine.reset_peak_memory_stats`), after it the peak minus the level before is the rise,
allocated (what tensors held) and reserved (what the caching allocator took from the device). The
trainer's allocated rise is held to the same budget rule as a CPU row's RSS rise.

Not here: the sync itself (`main`), host memory (`sampling`).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["CudaPeaks"]

MiB = 2**20


class CudaPeaks:
    """``start`` before the sync, ``finish`` after it; both on every rank (each measures its own
    process; the engine is measured where it is held)."""

    def __init__(self, engine: Any | None) -> None:
        self.engine = engine if hasattr(engine, "reset_peak_memory_stats") else None
        self.before: dict = {}

    def start(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.before = {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}
        if self.engine is not None:
            self.engine.reset_peak_memory_stats()
            self.before["engine"] = [w.get("cuda", {}) for w in self.engine.memory_stats()["workers"]]

    def finish(self, budget_bytes: int | None = None) -> dict:
        torch.cuda.synchronize()
        out = {
            "trainer_peak_allocated_mib": (torch.cuda.max_memory_allocated() - self.before["allocated"]) / MiB,
            "trainer_peak_reserved_mib": (torch.cuda.max_memory_reserved() - self.before["reserved"]) / MiB,
        }
        if self.engine is not None:
            after = [w.get("cuda", {}) for w in self.engine.memory_stats()["workers"]]
            out["engine_peak_allocated_mib"] = max(
                (a.get("max_allocated", 0) - b.get("allocated", 0)) / MiB for a, b in zip(after, self.before["engine"]))
            out["engine_peak_reserved_mib"] = max(
                (a.get("max_reserved", 0) - b.get("reserved", 0)) / MiB for a, b in zip(after, self.before["engine"]))
        if budget_bytes is not None:
            out["trainer_within_budget"] = out["trainer_peak_allocated_mib"] * MiB <= budget_bytes
        return out
