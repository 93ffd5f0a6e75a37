"""Bucket planning and flattening: many tensors into one aligned uint8 buffer, and back.

`plan_buckets` is a pure function of tensor metadata (name, dtype, shape) and a byte budget: it
keeps the order, never splits a tensor, gives a tensor larger than the budget a bucket of its own,
and aligns every tensor's byte offset. `flatten` copies tensors into one buffer laid out by a
plan; `unflatten` gives zero-copy views back. `copy_many` and `zero_gaps` are the fused copies
every packer of a bucket uses (here, `gather`, `reshard`, `quantize`): one kernel per dtype pair
and one for the padding, not one per tensor (on a GPU each ``copy_`` is a kernel launch). `sglang_metadata` writes a plan in the form SGLang's
`load_format="flattened_bucket"` reads (byte offsets; SGLang itself adds no padding, so the
alignment here is what keeps e.g. a ``bf16[3]`` followed by an ``int64`` rebuildable).

This module moves no data between processes (see `handles`) and talks to no process group.
"""

from __future__ import annotations

import collections
import functools
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Iterable, Mapping, Sequence

import torch

__all__ = [
    "ALIGNMENT", "SUPPORTED_DTYPES", "TensorMeta", "BucketEntry", "Bucket",
    "plan_buckets", "plan_one", "BucketPacker", "flatten", "unflatten", "sglang_metadata", "entries_from_metadata",
    "check_tensor", "dtype_name", "plan_tight", "check_tight", "copy_many", "zero_gaps", "entry_views",
    "typed_view", "entry_flat", "KnownMetadata",
]

ALIGNMENT = 16
"""Minimum byte alignment of every tensor inside a flattened bucket (covers every dtype's itemsize)."""

