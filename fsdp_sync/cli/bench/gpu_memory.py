"""CUDA memory of a bench row: the trainer's and the engine's allocator peaks during the sync stage.

/proc's RSS says nothing of GPU memory, so a CUDA row is measured by torch's allocator, over the
``sync_weights`` stage alone, as a CPU row's RSS is (`sampling.rises`): `CudaPeaks` is put in the
manager's ``watch`` for that stage, so it is entered after the engine's weights were woken and left
before its KV cache is (neither is the sync's own memory). Entering restarts every peak (this
process's, and each engine worker's through `ReferenceEngine.reset_peak_memory_stats`) and reads the
levels; leaving reads the peaks: peak minus level is the rise, allocated (what tensors held) and
reserved (what the caching allocator took from the device). The colocated engine shares the
trainer's GPU, so the device's rise is at most the trainer's plus its GPU's engine worker's, and
that sum is held to the row's budget (`plan.memory_budget`, the rule `plan.engine_memory_budget`
gives the tensor method's engine); the trainer's rise alone is held to it too. A disaggregated
method's row (distributed, disk: `methods`) holds the trainer to its budget and each engine worker
to the engine's rule.

Not here: the sync itself (`main`), host memory (`sampling`).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["CudaPeaks"]

MiB = 2**20


class CudaPeaks:
    """A reusable context manager around one stage, on every rank (each measures its own process;
    the engine where it is held): ``manager.watch["sync_weights"] = peaks``, one sync, then
    ``peaks.result(budget)``. ``cuda`` is the allocator's API (``torch.cuda``; tests pass another)."""

    def __init__(self, engine: Any | None, cuda: Any = torch.cuda) -> None:
        if cuda is torch.cuda and not torch.cuda.is_available():
            # refused here, not at the stage: entering it there failed in torch ("Torch not compiled
            # with CUDA enabled", an AssertionError) and only result() told, after the sync
            raise RuntimeError("CudaPeaks measures torch.cuda's allocator and this process sees no CUDA "
                               "device (torch.cuda.is_available() is False); a CPU row's memory is "
                               "sampling.DeviceSampler's (RSS)")
        self.engine = engine if hasattr(engine, "reset_peak_memory_stats") else None
        self.cuda = cuda
        self.before: dict = {}
        self.rises: dict | None = None

    def __enter__(self) -> "CudaPeaks":
        self.cuda.synchronize()
        self.cuda.reset_peak_memory_stats()
        self.before = {"allocated": self.cuda.memory_allocated(), "reserved": self.cuda.memory_reserved()}
        if self.engine is not None:
            self.engine.reset_peak_memory_stats()
            self.before["engine"] = [w.get("cuda", {}) for w in self.engine.memory_stats()["workers"]]
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is not None:    # the stage failed: its error, not a measurement's, is the news
            self.rises = None
            return
        self.cuda.synchronize()
        out: dict[str, Any] = {
            "stage": "sync_weights",
            "trainer_peak_allocated_mib": (self.cuda.max_memory_allocated() - self.before["allocated"]) / MiB,
            "trainer_peak_reserved_mib": (self.cuda.max_memory_reserved() - self.before["reserved"]) / MiB,
        }
        if self.engine is not None:
            after = [w.get("cuda", {}) for w in self.engine.memory_stats()["workers"]]
            alloc = [(a.get("max_allocated", 0) - b.get("allocated", 0)) / MiB
                     for a, b in zip(after, self.before["engine"])]
            res = [(a.get("max_reserved", 0) - b.get("reserved", 0)) / MiB
                   for a, b in zip(after, self.before["engine"])]
            out.update(engine_peak_allocated_mib=max(alloc), engine_peak_reserved_mib=max(res),
                       engine_workers_peak_allocated_mib=alloc)
            here = self.cuda.current_device()
            mine = [j for j, a in enumerate(after) if a.get("device") == here]
            out["device_peak_allocated_mib"] = out["trainer_peak_allocated_mib"] + sum(alloc[j] for j in mine)
        else:
            out["device_peak_allocated_mib"] = out["trainer_peak_allocated_mib"]
        self.rises = out

    def result(self, budget_bytes: int | None = None, timeline: Any = None,
               engine_budget_bytes: int | None = None) -> dict:
        """The rises of the last stage measured, with ``budget_bytes``: ``trainer_within_budget``
        (the trainer's allocated rise) and ``within_budget``: colocated (the tensor method), the
        device's rise (trainer plus its GPU's engine worker, an upper bound as their peaks need
        not coincide) against ``budget_bytes``; with ``engine_budget_bytes`` (a disaggregated
        method's engine rule, `plan.engine_memory_budget`), the trainer against its budget and every
        engine worker against that. ``timeline``: the manager's, whose stage record says why a
        measurement failed (`memory.Timeline.watch`)."""
        if self.rises is None:
            why = [f"{s.name}: {s.watch_error}" for s in getattr(timeline, "stages", []) if s.watch_error]
            raise RuntimeError("CudaPeaks measured no stage: " + ("; ".join(why) if why else
                               "put it in manager.watch['sync_weights'] and sync"))
        out = dict(self.rises)
        if budget_bytes is not None:
            out["budget_mib"] = budget_bytes / MiB
            out["trainer_within_budget"] = out["trainer_peak_allocated_mib"] * MiB <= budget_bytes
            out["within_budget"] = out["device_peak_allocated_mib"] * MiB <= budget_bytes
            if engine_budget_bytes is not None:
                out["engine_budget_mib"] = engine_budget_bytes / MiB
                out["within_budget"] = out["trainer_within_budget"] and all(
                    w * MiB <= engine_budget_bytes for w in out.get("engine_workers_peak_allocated_mib", []))
        return out
