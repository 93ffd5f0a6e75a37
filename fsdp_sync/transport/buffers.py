"""The flat buffers a sync's buckets are made in, reused bucket after bucket (shared memory on CPU,
device memory on CUDA, shareable either way: `handles.empty_shared`): `ReusedBuffer`, the one
buffer of the full layout's buckets, and `BufferPool`, the per-rank buckets' (one a bucket in
flight). Both can lag a bucket behind (``lag``) for an engine whose ranks may still read a bucket
after it answered.

Not here: the send loop that takes and gives them back (`transport.tensor`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..weights import handles

__all__ = ["ReusedBuffer", "BufferPool"]


class ReusedBuffer:
    """The one flat buffer every bucket of a sync reuses in turn (shared memory on CPU, device
    memory on CUDA), sized for the largest bucket. Fresh pages cost a fault (and on CPU a kernel
    zero-fill) each: a buffer per bucket paid that for the whole model on every sync, this pays it
    for one bucket. Safe because the manager's calls are sequential: a bucket is released (its
    consumers acknowledged) before the next one is taken, which `take` checks.

    ``lag``: the engine may answer before every one of its ranks finished reading (SGLang at TP > 1
    on CUDA, `engine_reads_outlast`); a bucket's buffer is then taken again only after the next
    bucket was answered, which every engine rank reaches only once done with the call before: two
    buffers take turns (one bucket more memory).

    A buffer that could be shared only as a copy (allocated in an expandable CUDA segment, where
    the switch could not tell they were on: `handles.shared_as_copy`) is let go and allocated
    again, now shareable as it is, instead of copied for every bucket."""

    def __init__(self, nbytes: int, device: torch.device, lag: bool = False) -> None:
        self.nbytes, self.device, self.lag = nbytes, device, lag
        self.buf: torch.Tensor | None = None
        self.prev: torch.Tensor | None = None   # with lag: the buffer the last answered bucket used
        self.busy = False

    def take(self, nbytes: int) -> torch.Tensor:
        if self.busy:
            raise RuntimeError("the sync buffer is still in use by the previous bucket")
        if self.buf is None or self.buf.numel() < nbytes or handles.shared_as_copy(self.buf):
            self.buf = None
            self.buf = handles.empty_shared(max(nbytes, self.nbytes), self.device)
        self.busy = True
        return self.buf[:nbytes]

    def give_back(self) -> None:
        self.busy = False
        if self.lag:
            self.buf, self.prev = self.prev, self.buf


class BufferPool:
    """Flat shared buffers that the per-rank buckets of one sync reuse (the all-to-all path's
    ``alloc``): a buffer goes back to the pool when its bucket is released (every consumer
    acknowledged, the engine answered), so a sync holds one buffer per bucket in flight (two when
    pipelined) instead of a fresh segment per bucket. Fresh shared memory costs a file, a page
    fault and a kernel zero-fill per page: per bucket that was the whole model's worth each sync.
    Every buffer is sized for the largest bucket (``nbytes``); all are freed with the pool.
    ``lag``: as `ReusedBuffer`'s, a released bucket's buffers are handed out again only once the
    next bucket was released."""

    def __init__(self, nbytes: int, device: torch.device, lag: bool = False) -> None:
        self.nbytes, self.device, self.lag = nbytes, device, lag
        self.free: list[torch.Tensor] = []
        self.pending: list[torch.Tensor] = []        # with lag: the last released bucket's
        self.lent: dict[int, torch.Tensor] = {}      # data_ptr -> buffer, while a bucket holds it

    def take(self, nbytes: int) -> torch.Tensor:
        self.free = [b for b in self.free if not handles.shared_as_copy(b)]    # (see ReusedBuffer)
        fits = [b for b in self.free if b.numel() >= nbytes]
        if fits:
            buf = fits[0]
            self.free.remove(buf)
        else:
            buf = handles.empty_shared(max(nbytes, self.nbytes), self.device)
        self.lent[buf.data_ptr()] = buf
        return buf

    def give_back(self, views: Any) -> None:
        """Return the buffers that ``views`` (tensors from `take`, possibly sliced) came from."""
        back = [b for b in (self.lent.pop(v.data_ptr(), None) for v in views) if b is not None]
        if self.lag:
            self.free += self.pending
            self.pending = back
        else:
            self.free += back

    def close(self) -> None:
        self.free, self.pending, self.lent = [], [], {}
