"""Per-rank buckets: each engine TP rank gets only its own shard, in the engine's layout.

`iter_rank_buckets(module, layout, bucket_bytes, ...)` is the layout-aware counterpart of
`export.iter_buckets`. Buckets are planned over the ENGINE's parameters (`layout.TPLayout`: fused
``qkv_proj`` / ``gate_up_proj``, vocab-parallel rows with zeroed padding, row-parallel column
slices, replicated norms and KV heads), so one plan fits every TP rank (their shards have the same
names and shapes; only the data differs). Bucket k has one flattened uint8 buffer per engine TP
rank, 16-byte aligned like `bucket.flatten`'s, holding just that rank's shard of the bucket's
parameters: SGLang's ``direct`` semantics (engine names, a different tensor per rank), one handle
per rank per bucket.

How the bytes get there (the module's shard group, FSDP1 "local"/"sharded" or FSDP2 ``Shard(0)``):

- one host (``share_host_memory=True`` and every rank of the group on this host, CPU shards): group
  rank 0 allocates TP shared-memory buffers (each the size of the largest bucket, reused by every
  bucket) and hands a mapping of them to every group rank; each trainer rank copies the parts of
  its own FSDP shard that fall in engine rank i's slice straight into buffer i (cast on the way).
  No collective moves data; two barriers per bucket (one when the consumer synchronizes every
  rank after each bucket, ``consumer_synced``). Each rank yields all TP buffers (views of the
  same memory), valid until it asks for the next bucket.
- across hosts (or ``share_host_memory=False``): ONE ``all_to_all_single`` per bucket in which
  trainer rank t sends to the owner of engine rank i's buffer only the part of its shard that
  overlaps engine rank i's slice. ``owners[i]`` lists the group ranks that assemble engine rank
  i's buffer (default: the colocated rule, group rank r holds engine rank ``r % tp``). Each rank
  yields only the buffers it owns, fresh from ``alloc`` and then the caller's.
- no shard group (a plain module, FSDP1 "full", HSDP's 2-D mesh: every tensor whole on every
  rank, a DTensor after its ``full_tensor()``): each rank builds only the engine ranks' buffers
  it is asked for (``ranks``), materializing one DTensor at a time.

Beside a shard group, a tensor every rank holds whole is written by one rank (``index % world``).

The module must export exactly the layout's HF tensors (a tied ``lm_head`` is not exported);
anything else is an error on every rank (`topology.agree`) before any data moves. An
``lm_head.weight`` exported beside the embedding of a tied config (a head the trainer holds apart)
is not sent (the engine's head is its embedding): it must equal the embedding bit for bit, or every
rank refuses the sync naming both (`tied.head_refusal`: the shards compared where they are split
alike, no data moved).
A bucket's buffers that one rank cannot allocate (``alloc`` failing, /dev/shm full) are raised on
every rank before the bucket's collective, naming the rank, bucket and size (`rank_alloc`).

Not here: handles and payloads (`handles`; the transport makes one per engine rank), who calls the
engine, pipelining, GPU copies (the buffers are CPU; ``alloc`` may give CUDA buffers on the
cross-host path, then the collective must be NCCL).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from . import bucket as _bucket
from . import export as _export
from . import handles as _handles
from . import tied as _tied
from .gather import Received, data_group, materialize
from .hostbuf import HostShared
from .items_memo import submodules
from .layout import TPLayout, block_of, view2d
from .rank_alloc import alloc_buffers, full_tensor_group
from .shards import dim0_pieces
from ..topology import agree, cpu_group

__all__ = ["RankBucket", "ReshardStats", "plan_rank_buckets", "iter_rank_buckets", "default_owners",
           "clear_plan_cache", "exchange_bytes", "rank_buckets_refusal"]


@dataclass
class RankBucket:
    """Bucket ``index`` of a per-rank sync. ``bucket``: the plan (engine names, per-rank shapes,
    byte offsets), the same for every engine TP rank. ``buffers``: engine TP rank -> 1-D uint8
    buffer of ``bucket.nbytes`` bytes laid out by ``bucket``, for the engine ranks this trainer
    rank holds (all of them on the one-host path)."""

    index: int
    bucket: _bucket.Bucket
    buffers: dict[int, torch.Tensor]
    shared: bool            # True: views of host-shared memory, valid until the next bucket

    def metadata(self) -> list:
        """SGLang-form flattened-bucket metadata (engine names): the same for every rank."""
        return _bucket.sglang_metadata(self.bucket)


@dataclass
class ReshardStats:
    """What one trainer rank moved in one sync (summed over buckets)."""

    bytes_in: int = 0             # bytes received from other trainer ranks (the all-to-all, an
    #                               FSDP1 full / sharded state dict's unsharding)
    bytes_out: int = 0            # bytes sent to other trainer ranks
    bytes_written: int = 0        # bytes this rank wrote into engine-rank buffers
    allgather_bytes_in: int = 0   # what `export.iter_buckets`' all-gather would have received
    engine_shard_bytes: int = 0   # bytes of one engine rank's shard (all buckets)
    buckets: int = 0
    path: str = ""                # "host-shared" | "all-to-all" | "local"


def plan_rank_buckets(layout: TPLayout, dtype: torch.dtype, bucket_bytes: int) -> list[_bucket.Bucket]:
    """Buckets over the engine's own parameters (names and per-rank shapes, engine order): pure
    (worked out once per model, TP, EP, dtype and bucket size: `_cached_plan`)."""
    return list(_cached_plan(layout, dtype, bucket_bytes))


# Plans and write lists depend only on the model's spec, TP, dtype, bucket size and (for the
# write lists) how the trainer ranks hold each tensor: every sync of a training run repeats them,
# so they are kept (a bounded cache; `clear_plan_cache` empties it).
_PLAN_CACHE: dict[tuple, list[_bucket.Bucket]] = {}
_TASK_CACHE: dict[tuple, list] = {}
_CACHE_LIMIT = 4096


def clear_plan_cache() -> None:
    """Forget the cached per-rank plans and write lists (they are rebuilt on the next sync)."""
    _PLAN_CACHE.clear()
    _TASK_CACHE.clear()


def _plan_key(layout: TPLayout, dtype: torch.dtype, bucket_bytes: int) -> tuple:
    """What a plan depends on: model, TP, EP (which experts a rank holds), dtype, bucket size and
    the layout's class (`FP8Layout` maps other shapes under the same spec, TP and EP)."""
    return (type(layout), layout.spec, layout.tp, layout.ep, dtype, int(bucket_bytes))


