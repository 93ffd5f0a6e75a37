"""Gather: the pieces of sharded tensors -> full tensors, or straight into a flat bucket buffer.

`Pieces` is how `export` describes a sharded tensor (this rank's contiguous piece of its
flattened form, and every group rank's count); the functions here do the collectives:

- `materialize(item, dtype)`: one full tensor (cast on the local shard, then one all-gather, or
  ``full_tensor()`` for a DTensor whose placement has no pieces).
- `fill_bucket(bkt, items, flat, scratch, dst)`: every tensor of one bucket into its place in
  ``flat``, with ONE collective per gather group (a coalesced all-gather, a packed all-gather for
  uneven pieces, or point-to-point sends to ``dst``).
- `fill_shared(host, bkt, items)`: the same bucket without a gather, through one host-shared
  buffer (`hostbuf.HostShared`) that every rank of the group writes its own pieces into.

Not here: what is exported or in which order (`export`), planning (`bucket`), handles (`handles`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

try:  # the coalescing fast path (one all_gather_single_coalesced for many tensors)
    from torch.distributed.distributed_c10d import _coalescing_manager
except ImportError:  # pragma: no cover - older torch: one gather per tensor instead
    _coalescing_manager = None

from ..topology import agree, cpu_group, has_cpu_backend
from . import bucket as _bucket
from .hostbuf import HostShared

__all__ = ["Pieces", "sub_pieces", "data_group", "data_mesh", "broadcast", "all_gather", "gather_pieces", "materialize", "materialized_bytes_in",
           "Scratch", "Received", "bucket_bytes_in", "alloc_bucket", "agree_group", "fill_bucket", "shared_group", "fill_shared"]


def _align(n: int) -> int:
    return (n + _bucket.ALIGNMENT - 1) // _bucket.ALIGNMENT * _bucket.ALIGNMENT


@dataclass(frozen=True)
class Pieces:
    """A tensor held as contiguous pieces of its flattened form: group rank r holds ``counts[r]``
    elements, and the pieces in group-rank order are the full tensor's elements in order (true of
    dim-0 sharding and of FSDP1's flat parameters)."""

    local: torch.Tensor          # this rank's piece (numel == counts[rank]; any shape)
    counts: tuple[int, ...]      # elements per group rank
    group: Any                   # the process group the pieces are gathered over
    rank: int                    # this process's rank in ``group``


def data_group(group: Any, t: torch.Tensor) -> Any:
    """The group that moves ``t``'s data among the ranks of ``group``: ``group`` itself, except for
    a CPU tensor where ``group`` has no CPU backend (an NCCL-only group, the tensors CPU-resident:
    FSDP2's ``CPUOffloadPolicy``, FSDP1's ``CPUOffload(offload_params=True)``), whose gloo twin
    (`topology.cpu_group`: the same ranks in the same order) carries it. Collective where the twin
    is made: every rank of ``group`` asks at the same point, as for the collective it is for."""
    if t.device.type != "cpu" or has_cpu_backend(group):
        return group
    return cpu_group(group)


_CPU_MESHES: dict[tuple, Any] = {}


def data_mesh(mesh: Any, t: torch.Tensor) -> Any:
    """`data_group` for a DTensor's device mesh: ``mesh`` itself, or for a CPU shard where one of
    its dimensions' groups has no CPU backend (HSDP's 2-D mesh, offloaded, on an NCCL-only group)
    the same mesh over those groups' gloo twins, made once (collective where a twin is made)."""
    if t.device.type != "cpu":
        return mesh
    groups = [mesh.get_group(d) for d in range(mesh.ndim)]
    if all(has_cpu_backend(g) for g in groups):
        return mesh
    from torch.distributed.device_mesh import DeviceMesh

    twins = [cpu_group(g) for g in groups]
    key = (tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()), mesh.mesh_dim_names,
           tuple(id(g) for g in twins))
    if key not in _CPU_MESHES:
        _CPU_MESHES[key] = DeviceMesh.from_group(twins if mesh.ndim > 1 else twins[0], "cpu",
                                                 mesh=mesh.mesh if mesh.ndim > 1 else None,
                                                 mesh_dim_names=mesh.mesh_dim_names)
    return _CPU_MESHES[key]