SUPPORTED_DTYPES: frozenset[torch.dtype] = frozenset(
    d for d in (
        torch.float32, torch.float16, torch.bfloat16, torch.float64,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
        getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None),
        getattr(torch, "float8_e4m3fnuz", None), getattr(torch, "float8_e5m2fnuz", None),
    ) if d is not None
)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _align(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class TensorMeta:
    """What the planner needs to know of a tensor: no data."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "TensorMeta":
        return cls(name, tensor.dtype, tuple(tensor.shape))


@dataclass(frozen=True)
class BucketEntry:
    """One tensor's place in a flattened bucket: bytes ``[start, end)``."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Bucket:
    """A planned bucket: entries in order, and the buffer size including alignment padding."""

    entries: tuple[BucketEntry, ...]
    nbytes: int

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    @property
    def payload_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


def plan_buckets(metas: Iterable[TensorMeta | tuple], bucket_bytes: int, *,
                 alignment: int = ALIGNMENT) -> list[Bucket]:
    """Group tensors, in order, into buckets of at most ``bucket_bytes`` (padding included).

    A tensor larger than the budget gets a bucket of its own, as does a lone tensor whose end,
    padded to ``alignment``, passes a budget that is no multiple of it (budget 10, one 10-byte
    tensor: a 16-byte bucket). Every entry's start is a multiple of ``alignment``. Names must be
    unique. (`BucketPacker` is this rule one tensor at a time.)
    """
    metas = tuple(m if isinstance(m, TensorMeta) else TensorMeta(m[0], m[1], tuple(m[2])) for m in metas)
    return list(_plan(metas, bucket_bytes, alignment))


def plan_one(metas: Sequence[TensorMeta]) -> Bucket:
    """Every tensor of ``metas`` in ONE bucket (a budget that holds them all, alignment included):
    the adapter's kept bucket (`adapter_export`, `plan_lora`), the engine's packed plain tensors."""
    return plan_buckets(metas, sum(m.nbytes for m in metas) + 64 * (len(metas) + 1))[0]


# every sync plans the same tensors (2.5 ms for 338 on this host); few are kept, each holding
# every tensor of a model
@functools.lru_cache(maxsize=4)
def _plan(metas: tuple, bucket_bytes: int, alignment: int) -> tuple[Bucket, ...]:
    packer = BucketPacker(bucket_bytes, alignment=alignment)
    buckets = [b for b in (packer.add(m)[0] for m in metas) if b is not None]
    last = packer.finish()
    return tuple(buckets + [last] if last is not None else buckets)


class BucketPacker:
    """`plan_buckets` one tensor at a time, for a stream whose tensors are not known ahead (verl's
    checkpoint engine gets a generator): `add` places a tensor and says which bucket, if any, it
    closed; `finish` closes the last one. The same rule and errors as `plan_buckets`, which is
    built on it. Pure: no data, no process group.
    """

    def __init__(self, bucket_bytes: int, *, alignment: int = ALIGNMENT) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self.bucket_bytes, self.alignment = bucket_bytes, alignment
        self._current: list[BucketEntry] = []
        self._offset = 0
        self._seen: set[str] = set()

    def add(self, m: TensorMeta | tuple) -> tuple[Bucket | None, BucketEntry]:
        """Place one tensor: ``(the bucket this closed, or None; its entry in the open bucket)``.

        An entry with ``start == 0`` and ``nbytes > bucket_bytes`` is alone in its bucket."""
        meta = m if isinstance(m, TensorMeta) else TensorMeta(m[0], m[1], tuple(m[2]))
        if meta.name in self._seen:
            raise ValueError(f"tensor name {meta.name!r} appears twice in the bucket plan")
        self._seen.add(meta.name)
        if meta.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"unsupported dtype {meta.dtype} for {meta.name!r}; supported: "
                            f"{sorted(dtype_name(d) for d in SUPPORTED_DTYPES)}")
        closed = None
        start = _align(self._offset, self.alignment)
        # the bucket's size includes its trailing alignment padding: compare that, or a bucket of
        # several tensors could exceed the budget by up to ``alignment - 1`` bytes
        if self._current and _align(start + meta.nbytes, self.alignment) > self.bucket_bytes:
            closed = self.finish()
            start = 0
        entry = BucketEntry(meta.name, meta.dtype, meta.shape, start, start + meta.nbytes)
        self._current.append(entry)
        self._offset = entry.end
        return closed, entry

    def finish(self) -> Bucket | None:
        """Close the open bucket (None when it is empty); the packer goes on from an empty one."""
        if not self._current:
            return None
        bucket = Bucket(tuple(self._current), _align(self._offset, self.alignment))
        self._current, self._offset = [], 0
        return bucket


def check_tensor(name: str, tensor: torch.Tensor, *, dtype: torch.dtype | None = None,
                 shape: Sequence[int] | None = None, device: torch.device | str | None = None) -> None:
    """Raise a ValueError/TypeError that names the tensor and what was expected."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor for {name!r}, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"unsupported dtype {tensor.dtype} for {name!r}")
    if dtype is not None and tensor.dtype != dtype:
        raise TypeError(f"expected dtype {dtype_name(dtype)} for {name!r}, got {dtype_name(tensor.dtype)}")
    if shape is not None and tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"expected shape {tuple(shape)} for {name!r}, got {tuple(tensor.shape)}")
    if device is not None and tensor.device.type != torch.device(device).type:
        raise ValueError(f"expected {name!r} on device {torch.device(device)}, got {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError(f"expected a contiguous tensor for {name!r}, got strides {tensor.stride()} "
                         f"for shape {tuple(tensor.shape)}")


# dtypes every ``_foreach_copy_`` kernel takes, casts between them included (CUDA's fused one
# too); pairs of one other dtype (FP8, bool) are copied as bytes, other casts one ``copy_`` each
_FOREACH_TYPED = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64,
                            torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})
_FOREACH_CAST = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})


def _bytes(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as uint8 (same memory), or None where a dtype view cannot express it."""
    if t.dim() == 0 or (t.stride(-1) != 1 and t.shape[-1] != 1):
        return None
    try:
        return t.view(torch.uint8)
    except RuntimeError:
        return None