def _cached_plan(layout: TPLayout, dtype: torch.dtype, bucket_bytes: int) -> list[_bucket.Bucket]:
    key = _plan_key(layout, dtype, bucket_bytes)
    plan = _PLAN_CACHE.get(key)
    if plan is None:
        if len(_PLAN_CACHE) >= 64:
            clear_plan_cache()
        plan = _PLAN_CACHE[key] = _bucket.plan_buckets(
            [(n, dtype, s) for n, s in layout.engine_shapes().items()], bucket_bytes)
    return plan


def _cached_tasks(key: tuple, k: int, bkt: _bucket.Bucket, layout: TPLayout,
                  sources: dict[str, "_Source"]) -> list["_Task"]:
    """`_tasks` of bucket ``k``, reused while every source tensor is held the same way."""
    full = key + (k, tuple((n, s.shape, s.offsets, s.counts) for n, s in sources.items()))
    tasks = _TASK_CACHE.get(full)
    if tasks is None:
        if len(_TASK_CACHE) >= _CACHE_LIMIT:
            _TASK_CACHE.clear()
        tasks = _TASK_CACHE[full] = _tasks(bkt, layout, sources)
    return tasks


def default_owners(tp: int, world: int) -> list[list[int]]:
    """Colocated rule: group rank r assembles engine rank ``r % tp``'s buffer (so with world a
    multiple of tp, each engine replica's rank i sits next to its own buffer); with fewer trainer
    ranks than TP ranks, engine rank i's buffer is held by group rank ``i % world``."""
    return [[r for r in range(world) if r % tp == i] or [i % world] for i in range(tp)]