def broadcast(t: torch.Tensor, group: Any, src: int) -> None:
    """``t`` from group rank ``src`` to every rank of ``group`` (in place)."""
    dist.broadcast(t, group=data_group(group, t), group_src=src)


def sub_pieces(p: Pieces, off: int, n: int) -> Pieces:
    """Elements ``[off, off + n)`` of a tensor held as `Pieces`: on each rank the part of its
    piece inside the range (contiguous, possibly empty)."""
    starts = [sum(p.counts[:r]) for r in range(len(p.counts))]
    counts = tuple(max(0, min(off + n, a + c) - max(off, a)) for a, c in zip(starts, p.counts))
    lo = max(off, starts[p.rank]) - starts[p.rank]
    local = p.local.reshape(-1)
    return Pieces(local[lo:lo + counts[p.rank]] if counts[p.rank] else local[:0], counts, p.group, p.rank)


def all_gather(out: torch.Tensor | list, inp: torch.Tensor | list, group: Any) -> None:
    """``out`` = every group rank's ``inp``, concatenated in rank order (equal sizes).

    With lists, ``out[i]`` gathers ``inp[i]`` and the whole list is ONE coalesced collective
    (``all_gather_single_coalesced`` through torch's coalescing fast path): the outputs may be
    slices of a flat bucket, so nothing is packed before or unpacked after the gather."""
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single; the old name warns there
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    group = data_group(group, out[0] if isinstance(out, list) else out)
    if not isinstance(out, list):
        fn(out, inp, group=group)
        return
    if len(out) == 1 or _coalescing_manager is None:
        for o, i in zip(out, inp):
            fn(o, i, group=group)
        return
    with _coalescing_manager(group=group, async_ops=False):
        for o, i in zip(out, inp):
            fn(o, i, group=group)


def _single_owner(p: Pieces) -> int | None:
    """The one group rank holding every element, when pieces are that uneven (else None)."""
    held = [r for r, c in enumerate(p.counts) if c]
    return held[0] if len(held) == 1 and len(p.counts) > 1 else None