def copy_many(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """``dsts[i].copy_(srcs[i])`` for every i (casting where the dtypes differ; shapes must be
    equal), in one ``torch._foreach_copy_`` per (destination dtype, source dtype, device) instead
    of one ``copy_`` per pair: a GPU runs each as one multi-tensor kernel where the pairs are dense
    and shaped alike (pair by pair inside the op otherwise), a CPU copies pair by pair inside the
    op, without Python's per-tensor dispatch. Same-dtype pairs of FP8 or bool are copied as their
    bytes; casts outside the plain float dtypes, pairs across devices and 0-d bytes pairs go one
    ``copy_`` each. No temporaries: each source goes straight into its destination."""
    if len(dsts) != len(srcs):
        raise ValueError(f"copy_many: {len(dsts)} destinations for {len(srcs)} sources")
    groups: dict[tuple, tuple[list, list]] = {}
    for d, s in zip(dsts, srcs):
        if d.shape != s.shape:
            raise ValueError(f"copy_many: destination shape {tuple(d.shape)} != source shape {tuple(s.shape)}")
        dd, sd = d.dtype, s.dtype
        if d.device != s.device:
            d.copy_(s)
            continue
        if dd == sd and dd not in _FOREACH_TYPED:
            db, sb = _bytes(d), _bytes(s)
            if db is None or sb is None:
                d.copy_(s)
                continue
            d, s, dd, sd = db, sb, torch.uint8, torch.uint8
        elif dd != sd and not (dd in _FOREACH_CAST and sd in _FOREACH_CAST):
            d.copy_(s)
            continue
        lists = groups.get((dd, sd, d.device))
        if lists is None:
            lists = groups[(dd, sd, d.device)] = ([], [])
        lists[0].append(d)
        lists[1].append(s)
    for ds, ss in groups.values():
        torch._foreach_copy_(ds, ss)


def zero_gaps(flat: torch.Tensor, entries: Iterable[BucketEntry], nbytes: int) -> None:
    """Zero the bytes of ``flat[:nbytes]`` outside every entry (alignment padding, trailing
    bytes; entries in byte order): one fused ``_foreach_zero_``, not one ``zero_`` per gap."""
    gaps, prev = [], 0
    for e in entries:
        if e.start > prev:
            gaps.append(flat[prev:e.start])
        prev = max(prev, e.end)
    if nbytes > prev:
        gaps.append(flat[prev:nbytes])
    if gaps:
        torch._foreach_zero_(gaps)


def entry_views(flat: torch.Tensor, bucket: Bucket, shaped: bool = True) -> list[torch.Tensor]:
    """One view per entry of ``bucket`` into ``flat`` (its dtype; its shape, or 1-D with
    ``shaped=False``), cut with one ``split`` of the bucket instead of a slice and views each
    (entries in byte order; a bucket of one dtype is viewed as that dtype once)."""
    sizes, keep, prev = [], [], 0
    dtypes = {e.dtype for e in bucket.entries}
    one = dtypes.pop() if len(dtypes) == 1 else None
    unit = one.itemsize if one is not None else 1
    for e in bucket.entries:
        if e.start < prev:
            raise ValueError(f"entry {e.name!r} starts at byte {e.start}, before the previous one ends ({prev})")
        if e.start > prev:
            sizes.append((e.start - prev) // unit)
            keep.append(False)
        sizes.append(e.nbytes // unit)
        keep.append(True)
        prev = e.end
    if not sizes:
        return []
    base = flat[:prev] if one is None else flat[:prev].view(one)
    views = [p for p, k in zip(base.split(sizes), keep) if k]
    if one is None:
        views = [v.view(e.dtype) for v, e in zip(views, bucket.entries)]
    if not shaped:
        return views
    return [v if len(e.shape) == 1 else v.view(e.shape) for v, e in zip(views, bucket.entries)]


def flatten(bucket: Bucket, tensors: Mapping[str, torch.Tensor] | Sequence[torch.Tensor], *,
            out: torch.Tensor | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """Copy ``tensors`` into one uint8 buffer laid out by ``bucket``; return the buffer.

    ``tensors`` is a mapping by name or a sequence in the bucket's order. Each tensor must have the
    planned dtype and shape. ``out`` (uint8, at least ``bucket.nbytes``) lets the caller choose
    where the buffer lives (e.g. shared memory); padding bytes are zeroed.
    """
    seq = [tensors[e.name] for e in bucket.entries] if isinstance(tensors, Mapping) else list(tensors)
    if len(seq) != len(bucket.entries):
        raise ValueError(f"bucket has {len(bucket.entries)} entries, got {len(seq)} tensors")
    if out is None:
        dev = device if device is not None else (seq[0].device if seq else "cpu")
        out = torch.empty(bucket.nbytes, dtype=torch.uint8, device=dev)
    elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < bucket.nbytes:
        raise ValueError(f"out must be a 1-D uint8 tensor of at least {bucket.nbytes} bytes, got "
                         f"{out.dtype} {tuple(out.shape)}")
    for entry, t in zip(bucket.entries, seq):
        check_tensor(entry.name, t, dtype=entry.dtype, shape=entry.shape)
    zero_gaps(out, bucket.entries, bucket.nbytes)
    # one fused copy, not one per tensor; flat views on both sides (one view op per tensor)
    copy_many(entry_views(out, bucket, shaped=False), [t if t.dim() == 1 else t.view(-1) for t in seq])
    return out


def typed_view(flat: torch.Tensor, dtype: torch.dtype, views: dict) -> torch.Tensor:
    """A uint8 buffer's whole elements of ``dtype`` (trailing odd bytes left out), made once per
    dtype and kept in ``views``: an entry is then one slice of it (element ``start // itemsize``
    on), not a slice and a dtype view (two ops of ~3 us, per tensor per sync)."""
    view = views.get(dtype)
    if view is None:
        n = flat.numel()
        view = views[dtype] = flat[:n - n % dtype.itemsize].view(dtype)
    return view


def entry_flat(flat: torch.Tensor, e: BucketEntry, views: dict) -> torch.Tensor:
    """Entry ``e``'s bytes of ``flat`` as a 1-D tensor of its dtype: one slice of `typed_view`."""
    isz = e.dtype.itemsize
    return typed_view(flat, e.dtype, views)[e.start // isz:e.end // isz]


def unflatten(flat: torch.Tensor, entries: Iterable[BucketEntry]) -> list[tuple[str, torch.Tensor]]:
    """Zero-copy views ``(name, tensor)`` into ``flat`` for each entry."""
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"a flattened bucket is a 1-D uint8 tensor, got {flat.dtype} {tuple(flat.shape)}")
    out = []
    size = flat.numel()
    views: dict[torch.dtype, torch.Tensor] = {}
    for e in entries:
        isz = e.dtype.itemsize
        if e.end > size or e.start < 0 or e.end - e.start != math.prod(e.shape) * isz:
            raise ValueError(f"entry {e.name!r} [{e.start}, {e.end}) does not fit a buffer of "
                             f"{size} bytes for shape {e.shape} {dtype_name(e.dtype)}")
        if e.start % isz:
            raise ValueError(f"entry {e.name!r} starts at byte {e.start}, not a multiple of "
                             f"{isz} ({dtype_name(e.dtype)})")
        out.append((e.name, entry_flat(flat, e, views).view(e.shape)))
    return out


def sglang_metadata(bucket: Bucket) -> list[SimpleNamespace]:
    """The bucket's entries as SGLang's flattened-bucket metadata (byte offsets; ``numel`` in bytes).

    Plain `SimpleNamespace` objects with builtin/torch fields: SGLang's deserializer allows them.
    """
    return [SimpleNamespace(name=e.name, shape=torch.Size(e.shape), dtype=e.dtype,
                            start_idx=e.start, end_idx=e.end, numel=e.nbytes)
            for e in bucket.entries]


def entries_from_metadata(metadata: Iterable) -> list[BucketEntry]:
    """Read SGLang-form metadata (objects or dicts with name/shape/dtype/start_idx/end_idx).

    A producer we did not write may send anything, so every field is checked here: the name is a
    non-empty string, the dtype a supported torch dtype, the shape non-negative ints, the byte range
    ``[start_idx, end_idx)`` ordered, as long as shape x itemsize (and as ``numel`` when given), and
    no two entries overlap. Raises `ValueError` naming the entry and the field.
    """
    if not isinstance(metadata, (list, tuple)):
        raise ValueError(f"bucket metadata is a list of entries, got {type(metadata).__name__}")
    out = []
    for i, m in enumerate(metadata):
        get = m.get if isinstance(m, dict) else (lambda k, _m=m: getattr(_m, k))
        name, dtype, shape = get("name"), get("dtype"), get("shape")
        if not isinstance(name, str) or not name:
            raise ValueError(f"bucket metadata entry {i}: name {name!r:.80} is not a non-empty string")
        if not isinstance(dtype, torch.dtype) or dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"bucket metadata entry {name!r}: unknown dtype {dtype!r:.60}; supported: "
                             f"{sorted(dtype_name(d) for d in SUPPORTED_DTYPES)}")
        if not (isinstance(shape, (list, tuple)) and all(type(x) is int for x in shape)):
            raise ValueError(f"bucket metadata entry {name!r}: shape {shape!r:.80} is not a tuple of ints")
        if any(x < 0 for x in shape):
            raise ValueError(f"bucket metadata entry {name!r}: negative shape {tuple(shape)}")
        start, end = get("start_idx"), get("end_idx")
        if type(start) is not int or type(end) is not int or not 0 <= start <= end:
            raise ValueError(f"bucket metadata entry {name!r}: byte range [{start!r:.30}, {end!r:.30}) "
                             f"is not 0 <= start <= end")
        nbytes = math.prod(shape) * dtype.itemsize
        if end - start != nbytes:
            raise ValueError(f"bucket metadata entry {name!r}: shape {tuple(shape)} "
                             f"{dtype_name(dtype)} is {nbytes} bytes, but its range [{start}, {end}) "
                             f"is {end - start}")
        numel = get("numel") if (isinstance(m, dict) and "numel" in m) or hasattr(m, "numel") else None
        if numel is not None and numel != nbytes:
            raise ValueError(f"bucket metadata entry {name!r}: numel {numel!r:.30} does not match shape "
                             f"{tuple(shape)} {dtype_name(dtype)} ({nbytes} bytes)")
        out.append(BucketEntry(name, dtype, tuple(shape), start, end))
    spans = sorted((e.start, e.end, e.name) for e in out if e.end > e.start)
    for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise ValueError(f"bucket metadata entries {n0!r} [{s0}, {e0}) and {n1!r} [{s1}, {e1}) "
                             f"overlap")
    return out


def _fields(m: object) -> dict:
    return m if type(m) is dict else vars(m)


def _plain(v: object) -> bool:
    t = type(v)
    return (t in (str, int, bool, float, type(None), torch.dtype)
            or t in (tuple, list, torch.Size) and all(type(x) is int for x in v))


class KnownMetadata:
    """Bucket metadata a receiver has checked (`entries_from_metadata`), kept for the next payload
    that carries the same: a trainer sends the same buckets sync after sync, and checking the
    fields of qwen2-1500m's six engine-layout buckets took 0.48 ms of each sync's engine calls on
    this project's CPU host, 0.02 ms once known (`dev/metadata_check_ab.py`).
    A payload's metadata is taken as known only when it equals a kept one field for field (a list
    of `SimpleNamespace` or dict entries, compared as Python compares them); its entries are then
    the kept, checked ones, never the payload's own values (so an equal value of another type,
    ``True`` for ``1``, is read as the checked one). Anything else is checked in full, and then
    kept. At most ``size`` buckets are kept, the least recently used dropped first."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._kept: "collections.OrderedDict[tuple, tuple[list, list[BucketEntry]]]" = collections.OrderedDict()
        self.hits = self.misses = 0

    @staticmethod
    def _key(metadata: object) -> tuple | None:
        if type(metadata) is not list or not metadata:
            return None
        m = metadata[0]
        name = m.get("name") if type(m) is dict else (m.name if type(m) is SimpleNamespace else None)
        return (len(metadata), name) if type(name) is str else None

    def entries(self, metadata: object) -> list[BucketEntry]:
        """``entries_from_metadata(metadata)`` (its errors too), from the kept ones when known."""
        key = self._key(metadata)
        kept = self._kept.get(key) if key is not None else None
        if kept is not None and kept[0] == metadata:
            self._kept.move_to_end(key)
            self.hits += 1
            return list(kept[1])
        entries = entries_from_metadata(metadata)
        self.misses += 1
        if key is not None and all(type(m) in (dict, SimpleNamespace) and all(map(_plain, _fields(m).values()))
                                   for m in metadata):
            self._kept[key] = (metadata, entries)     # (never a payload's tensor: it would stay mapped)
            self._kept.move_to_end(key)
            while len(self._kept) > self.size:
                self._kept.popitem(last=False)
        return list(entries)


def plan_tight(metas: Iterable[TensorMeta | tuple], bucket_bytes: int) -> list[Bucket]:
    """Buckets in SGLang's broadcast layout (``update_weights_from_distributed``, flattened):
    tightly packed in order, no padding, so the receiver, which computes the offsets itself from
    names, dtypes and shapes, finds every tensor where the sender put it.

    SGLang needs each offset to be a multiple of its dtype's size; where the next tensor's offset
    would not be (a ``bf16[3]`` followed by an ``fp32``), it starts a new bucket instead of padding.
    """
    buckets: list[Bucket] = []
    current: list[BucketEntry] = []
    offset = 0
    for m in plan_buckets(metas, max(bucket_bytes, 1), alignment=1):   # names, dtypes checked there
        for e in m.entries:
            size = e.nbytes
            if current and (offset % e.dtype.itemsize or offset + size > bucket_bytes):
                buckets.append(Bucket(tuple(current), offset))
                current, offset = [], 0
            current.append(BucketEntry(e.name, e.dtype, e.shape, offset, offset + size))
            offset += size
    if current:
        buckets.append(Bucket(tuple(current), offset))
    for b in buckets:
        check_tight(b)
    return buckets


def check_tight(bucket: Bucket) -> None:
    """Raise ValueError unless ``bucket`` is in SGLang's broadcast layout (see `plan_tight`)."""
    offset = 0
    for e in bucket.entries:
        if e.start != offset:
            raise ValueError(f"{e.name!r} starts at byte {e.start}; SGLang's broadcast layout packs "
                             f"tensors tightly, so it must start at {offset}")
        if e.start % e.dtype.itemsize:
            raise ValueError(f"{e.name!r} ({dtype_name(e.dtype)}) starts at byte {e.start}, not a "
                             f"multiple of its dtype size {e.dtype.itemsize}: SGLang refuses the "
                             f"bucket; plan it with plan_tight")
        offset = e.end
    if bucket.nbytes != offset:
        raise ValueError(f"bucket of {bucket.nbytes} bytes holds {offset} bytes of tensors: "
                         f"SGLang's broadcast layout has no trailing padding")
