"""Allocating one per-rank bucket's buffers (`reshard.iter_rank_buckets`), agreed over the group
whose collective comes next.

A trainer rank builds one buffer of a bucket per engine TP rank it holds (several, or none), from
the caller's ``alloc`` (shared memory by default), right before the bucket's collective (the
all-to-all; on the local path a DTensor's ``full_tensor()``). Where one rank's allocation failed
(its /dev/shm full, a MemoryError, an allocator returning a wrong tensor), that rank raised alone
and its peers waited in the collective out the process group's timeout. `alloc_buffers` checks
each buffer as `gather.alloc_bucket` does and agrees their success over that group in ONE small
all-reduce per bucket, however many buffers each rank builds: every rank raises the same
`topology.SyncError` naming the failing rank, the bucket, the engine rank and the size, and no
rank keeps a buffer of the failed bucket. Without such a group the allocator's error is raised.

Not here: what goes into the buffers (`reshard`), the export's buckets (`gather.alloc_bucket`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from . import bucket as _bucket
from .gather import agree_group, alloc_bucket
from ..topology import agree

__all__ = ["alloc_buffers", "full_tensor_group"]


def full_tensor_group(items: Iterable) -> Any:
    """The group the ``full_tensor()`` of these export items' DTensors runs over where every rank
    of it runs the stream (a 1-D mesh's group; a 2-D mesh, HSDP's, as the world where it spans
    it), as the export agrees its own failures; None where no item is such a DTensor."""
    return next((agree_group(it.dtensor) for it in items if it.dtensor is not None), None)


def alloc_buffers(alloc: Callable[[int], torch.Tensor], bkt: _bucket.Bucket, index: int,
                  engine_ranks: Iterable[int], group: Any) -> dict[int, torch.Tensor]:
    """Engine rank -> ``alloc(bkt.nbytes)`` (checked, cut to ``bkt.nbytes``) for ``engine_ranks``
    of per-rank bucket ``index``; where ``group`` has more than one rank, their success agreed over
    it (every rank calls this once per bucket, whatever it builds)."""
    agreed = group is not None and dist.is_initialized() and dist.get_world_size(group) > 1
    buffers: dict[int, torch.Tensor] = {}
    error = None
    try:
        for i in engine_ranks:
            buffers[i] = alloc_bucket(alloc, bkt, index, None)[:bkt.nbytes]
    except Exception as exc:  # noqa: BLE001 - whatever it is, every peer must hear of it
        buffers.clear()       # none of the failed bucket's buffers is kept
        if not agreed:
            raise
        error = (f"allocating the {bkt.nbytes}-byte buffer of engine rank {i} of per-rank bucket "
                 f"{index} ({bkt.names[0]!r}...) on rank {dist.get_rank()}: {type(exc).__name__}: {exc}")
    if agreed:
        try:
            agree(error, group, what="per-rank buckets")
        except BaseException:
            buffers.clear()   # the traceback keeps this frame: not this rank's buffers with it
            raise
    return buffers
