"""Memory sampling for `fsdp-sync bench`: each device's memory sampled in a thread during one
more sync, and the largest rise above the level before the sync stage.

A device is a trainer rank plus its engine worker (RSS from /proc; the shared-memory pages a worker
maps from a trainer counted once). Not here: what the rows report (`main`, `methods`).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ...memory import status as _status
from ...topology import cpu_group

__all__ = ["DeviceSampler", "device_bytes", "sampled_sync", "rises"]

def device_bytes(trainer: int, worker: int | None) -> int:
    """One device's memory: the trainer rank's RSS plus its engine worker's RSS less the worker's
    shared-memory pages (those are the trainer's buffers, mapped by both: counted once)."""
    t = _status(trainer)
    if not worker:
        return t.get("rss", 0)
    w = _status(worker)
    return t.get("rss", 0) + w.get("rss", 0) - w.get("shmem", 0)


class DeviceSampler:
    """Samples each device's memory (`device_bytes` of trainer j and worker j) every ``period_s``
    in a thread; /proc status reads cost ~50 µs, so sampling barely disturbs the sync."""

    def __init__(self, pairs: list[tuple[int, int | None]], period_s: float = 0.001) -> None:
        self.pairs = pairs
        self.period_s = period_s
        self.samples: list[tuple[float, list[int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fsdp_sync-sampler", daemon=True)
        self.t0 = time.perf_counter()

    def read(self) -> list[int]:
        return [device_bytes(t, w) for t, w in self.pairs]

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter() - self.t0, self.read()))
            self._stop.wait(self.period_s)

    def __enter__(self) -> "DeviceSampler":
        self.t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.perf_counter() - self.t0, self.read()))


def sampled_sync(manager: Any, sampler: DeviceSampler | None) -> None:
    """One more sync, the ranks starting it together, with ``sampler`` (rank 0's; None on the other
    ranks) sampling memory from before it begins until it is done."""
    import torch.distributed as dist

    dist.barrier(group=cpu_group())
    if sampler:
        sampler.__enter__()
    try:
        with manager:
            pass
    finally:    # a failed sync stops the sampling thread too (it sampled on, every millisecond)
        if sampler:
            sampler.__exit__(None, None, None)


def rises(timeline: list[dict], sampler: DeviceSampler) -> list:
    """Per sampled process, the largest rise of its memory during the sync stage (``sync_weights``
    in ``timeline``; every sample when there is none) above its level before the stage: the last
    sample taken before the stage began (the first sample when none was). A stage no sample fell
    in: the first sample after it (what it left). ``sampler`` has samples."""
    t0 = t1 = None
    for st in timeline:
        if st["name"] == "sync_weights":
            t0 = st["started"] - sampler.t0
            t1 = t0 + st["seconds"]
    samples = sampler.samples
    before = [s for ts, s in samples if t0 is not None and ts <= t0] or [samples[0][1]]
    during = [s for ts, s in samples if t0 is not None and t0 <= ts <= t1]
    if not during and t0 is not None:   # a stage shorter than a period: the level it left, not a
        during = [s for ts, s in samples if ts > t1][:1]    # later stage's (the KV cache woken)
    during = during or [s for _, s in samples]
    base = before[-1]
    return [max(s[j] - base[j] for s in during) for j in range(len(base))]
