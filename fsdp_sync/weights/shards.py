"""Where a sharded tensor's pieces live, read without moving data: a DTensor sharded ``Shard(0)``
on a 1-D mesh (FSDP2's layout) and FSDP1's dim-0 ``ShardedTensor`` as `gather.Pieces` (contiguous
element ranges, one per rank, in rank order). `export` resolves every exported tensor with these.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from .gather import Pieces

__all__ = ["chunk_counts", "sharded_tensor_pieces", "dim0_pieces", "local_shard", "rank"]


def rank() -> int:
    """This process's global rank (0 without a process group), for error messages."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def chunk_counts(rows: int, per_row: int, world: int) -> tuple[int, ...]:
    """Elements per rank of a dim-0 split with torch.chunk semantics (trailing ranks may get 0)."""
    c = -(-rows // world) if rows else 0
    return tuple(max(0, min(c, rows - r * c)) * per_row for r in range(world))


def sharded_tensor_pieces(name: str, st: Any) -> Pieces:
    """An FSDP1 ``ShardedTensor`` (its sharded state dict) split along dim 0 in rank order, as
    pieces; anything else is refused naming the tensor and the shard."""
    md = st.metadata()
    shape = tuple(md.size)
    pg = st._process_group
    world, me = dist.get_world_size(pg), dist.get_rank(pg)
    per_row = math.prod(shape[1:])
    counts = [0] * world
    expected, last_rank = 0, -1
    for sm in sorted(md.shards_metadata, key=lambda s: s.shard_offsets[0] if s.shard_offsets else 0):
        grank = dist.get_group_rank(pg, sm.placement.rank()) if pg is not None else sm.placement.rank()
        if (not shape or list(sm.shard_offsets[1:]) != [0] * (len(shape) - 1)
                or tuple(sm.shard_sizes[1:]) != shape[1:] or sm.shard_offsets[0] != expected
                or grank <= last_rank):
            raise ValueError(f"{name!r} (rank {rank()}) is a ShardedTensor of shape {shape} not "
                             f"split along dim 0 in rank order: shard at offsets "
                             f"{list(sm.shard_offsets)} sizes {list(sm.shard_sizes)} on group rank "
                             f"{grank}")
        counts[grank] = sm.shard_sizes[0] * per_row
        expected += sm.shard_sizes[0]
        last_rank = grank
    if expected != (shape[0] if shape else 0):
        raise ValueError(f"{name!r} (rank {rank()}): shards cover {expected} of {shape[0]} rows")
    shards = st.local_shards()
    local = shards[0].tensor if shards else torch.empty(0, dtype=md.tensor_properties.dtype)
    if local.numel() != counts[me]:
        raise ValueError(f"{name!r} (rank {rank()}): local shard has {local.numel()} elements, "
                         f"the shard metadata says {counts[me]}")
    return Pieces(local, tuple(counts), pg, me)


def _mesh_info(mesh: Any, cache: dict) -> tuple | None:
    """(group, world, rank) of a 1-D mesh whose ranks are in group order, else None (cached:
    ``DeviceMesh.mesh`` costs a fraction of a millisecond per call)."""
    info = cache.get(id(mesh), False)
    if info is False:
        info = None
        if mesh.ndim == 1:
            ranks = [int(r) for r in mesh.mesh.tolist()]
            if ranks == sorted(ranks):
                info = (mesh.get_group(), len(ranks), mesh.get_local_rank())
        cache[id(mesh)] = info
    return info


def dim0_pieces(name: str, dt: Any, cache: dict) -> Pieces | None:
    """The pieces of DTensor ``dt`` (HF name ``name``) where the bucketed gather applies to it:
    sharded ``Shard(0)`` on a 1-D mesh whose ranks are in group order (FSDP2's layout), else None
    (gathered with ``full_tensor()``). ``cache`` (one per export) keeps the split of each (mesh,
    placements, shape) seen."""
    try:
        key = (id(dt.device_mesh), dt.placements, dt.shape)
        split = cache.get(key, False)
    except TypeError:          # a placement that cannot be hashed: worked out for this tensor
        key, split = None, False
    if split is False:
        split = _dim0_split(dt, cache)
        if key is not None:
            cache[key] = split
    if split is None:
        return None
    group, world, me, counts = split
    local = local_shard(dt)
    if local.shape[1:] != dt.shape[1:] or local.numel() != counts[me]:
        rows = counts[me] // max(1, math.prod(dt.shape[1:]))
        raise ValueError(f"{name!r} (rank {rank()}): a Shard(0) DTensor of shape "
                         f"{tuple(dt.shape)} on {world} ranks should hold {rows} rows here "
                         f"(torch.chunk split), got a local shard of shape {tuple(local.shape)}")
    return Pieces(local.detach(), counts, group, me)


def _dim0_split(dt: Any, cache: dict) -> tuple | None:
    """(group, world, rank, elements per rank) of a ``Shard(0)`` DTensor on a 1-D mesh in group
    order, else None."""
    from torch.distributed.tensor import Shard

    if dt.ndim == 0 or len(dt.placements) != 1 or dt.placements[0] != Shard(0):
        return None
    info = _mesh_info(dt.device_mesh, cache)
    if info is None:
        return None
    group, world, me = info
    return group, world, me, chunk_counts(dt.shape[0], math.prod(dt.shape[1:]), world)


def local_shard(dt: Any) -> torch.Tensor:
    """A DTensor's local shard: the tensor it holds (``_local_tensor``), not ``to_local()``, an
    autograd function (16 us a call, 5.5 ms of a 338-tensor sync on this host) for the gradient
    an export never takes; ``to_local()`` where a DTensor holds it elsewhere."""
    local = getattr(dt, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else dt.to_local()