def exchange_bytes(layout: TPLayout, itemsize: int, counts: dict[str, Sequence[int]],
                   owners: Sequence[Sequence[int]] | None = None) -> list[tuple[int, int]]:
    """Pure: what each group rank receives and sends, ``(bytes_in, bytes_out)``, over a whole
    sync on the all-to-all path of `iter_rank_buckets`, from how the trainer ranks hold each HF
    tensor (``counts[name]``: elements per group rank, contiguous and in rank order, as FSDP2's
    ``Shard(0)`` or an FSDP1 flat parameter holds them) and the engine's ``itemsize``. The same
    blocks `_exchange` moves (`_tasks`, `_blocks`): bucket boundaries do not change the totals,
    so no bucket plan is needed. Planning (`fsdp_sync.plan`) calls it; the sync never does."""
    world = len(next(iter(counts.values()))) if counts else 1
    own = [list(o) for o in (owners if owners is not None else default_owners(layout.tp, world))]
    offsets = {n: tuple(sum(c[:r]) for r in range(world)) for n, c in counts.items()}
    bytes_in, bytes_out = [0] * world, [0] * world
    memo: dict[tuple, int] = {}
    for i in range(layout.tp):
        for ename, pieces in layout.sources(i).items():
            eshape = layout.engine_shapes()[ename]
            for hf, pl in pieces:
                shape, c = tuple(layout.full_shape(hf)), counts[hf]
                for t in range(world):
                    if not c[t]:
                        continue
                    a = offsets[hf][t]
                    key = (a, c[t], shape, block_of(pl.src, shape))
                    n = memo.get(key)
                    if n is None:
                        n = memo[key] = sum(b.numel for b in _blocks(a, a + c[t], shape, pl.src, pl.dst, eshape))
                    for o in own[i]:
                        if o != t and n:
                            bytes_out[t] += n * itemsize
                            bytes_in[o] += n * itemsize
    return list(zip(bytes_in, bytes_out))


# --------------------------------------------------------------------------- blocks

@dataclass(frozen=True)
class _Block:
    """A rectangle of one trainer rank's piece that lands in one engine rank's parameter.

    The piece's local elements ``[lo, lo + rows * width)`` viewed ``[rows, width]``, rows
    ``[r0, r1)`` x cols ``[c0, c1)`` of it, go to rows ``dr..`` cols ``dc..`` of the engine
    parameter's 2-D view."""

    lo: int
    rows: int
    width: int
    r0: int
    r1: int
    c0: int
    c1: int
    dr: int
    dc: int

    @property
    def numel(self) -> int:
        return (self.r1 - self.r0) * (self.c1 - self.c0)

    def src(self, local: torch.Tensor) -> torch.Tensor:
        seg = local[self.lo:self.lo + self.rows * self.width].view(self.rows, self.width)
        return seg[self.r0:self.r1, self.c0:self.c1]

    def dst(self, param2d: torch.Tensor) -> torch.Tensor:
        return param2d[self.dr:self.dr + self.r1 - self.r0, self.dc:self.dc + self.c1 - self.c0]

    def flat(self, cols: int) -> tuple[int, int, int] | None:
        """``(source element, destination element, count)`` where the block is one contiguous
        run on both sides (whole rows, or part of one row): the piece's local elements from the
        first and the engine parameter's (``cols`` wide) from the second; else None."""
        rows, width = self.r1 - self.r0, self.c1 - self.c0
        if rows != 1 and (self.c0 or width != self.width):
            return None
        if rows != 1 and (self.dc or width != cols):
            return None
        return self.lo + self.r0 * self.width + self.c0, self.dr * cols + self.dc, rows * width


def _dims(shape: tuple[int, ...]) -> tuple[int, int]:
    return view2d(shape)


def _blocks(a: int, b: int, shape: tuple[int, ...], src: tuple[slice, ...],
            dst: tuple[slice, ...], eshape: tuple[int, ...]) -> list[_Block]:
    """The parts of flat elements ``[a, b)`` of a tensor of ``shape`` inside block ``src``, and
    where they go in the engine parameter (``dst`` of ``eshape``). A contiguous element range is a
    partial first row, whole rows and a partial last row: at most three blocks."""
    _, C = _dims(shape)
    sr0, sr1, sc0, sc1 = block_of(src, shape)
    d0, _, e0, _ = block_of(dst, eshape)
    out: list[_Block] = []
    pos = a
    while pos < b:
        row, col = divmod(pos, C)
        if col or b - pos < C:
            rows, width = 1, min(C - col, b - pos)
        else:
            rows, width, col = (b - pos) // C, C, 0
        rr0, rr1 = max(row, sr0), min(row + rows, sr1)
        cc0, cc1 = max(col, sc0), min(col + width, sc1)
        if rr0 < rr1 and cc0 < cc1:
            out.append(_Block(pos - a, rows, width, rr0 - row, rr1 - row, cc0 - col, cc1 - col,
                              d0 + rr0 - sr0, e0 + cc0 - sc0))
        pos += rows * width
    return out


@dataclass
class _Source:
    """Where one HF tensor's data lives on the trainer ranks: contiguous element ranges."""

    name: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]      # element offset of each group rank's piece
    counts: tuple[int, ...]       # elements held by each group rank
    local: torch.Tensor | None    # this rank's piece, flat (None when it holds nothing)