def gather_pieces(p: Pieces, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """One tensor from its pieces: cast locally, then one all-gather."""
    world = len(p.counts)
    numel = sum(p.counts)
    local = p.local.reshape(-1)
    if local.dtype != dtype:
        local = local.to(dtype)
    if numel == 0:
        return torch.empty(shape, dtype=dtype, device=local.device)
    if world == 1:             # a group of one rank: its piece is the tensor (a copy: not the shard)
        return (local if local.dtype != p.local.dtype else local.clone()).detach().contiguous().view(shape)
    owner = _single_owner(p)
    if owner is not None:      # one rank holds it all (an expert of a fused tensor): a broadcast
        out = torch.empty(numel, dtype=dtype, device=local.device)
        if p.rank == owner:
            out.copy_(local)
        broadcast(out, p.group, owner)
        return out.view(shape)
    most = max(p.counts)
    if all(c == most for c in p.counts):
        out = torch.empty(numel, dtype=dtype, device=local.device)
        all_gather(out, local.contiguous(), p.group)
        return out.view(shape)
    send = torch.empty(most, dtype=dtype, device=local.device)
    send[:p.counts[p.rank]].copy_(local)
    recv = torch.empty(world * most, dtype=dtype, device=local.device)
    all_gather(recv, send, p.group)
    out = torch.empty(numel, dtype=dtype, device=local.device)
    pos = 0
    for r, c in enumerate(p.counts):
        out[pos:pos + c].copy_(recv[r * most:r * most + c])
        pos += c
    return out.view(shape)


def materialize(item: Any, dtype: torch.dtype, received: Received | None = None) -> torch.Tensor:
    """One exported item (`export`'s) whole on this rank, in ``dtype``: a whole tensor cast, a
    DTensor's ``full_tensor()`` (its local shard cast first), or its pieces gathered
    (`gather_pieces`; collective for the last two). ``received``: what the gather brought from
    the other ranks is added to it (`materialized_bytes_in`)."""
    if received is not None:
        received.bytes_in += materialized_bytes_in(item, dtype)
    with torch.no_grad():
        if item.full is not None:
            t = item.full
            return (t if t.dtype == dtype else t.to(dtype)).contiguous()
        if item.dtensor is not None:
            dt = item.dtensor.detach()
            mesh = data_mesh(dt.device_mesh, dt.to_local())
            if dt.dtype != dtype or mesh is not dt.device_mesh:   # cast the local shard, then gather
                from torch.distributed.tensor import DTensor
                dt = DTensor.from_local(dt.to_local().to(dtype), mesh, dt.placements,
                                        run_check=False, shape=dt.shape, stride=dt.stride())
            return dt.full_tensor().contiguous()
        return gather_pieces(item.pieces, item.shape, dtype)


def materialized_bytes_in(item: Any, dtype: torch.dtype) -> int:
    """The bytes `materialize` brings this rank from the others, from sizes known here: a
    DTensor's elements it does not hold locally (``full_tensor()`` gathers them, in ``dtype``:
    the shard is cast first; HSDP's replicas hold their own copy and gather only over the shard
    dimension), pieces as `gather_pieces` gathers them (a broadcast from the one rank holding
    them all, else an all-gather of equal or padded pieces), a whole tensor nothing."""
    if item.full is not None:
        return 0
    if item.dtensor is not None:
        dt = item.dtensor
        local = getattr(dt, "_local_tensor", None)
        held = local.numel() if isinstance(local, torch.Tensor) else dt.to_local().numel()
        return max(0, dt.numel() - held) * dtype.itemsize
    p = item.pieces
    if len(p.counts) == 1 or not sum(p.counts):
        return 0
    owner = _single_owner(p)
    if owner is not None:
        return 0 if p.rank == owner else sum(p.counts) * dtype.itemsize
    return (len(p.counts) - 1) * max(p.counts) * dtype.itemsize


@dataclass
class Received:
    """What one rank received from the other ranks of its gather groups in one stream: counted
    from sizes every rank knows already (`bucket_bytes_in`), never by a collective of its own."""

    bytes_in: int = 0


def bucket_bytes_in(pairs: list[tuple[_bucket.BucketEntry, tuple[int, ...]]], me: int,
                    dst: int | None = None) -> int:
    """Pure: the bytes group rank ``me`` receives gathering one bucket's pieces as `gather_bucketed`
    gathers them (``pairs``: each entry with its elements per group rank): to ``dst``, every
    other rank's pieces (0 elsewhere); else each run of entries one rank holds whole, broadcast
    from it (padding inside the run included), and the rest in one all-gather: (world - 1) x the
    piece when every piece is equal, else (world - 1) x the packed send buffer (each entry in a
    slot as wide as its largest piece, aligned). `fsdp_sync.plan` counts a sync's gathers with it."""
    world = len(pairs[0][1]) if pairs else 1
    if world == 1:
        return 0
    if dst is not None:
        return 0 if me != dst else sum((sum(c) - c[me]) * e.dtype.itemsize for e, c in pairs)
    rest, runs = [], []      # runs: [owner, start, end], as `_broadcast_owned` makes them
    for e, c in pairs:
        held = [r for r, x in enumerate(c) if x]
        if len(held) != 1:
            rest.append((e, c))
        elif runs and runs[-1][0] == held[0] and _align(runs[-1][2]) == e.start:
            runs[-1][2] = e.end
        else:
            runs.append([held[0], e.start, e.end])
    n = sum(b - a for owner, a, b in runs if owner != me)
    if all(all(x == c[0] for x in c) for _, c in rest):
        return n + sum((world - 1) * c[0] * e.dtype.itemsize for e, c in rest)
    width = 0
    for e, c in rest:
        width = _align(width + max(c) * e.dtype.itemsize)
    return n + (world - 1) * width


class Scratch:
    """Grow-only byte buffers reused across buckets (send and receive of the bucketed gather), and
    the bytes the stream's gathers received (``received``)."""

    def __init__(self, received: Received | None = None) -> None:
        self._bufs: dict[str, torch.Tensor] = {}
        self.received = received if received is not None else Received()

    def get(self, key: str, nbytes: int, device: torch.device) -> torch.Tensor:
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < nbytes or buf.device != device:
            buf = self._bufs[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes]


def gather_bucketed(group: Any, pairs: list[tuple[_bucket.BucketEntry, Pieces]],
                    flat: torch.Tensor, scratch: Scratch, dst: int | None = None) -> None:
    """All pieces of one bucket over one group. Entries one rank holds whole (an expert cut from a
    fused tensor, an FSDP1 parameter inside one rank's chunk) are broadcast from it, one broadcast
    per run of them (`_broadcast_owned`); the rest in ONE collective either way. When every entry's
    pieces are equal on every rank: one coalesced all-gather straight into the entries' places in
    ``flat`` (no copies of ours; on 2 CPU ranks this took a 650 MB export from 1.37 s to 0.99 s).
    Otherwise (uneven ``torch.chunk`` splits, flat-parameter padding): pack this rank's (cast)
    pieces into one send buffer, every entry in a slot as wide as its largest rank's piece, one
    all-gather, then copy each entry's rank pieces into place. A group of one rank (a one-rank
    trainer) gathers nothing: its pieces are copied (cast) into place in one fused copy, with no
    collective and no buffer (through the all-gather, a one-rank qwen2-160m sync rose 298 MiB, over
    its 175 MiB budget, at 3x the copy floor, on CPU)."""
    world, me = len(pairs[0][1].counts), pairs[0][1].rank
    for entry, p in pairs:
        if len(p.counts) != world:
            raise ValueError(f"{entry.name!r}: pieces over {len(p.counts)} ranks in a bucket "
                             f"gathered over {world}")
    # Equal pieces on every rank (the common case: FSDP2 Shard(0) of a dim divisible by the world):
    # each rank's piece goes straight from its shard into the entry's place in the flat buffer.
    def even(p: Pieces) -> bool:
        return all(c == p.counts[0] for c in p.counts)

    scratch.received.bytes_in += bucket_bytes_in([(e, p.counts) for e, p in pairs], me, dst)
    if world == 1:   # a group of one rank (one trainer rank): its pieces are the tensors
        held = [(e, p) for e, p in pairs if p.counts[0]]
        views: dict = {}
        _bucket.copy_many([_bucket.entry_flat(flat, e, views) for e, _ in held],
                          [p.local if p.local.dim() == 1 else p.local.reshape(-1) for _, p in held])   # the copy casts
        return
    if dst is not None:
        _gather_to(dst, group, pairs, flat)
        return
    pairs = _broadcast_owned(group, pairs, flat)
    if not pairs:
        return
    if all(even(p) for _, p in pairs):
        outs, ins = [], []
        for entry, p in pairs:
            if not p.counts[0]:
                continue
            local = p.local.reshape(-1)
            if local.dtype != entry.dtype:
                local = local.to(entry.dtype)   # cast the shard: half the bytes on the wire for bf16
            # as bytes: one coalesced all-gather of entries of several dtypes (a float32 parameter
            # SGLang keeps beside bf16 weights) came back with zeros interleaved over gloo
            outs.append(flat[entry.start:entry.end])
            ins.append(local.contiguous().view(torch.uint8))
        if outs:
            all_gather(outs, ins, group)
        return
    slots, width = [], 0
    for entry, p in pairs:
        slots.append(width)
        width = _align(width + max(p.counts) * entry.dtype.itemsize)
    if width == 0:
        return
    device = pairs[0][1].local.device
    send = scratch.get("send", width, device)
    recv = scratch.get("recv", world * width, device)
    dsts, srcs = [], []
    for (entry, p), slot in zip(pairs, slots):
        n = p.counts[me] * entry.dtype.itemsize
        if n:   # the copy casts: the pack is the cast
            dsts.append(send[slot:slot + n].view(entry.dtype).view(p.local.shape))
            srcs.append(p.local)
    _bucket.copy_many(dsts, srcs)
    all_gather(recv, send, group)
    rows = recv.view(world, width)
    dsts, srcs = [], []
    for (entry, p), slot in zip(pairs, slots):
        item = entry.dtype.itemsize
        first = p.counts[0]
        if all(c == first for c in p.counts):
            if first:
                b = first * item
                dsts.append(flat[entry.start:entry.end].view(world, b))
                srcs.append(rows[:, slot:slot + b])
            continue
        pos = entry.start
        for r, c in enumerate(p.counts):
            b = c * item
            if b:
                dsts.append(flat[pos:pos + b])
                srcs.append(rows[r, slot:slot + b])
            pos += b
    _bucket.copy_many(dsts, srcs)


def _broadcast_owned(group: Any, pairs: list[tuple[_bucket.BucketEntry, Pieces]],
                     flat: torch.Tensor) -> list[tuple[_bucket.BucketEntry, Pieces]]:
    """Entries one rank holds whole (the experts of a fused tensor, cut expert by expert): each run
    of adjacent such entries of one owner is written (cast) by the owner into its place in
    ``flat`` and broadcast from there, one broadcast per run and no buffer of ours (an all-gather
    would cost world x the bucket for them). The padding inside a run is zero on the owner (the
    caller zeroed the gaps). Returns the other pairs."""
    rest, runs = [], []   # runs: [owner, start, end]
    dsts, srcs = [], []
    for entry, p in pairs:
        owner = _single_owner(p)
        if owner is None:
            rest.append((entry, p))
            continue
        if owner == p.rank:   # the copy casts: the owner's shard is cast on its way in
            dsts.append(flat[entry.start:entry.end].view(entry.dtype))
            srcs.append(p.local.reshape(-1))
        if runs and runs[-1][0] == owner and _align(runs[-1][2]) == entry.start:
            runs[-1][2] = entry.end
        else:
            runs.append([owner, entry.start, entry.end])
    _bucket.copy_many(dsts, srcs)
    for owner, a, b in runs:
        broadcast(flat[a:b], group, owner)
    return rest


def _gather_to(dst: int, group: Any, pairs: list[tuple[_bucket.BucketEntry, Pieces]],
               flat: torch.Tensor) -> None:
    """Every rank's pieces of one bucket into ``flat`` on group rank ``dst`` only, with no buffer
    of our own: each piece is sent (cast on the sender) straight into its place in ``flat``
    (point to point, one message per entry and rank), ``dst`` copies its own. The other ranks
    keep nothing, so only ``dst`` ever holds the bucket."""
    me = pairs[0][1].rank
    group = data_group(group, flat)
    works, keep = [], []     # keep: what is on the wire stays alive until its wait
    dsts, srcs = [], []      # dst's own pieces: one fused copy
    for i, (entry, p) in enumerate(pairs):
        item = entry.dtype.itemsize
        if me == dst:
            off = entry.start
            for r, c in enumerate(p.counts):
                if c and r == me:
                    dsts.append(flat[off:off + c * item].view(entry.dtype))
                    srcs.append(p.local.reshape(-1))
                elif c:
                    works.append(dist.irecv(flat[off:off + c * item].view(entry.dtype), group=group,
                                            group_src=r, tag=i))
                off += c * item
        elif p.counts[me]:
            local = p.local.reshape(-1)
            if local.dtype != entry.dtype:
                local = local.to(entry.dtype)
            keep.append(local.contiguous())
            works.append(dist.isend(keep[-1], group=group, group_dst=dst, tag=i))
    _bucket.copy_many(dsts, srcs)
    for w in works:
        w.wait()


def agree_group(dt: Any) -> Any:
    """The group over which the export and the per-rank reshard agree a failure beside DTensor
    ``dt``'s ``full_tensor()``: a 1-D mesh's group; a 2-D mesh (HSDP's) as the world where it spans
    it; None otherwise (its ranks need not all run the stream)."""
    mesh = dt.device_mesh
    if mesh.ndim == 1:
        return mesh.get_group()
    return dist.group.WORLD if mesh.size() == dist.get_world_size() else None


def alloc_bucket(alloc: Any, bkt: _bucket.Bucket, index: int, group: Any) -> torch.Tensor:
    """``alloc(bkt.nbytes)`` (bucket ``index`` of a stream), checked to be a 1-D uint8 tensor of
    at least that many bytes, and its success agreed over ``group`` (the export's; None where it
    has one rank) before the bucket's collectives: a rank whose allocation fails (its /dev/shm
    full, a MemoryError) would otherwise leave its peers waiting in the gather until the group's
    timeout. A failure is then raised on every rank as `topology.SyncError` naming the rank, the
    bucket and its size; without a group, the allocator's own error is raised."""
    error, flat = None, None
    try:
        flat = alloc(bkt.nbytes)
        if (not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1
                or flat.numel() < bkt.nbytes):
            raise ValueError(f"alloc({bkt.nbytes}) must return a 1-D uint8 tensor of at least "
                             f"{bkt.nbytes} bytes, got {getattr(flat, 'dtype', type(flat))} "
                             f"{tuple(getattr(flat, 'shape', ()))}")
    except Exception as exc:  # noqa: BLE001 - whatever it is, every peer must hear of it
        if group is None:
            raise
        flat, error = None, (f"allocating the {bkt.nbytes}-byte buffer of bucket {index} "
                             f"({bkt.names[0]!r}...) on rank {dist.get_rank()}: {type(exc).__name__}: {exc}")
    if group is not None:
        try:
            agree(error, group, what="export")
        except BaseException:
            flat = None      # the traceback keeps this frame: not this rank's buffer with it
            raise
    return flat


def fill_bucket(bkt: _bucket.Bucket, items: list, flat: torch.Tensor, scratch: Scratch,
          dst: int | None = None) -> None:
    """Bucket ``bkt`` into ``flat``: the padding zeroed in one op, the tensors held whole copied
    (cast included) in one fused copy (`bucket.copy_many`), the sharded ones gathered straight
    into their places. A tensor that must be materialized (``full_tensor()``) is copied as soon
    as it exists, so no more than one such temporary is alive at a time."""
    pending: dict[int, tuple[Any, list]] = {}
    dsts, srcs = [], []
    with torch.no_grad():
        _bucket.zero_gaps(flat, bkt.entries, bkt.nbytes)
        views = _bucket.entry_views(flat, bkt)
        for entry, it, view in zip(bkt.entries, items, views):
            if it.pieces is not None:
                pending.setdefault(id(it.pieces.group), (it.pieces.group, []))[1].append(
                    (entry, it.pieces))
            elif it.full is not None:   # the fused copy below, cast included
                dsts.append(view)
                srcs.append(it.full)
            else:   # full_tensor(): what it gathers is counted as the buckets' gathers are
                view.copy_(materialize(it, entry.dtype, scratch.received))
        _bucket.copy_many(dsts, srcs)
        del dsts, srcs
        for group, pairs in pending.values():
            gather_bucketed(group, pairs, flat, scratch, dst)


# --------------------------------------------------------------------------- one host, no gather

def shared_group(items: list) -> Any:
    """The items' one gather group if `fill_shared` applies to them (every item a sharded or
    replicated CPU tensor of that one group), else None (same answer on
    every rank: the items and their piece counts are the same everywhere)."""
    groups = {id(it.pieces.group): it.pieces.group for it in items if it.pieces is not None}
    if len(groups) != 1:
        return None
    for it in items:
        p = it.pieces
        if p is None:
            if it.full is None:
                return None          # a DTensor that needs full_tensor(): not this path
            if it.full.device.type != "cpu":
                return None
            continue
        if p.local.device.type != "cpu":
            return None
    return next(iter(groups.values()))


def fill_shared(host: HostShared, bkt: _bucket.Bucket, items: list, *,
                wait_readers: bool = True) -> torch.Tensor:
    """Bucket ``bkt`` in ``host``'s one buffer (a view valid until the next bucket): each rank
    writes only its own pieces of each tensor (bytes ``[start + before, start + before + piece)``,
    ``before`` the elements of the ranks before it), group rank 0 the replicated tensors and the
    padding, so a bucket costs every rank one copy of its shard instead of an all-gather.
    ``wait_readers=False``: the caller has just synchronized the group itself (`HostShared.fill`)."""
    flat = host.bufs[0][:bkt.nbytes]
    me = host.me

    def write() -> None:
        if me == 0:
            _bucket.zero_gaps(flat, bkt.entries, bkt.nbytes)
        dsts, srcs = [], []       # one fused copy (`bucket.copy_many`) of every piece this rank writes
        for entry, it in zip(bkt.entries, items):
            p = it.pieces
            if p is None:
                if me == 0:         # replicated on every rank: rank 0 writes it
                    dsts.append(flat[entry.start:entry.end].view(entry.dtype).view(entry.shape))
                    srcs.append(it.full)
                continue
            n = p.counts[me] * entry.dtype.itemsize
            if n:                # the copy casts: the shard is cast on its way in
                lo = entry.start + sum(p.counts[:me]) * entry.dtype.itemsize
                dsts.append(flat[lo:lo + n].view(entry.dtype))
                srcs.append(p.local.reshape(-1))
        _bucket.copy_many(dsts, srcs)

    host.fill(write, wait_readers=wait_readers)
    return flat