@dataclass
class _Task:
    engine_rank: int
    entry: _bucket.BucketEntry
    holder: int
    name: str
    block: _Block
    # (source element, element of the engine rank's buffer viewed as the entry's dtype, count):
    # a block that is one run on both sides is copied as one 1-D slice of each (`_write_local`)
    run: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        flat = self.block.flat(_dims(self.entry.shape)[1])
        if flat is not None and self.entry.start % self.entry.dtype.itemsize == 0:
            self.run = (flat[0], self.entry.start // self.entry.dtype.itemsize + flat[1], flat[2])


def _tasks(bkt: _bucket.Bucket, layout: TPLayout, sources: dict[str, _Source]) -> list[_Task]:
    """Every block of every engine rank's entries, in one order all ranks agree on."""
    out = []
    for i in range(layout.tp):
        src_map = layout.sources(i)
        for e in bkt.entries:
            for hf, pl in src_map[e.name]:
                s = sources[hf]
                for t, (off, n) in enumerate(zip(s.offsets, s.counts)):
                    if n:
                        for blk in _blocks(off, off + n, s.shape, pl.src, pl.dst, e.shape):
                            out.append(_Task(i, e, t, hf, blk))
    return out


def _param2d(flat: torch.Tensor, e: _bucket.BucketEntry) -> torch.Tensor:
    return flat[e.start:e.end].view(e.dtype).view(_dims(e.shape))


def _zero_gaps(flat: torch.Tensor, bkt: _bucket.Bucket, layout: TPLayout, rank: int) -> None:
    """Alignment padding between entries and the vocab padding rows: nobody else writes them
    (one fused zero for the gaps, one ``zero_`` per padded parameter)."""
    _bucket.zero_gaps(flat, bkt.entries, bkt.nbytes)
    for e in bkt.entries:
        pad = layout.padding(e.name, rank)
        if pad is not None:
            _param2d(flat, e)[pad[0]].zero_()


# --------------------------------------------------------------------------- the stream

def _spans(n: int) -> str:
    return (f"the module's sharded tensors span {n} process groups (e.g. fully_shard of some "
            f"modules on a DeviceMesh of their own): per-rank buckets are cut over one shard group "
            f"(a DTensor gathered with full_tensor(), HSDP's 2-D mesh included, is in none); "
            f"layout='full' gathers each tensor over its own group")


def _group_of(items: list) -> Any:
    groups = {id(it.pieces.group): it.pieces.group for it in items if it.pieces is not None}
    if len(groups) > 1:   # the transports ask `rank_buckets_refusal` first: "auto" never gets here
        raise ValueError(f"{_spans(len(groups))}; use layout='full'")
    return next(iter(groups.values()), None)


def rank_buckets_refusal(module: nn.Module, fsdp1_state_dict: str = "local") -> str | None:
    """Why `iter_rank_buckets` cannot cut ``module`` (None: its sharding allows it): its sharded
    tensors span more than one process group. Found as the stream finds them (FSDP1 units'
    groups, but for the full state dict's whole tensors; FSDP2 ``Shard(0)`` DTensors' 1-D meshes;
    a DTensor gathered with ``full_tensor()`` is in none), from the module alone: no state dict,
    no collective, the same answer on every rank. The transports ask before they choose per-rank
    buckets, so ``layout="auto"`` sends full tensors (exact) and ``"engine"`` is refused before
    anything is sent."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    groups: dict[int, Any] = {}
    units = [m for m in submodules(module) if isinstance(m, FSDP)]
    if units:
        if fsdp1_state_dict == "full":
            return None
        for u in units:   # a sharded state dict over a device mesh hands out DTensors: none
            if u._handle is not None and u._handle.uses_sharded_strategy and not (
                    fsdp1_state_dict == "sharded" and getattr(u, "_device_mesh", None) is not None):
                groups[id(u.process_group)] = u.process_group
    else:
        cache: dict = {}
        for name, p in module.named_parameters():
            if getattr(p, "_spec", None) is None:      # not a DTensor
                continue
            try:
                pieces = dim0_pieces(name, p, cache)
            except ValueError:   # a shard that contradicts its shape: the stream names it
                continue
            if pieces is not None:
                groups[id(pieces.group)] = pieces.group
    return _spans(len(groups)) if len(groups) > 1 else None


def _check_names(items: list, layout: TPLayout, dtype: torch.dtype) -> None:
    want = layout.hf_shapes
    have = {it.name: it for it in items}
    unknown = [n for n in have if n not in want and not (n == "lm_head.weight" and layout.spec.tie_word_embeddings)]
    missing = [n for n in want if n not in have]
    if unknown or missing:
        raise ValueError(f"the module's tensors do not match the {layout.spec.model_type} layout at "
                         f"tp {layout.tp}: unknown {unknown[:3]}, missing {missing[:3]} (per-rank "
                         f"buckets need exactly the model's HF tensors)")
    for n, shape in want.items():
        it = have[n]
        if tuple(it.shape) != tuple(shape):
            raise ValueError(f"expected shape {tuple(shape)} for {n!r} (the layout's), got {tuple(it.shape)}")
        if not it.src_dtype.is_floating_point:
            raise TypeError(f"{n!r} has dtype {_bucket.dtype_name(it.src_dtype)}; the engine's weights are "
                            f"{_bucket.dtype_name(dtype)}")


def iter_rank_buckets(module: nn.Module, layout: TPLayout, bucket_bytes: int, *,
                      dtype: torch.dtype | None = None, fsdp1_state_dict: str = "local",
                      share_host_memory: bool = True, owners: Sequence[Sequence[int]] | None = None,
                      alloc: Callable[[int], torch.Tensor] = _handles.empty_shared,
                      stats: ReshardStats | None = None, host_sets: int = 1,
                      consumer_synced: bool = False, host_keep: list | None = None,
                      ranks: Sequence[int] | Callable[[int], Sequence[int]] | None = None) -> Iterator[RankBucket]:
    """Yield one `RankBucket` per planned bucket (`plan_rank_buckets`), collective over the
    module's shard group: every rank calls it with the same arguments and takes every item.

    ``dtype``: the engine's dtype (default: the module's, which must then be one dtype).
    ``owners[i]``: group ranks that get engine rank i's buffer on the all-to-all path (default
    `default_owners`). ``stats`` is filled in as the stream runs. ``host_sets``: how many sets
    of one-host buffers to rotate through (2 for a pipelined consumer: bucket k's buffers stay
    intact while bucket k+1 is written; they are rewritten by bucket k+2).
    ``consumer_synced``: the caller promises that before any rank asks for the bucket after
    next (the next one when ``host_sets`` is 1), every reader of this bucket's one-host buffers
    is done and every rank of the group knows it (the tensor transport's per-bucket ``agree``
    over the world does this): the one-host path then skips its barrier before writing, keeping
    only the one that says every rank's pieces are in.
    ``host_keep``: a list the caller keeps across calls (every rank its own, used alike): the
    one-host buffers are left in it and taken again by the next call when every rank still holds
    buffers that fit, so a caller that syncs again maps no new shared memory and faults none in
    (measured: 4 fresh 64 MiB buffers cost 0.45-1.1 s to make and touch, rewriting them 0.07 s);
    they stay allocated until the caller clears the list.
    ``ranks``: on the local path (no shard group: every rank holds or materializes each tensor
    whole), the engine ranks whose buffers this rank builds, or a function of the bucket's index
    that names them (default: all; the tensor transport its own infer-TP rank). The other paths
    ignore it: the all-to-all builds what ``owners`` gives this rank, the one-host path shares all.
    """
    stats = stats if stats is not None else ReshardStats()
    items = _export.resolve(module, fsdp1_state_dict, dtype)
    stats.bytes_in += _export.state_dict_bytes_in(module, fsdp1_state_dict)   # FSDP1 full / sharded
    group = _group_of(items) if items else None
    world = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    me = dist.get_rank(group) if world > 1 else 0
    error: BaseException | None = None
    plan: list[_bucket.Bucket] = []
    try:
        if dtype is None:
            dtypes = {it.src_dtype for it in items}
            if len(dtypes) != 1:
                raise TypeError(f"the module holds several dtypes {sorted(map(str, dtypes))}: pass dtype=")
            dtype = dtypes.pop()
        _check_names(items, layout, dtype)
        plan = _cached_plan(layout, dtype, bucket_bytes)
        own = [list(o) for o in (owners if owners is not None else default_owners(layout.tp, world))]
        # (owners are used only on the all-to-all path: with no shard group, every rank holds all)
        if world > 1 and (len(own) != layout.tp or any(not o or any(not 0 <= r < world for r in o) for o in own)):
            raise ValueError(f"owners must list, for each of the {layout.tp} engine ranks, group ranks "
                             f"in [0, {world}), got {own}")
        if ranks is not None and not callable(ranks):
            _wanted(ranks, 0, layout.tp)
    except Exception as exc:  # noqa: BLE001 - every peer must hear of it
        error = exc
    if world > 1:
        agree(error, group, what="per-rank buckets")
    elif error is not None:
        raise error
    if _tied.needs_check((it.name for it in items), layout.spec.tie_word_embeddings):
        # after the names are agreed: on the gather path it is collective
        refused = _tied.head_refusal(items, layout.spec.tie_word_embeddings)
        if world > 1:
            agree(refused, group, what="per-rank buckets")
        elif refused is not None:
            raise ValueError(refused)
    by_name = {it.name: (i, it) for i, it in enumerate(items)}
    # a bucket's buffers are agreed before its collective: the all-to-all's, full_tensor()'s
    agree_over = group if world > 1 else full_tensor_group(items)
    host = _host_buffers(group, layout.tp * max(1, host_sets), max((b.nbytes for b in plan), default=0),
                         host_keep) if share_host_memory and world > 1 and _host_eligible(items) else None
    stats.path = "host-shared" if host is not None else ("all-to-all" if world > 1 else "local")
    stats.engine_shard_bytes += layout.engine_bytes(dtype.itemsize)
    key = _plan_key(layout, dtype, bucket_bytes)
    for k, bkt in enumerate(plan):
        # every HF tensor any engine rank's part of this bucket is built from (under EP, ranks
        # hold different experts under the same engine names)
        names = list(dict.fromkeys(hf for i in range(layout.tp) for e in bkt.entries
                                   for hf, _ in layout.sources(i)[e.name]))
        if host is None and world == 1:
            buffers = _fill_local(k, bkt, layout, [by_name[n] for n in names], dtype, key,
                                  _wanted(range(layout.tp) if ranks is None else ranks, k, layout.tp),
                                  alloc, stats, agree_over)
        else:
            sources = {n: _source(by_name[n][1], by_name[n][0], world, me, dtype, stats) for n in names}
            for n in names:
                by_name[n][1].drop()
            tasks = _cached_tasks(key, k, bkt, layout, sources)
            if host is not None:
                buffers = _fill_host(host, bkt, layout, tasks, sources, stats, (k % max(1, host_sets)) * layout.tp,
                                     wait_readers=not consumer_synced)
            else:
                buffers = _exchange(k, bkt, layout, tasks, sources, own, group, me, alloc, stats)
            del sources, tasks
        stats.buckets += 1
        yield RankBucket(k, bkt, buffers, shared=host is not None)
        del buffers


def _wanted(ranks: Sequence[int] | Callable[[int], Sequence[int]], k: int, tp: int) -> list[int]:
    """The engine ranks whose buffers of bucket ``k`` this rank builds on the local path."""
    got = ranks(k) if callable(ranks) else ranks
    out = sorted({int(i) for i in got})
    if any(not 0 <= i < tp for i in out):
        raise ValueError(f"ranks must name engine ranks in [0, {tp}), got {out} for bucket {k}")
    return out


def _materialize(it: Any, dtype: torch.dtype, stats: ReshardStats) -> torch.Tensor:
    """A DTensor's ``full_tensor()`` (collective), what it gathered counted as received (and as
    what the all-gather of `export.iter_buckets` would have received: the same)."""
    got = Received()
    full = materialize(it, dtype, got)
    stats.bytes_in += got.bytes_in
    stats.allgather_bytes_in += got.bytes_in
    return full


def _source(it: Any, index: int, world: int, me: int, dtype: torch.dtype, stats: ReshardStats) -> _Source:
    """Element ranges of one exported tensor (materializing a DTensor that needs full_tensor())."""
    numel = math.prod(it.shape)
    if it.pieces is not None:
        counts = tuple(it.pieces.counts)
        local = it.pieces.local.reshape(-1)
        stats.allgather_bytes_in += (numel - counts[me]) * dtype.itemsize
    else:
        full = it.full if it.full is not None else _materialize(it, dtype, stats)
        holder = index % world
        counts = tuple(numel if r == holder else 0 for r in range(world))
        local = full.reshape(-1)
    return _Source(it.name, tuple(it.shape), _offsets(counts), counts, local if counts[me] else None)


@functools.lru_cache(maxsize=4096)
def _offsets(counts: tuple[int, ...]) -> tuple[int, ...]:
    """Where each rank's piece starts: the running sum of ``counts`` (a few distinct splits a
    model, asked for every tensor of every sync)."""
    return (0, *itertools.accumulate(counts[:-1])) if counts else ()


def _fill_local(k: int, bkt: _bucket.Bucket, layout: TPLayout, items: list, dtype: torch.dtype, key: tuple,
                wanted: list[int], alloc: Callable[[int], torch.Tensor], stats: ReshardStats,
                group: Any = None) -> dict[int, torch.Tensor]:
    """Bucket ``k`` where this rank holds every tensor whole (a plain module, FSDP1's full state
    dict, DTensors gathered with ``full_tensor()`` such as HSDP's, one trainer rank): only the
    buffers of the engine ranks in ``wanted``. The tensors held whole go in with one fused copy;
    each DTensor is then materialized (collective: every rank, whatever it builds), written and
    dropped before the next, so a rank holds its buffers and one full tensor, never the bucket's
    full tensors (tp x a bucket of per-rank shards). ``items``: (export index, item) pairs.
    ``group``: where the bucket materializes a DTensor, its buffers are agreed over it first."""
    later = [(n, it) for n, it in items if it.dtensor is not None]
    buffers = alloc_buffers(alloc, bkt, k, wanted, group if later else None)
    for i, flat in buffers.items():
        _zero_gaps(flat, bkt, layout, i)
    sources = {it.name: _source(it, n, 1, 0, dtype, stats) for n, it in items if it.dtensor is None}
    for _, it in later:     # where its data will be: all of it on this rank, once materialized
        sources[it.name] = _Source(it.name, tuple(it.shape), (0,), (math.prod(it.shape),), None)
    tasks = _cached_tasks(key, k, bkt, layout, sources)
    by_name: dict[str, list[_Task]] = {}
    for t in tasks if later else ():
        by_name.setdefault(t.name, []).append(t)
    whole = [t for t in tasks if sources[t.name].local is not None] if later else tasks
    _write_local(whole, sources, buffers, 0, stats)
    for _, it in items:
        if it.dtensor is None:
            it.drop()
    for _, it in later:
        sources[it.name].local = _materialize(it, dtype, stats).reshape(-1)
        it.drop()
        _write_local(by_name.get(it.name, []), sources, buffers, 0, stats)
        sources[it.name].local = None
    return buffers


def _write_local(tasks: list[_Task], sources: dict[str, _Source], buffers: dict[int, torch.Tensor],
                 me: int, stats: ReshardStats) -> None:
    """This rank's blocks into the engine ranks' buffers it holds, in one fused copy. A block
    that is one run on both sides (a whole tensor, whole rows) is a 1-D slice of the buffer
    viewed once per dtype: one view a block, not six (2-D views of the parameter and the piece,
    ~3 us each: 7 ms of a 338-tensor sync on this host, the same on a GPU host's CPU)."""
    params: dict[tuple[int, str], torch.Tensor] = {}     # one 2-D view per engine parameter
    typed: dict[int, dict] = {}           # each engine rank's buffer viewed once per dtype
    dsts, srcs = [], []
    written = 0
    with torch.no_grad():
        for t in tasks:
            if t.holder == me and t.engine_rank in buffers:
                local = sources[t.name].local
                if t.run is not None:
                    s0, d0, n = t.run
                    views = typed.setdefault(t.engine_rank, {})
                    dsts.append(_bucket.typed_view(buffers[t.engine_rank], t.entry.dtype, views)[d0:d0 + n])
                    srcs.append(local if s0 == 0 and n == local.numel() else local[s0:s0 + n])
                else:
                    key = (t.engine_rank, t.entry.name)
                    p2d = params.get(key)
                    if p2d is None:
                        p2d = params[key] = _param2d(buffers[t.engine_rank], t.entry)
                    dsts.append(t.block.dst(p2d))
                    srcs.append(t.block.src(local))
                written += t.block.numel * t.entry.dtype.itemsize
        stats.bytes_written += written
        _bucket.copy_many(dsts, srcs)     # one fused copy for the bucket, not one per block


def _exchange(k: int, bkt: _bucket.Bucket, layout: TPLayout, tasks: list[_Task], sources: dict[str, _Source],
              owners: list[list[int]], group: Any, me: int, alloc: Callable, stats: ReshardStats
              ) -> dict[int, torch.Tensor]:
    """One all_to_all_single: trainer rank t sends owner o the blocks of o's engine ranks it holds
    (bucket ``k``'s buffers agreed over ``group`` first, `alloc_buffers`)."""
    world = dist.get_world_size(group)
    itemsize = bkt.entries[0].dtype.itemsize if bkt.entries else 1
    buffers = alloc_buffers(alloc, bkt, k, [i for i in range(layout.tp) if me in owners[i]], group)
    for i, flat in buffers.items():
        _zero_gaps(flat, bkt, layout, i)
    # send[o]: my blocks for o's engine ranks; recv[t]: t's blocks for my engine ranks (same order)
    send_sizes, recv_sizes = [0] * world, [0] * world
    for t in tasks:
        for o in owners[t.engine_rank]:
            if t.holder == me and o != me:
                send_sizes[o] += t.block.numel * itemsize
            if o == me and t.holder != me:
                recv_sizes[t.holder] += t.block.numel * itemsize
    # a rank that owns no buffer (e.g. owners=[[0]] * tp) sends from where its shards live (NCCL)
    device = next(iter(buffers.values())).device if buffers else next(
        (s.local.device for s in sources.values() if s.local is not None), torch.device("cpu"))
    send = torch.empty(sum(send_sizes), dtype=torch.uint8, device=device)
    recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    s_pos = [sum(send_sizes[:o]) for o in range(world)]
    with torch.no_grad():
        dsts, srcs = [], []           # one fused copy for the packing, one for the unpacking
        for t in tasks:
            if t.holder != me:
                continue
            src = t.block.src(sources[t.name].local)
            nb = t.block.numel * itemsize
            for o in owners[t.engine_rank]:
                if o == me:
                    dsts.append(t.block.dst(_param2d(buffers[t.engine_rank], t.entry)))
                    stats.bytes_written += nb
                else:
                    dsts.append(send[s_pos[o]:s_pos[o] + nb].view(t.entry.dtype).view(src.shape))
                    s_pos[o] += nb
                srcs.append(src)
        _bucket.copy_many(dsts, srcs)
        dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=data_group(group, send))
        r_pos = [sum(recv_sizes[:t]) for t in range(world)]
        dsts, srcs = [], []
        for t in tasks:
            if t.holder == me or me not in owners[t.engine_rank]:
                continue
            nb = t.block.numel * itemsize
            piece = recv[r_pos[t.holder]:r_pos[t.holder] + nb].view(t.entry.dtype)
            dst = t.block.dst(_param2d(buffers[t.engine_rank], t.entry))
            dsts.append(dst)
            srcs.append(piece.view(dst.shape))
            r_pos[t.holder] += nb
            stats.bytes_written += nb
        _bucket.copy_many(dsts, srcs)
    stats.bytes_in += sum(recv_sizes)
    stats.bytes_out += sum(send_sizes)
    return buffers


# --------------------------------------------------------------------------- one host

def _host_eligible(items: list) -> bool:
    for it in items:
        if it.pieces is not None and it.pieces.local.device.type != "cpu":
            return False
        if it.full is not None and it.full.device.type != "cpu":
            return False
    return True


def _host_buffers(group: Any, count: int, nbytes: int, keep: list | None) -> HostShared | None:
    """`HostShared.create`, or (``keep``) the buffers the last call left there when every rank's
    fit: same group, count and at least ``nbytes`` each (collective: one small all-gather)."""
    if keep is None:
        return HostShared.create(group, count, nbytes)
    old = keep[0] if keep else None
    fits = old is not None and old.group is cpu_group(group) and len(old.bufs) == count \
        and all(b.numel() >= nbytes for b in old.bufs)
    votes: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(votes, fits, group=cpu_group(group))
    if all(votes):
        return old
    keep.clear()
    del old
    host = HostShared.create(group, count, nbytes)
    if host is not None:
        keep.append(host)
    return host


def _fill_host(host: HostShared, bkt: _bucket.Bucket, layout: TPLayout, tasks: list[_Task],
               sources: dict[str, _Source], stats: ReshardStats, first: int = 0,
               wait_readers: bool = True) -> dict[int, torch.Tensor]:
    """Bucket ``bkt``'s per-engine-rank buffers in ``host``'s buffers ``first .. first + tp``:
    every rank writes its own pieces, group rank 0 zeroes the gaps."""
    buffers = {i: host.bufs[first + i][:bkt.nbytes] for i in range(layout.tp)}

    def write() -> None:
        if host.me == 0:
            for i, flat in buffers.items():
                _zero_gaps(flat, bkt, layout, i)
        _write_local(tasks, sources, buffers, host.me, stats)

    host.fill(write, wait_readers=wait_readers)
    return buffers
