"""The bucket planner and flatten/unflatten: properties over random tensors, budgets and dtypes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fsdp_sync.weights import bucket
from fsdp_sync.weights.bucket import ALIGNMENT, TensorMeta, flatten, plan_buckets, unflatten

pytestmark = pytest.mark.timeout(120)

F8 = torch.float8_e4m3fn
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int64, F8, torch.uint8, torch.bool,
          torch.float64, torch.int32]

shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)
metas_st = st.lists(st.tuples(st.sampled_from(DTYPES), shapes), min_size=0, max_size=40).map(
    lambda xs: [TensorMeta(f"layers.{i}.w{i % 7}", d, s) for i, (d, s) in enumerate(xs)])


def _random_tensor(meta: TensorMeta, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns of the right dtype (NaNs and all): compared as bytes."""
    raw = torch.randint(0, 256, (meta.nbytes,), dtype=torch.uint8, generator=gen)
    if meta.dtype == torch.bool:
        raw = raw % 2
    return raw.view(meta.dtype).view(meta.shape)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@settings(max_examples=300, deadline=None)
@given(metas=metas_st, budget=st.integers(1, 3000))
def test_plan_properties(metas, budget):
    plan = plan_buckets(metas, budget)
    flat_entries = [e for b in plan for e in b.entries]
    # every tensor exactly once, in order, with its dtype and shape
    assert [(e.name, e.dtype, e.shape) for e in flat_entries] == [(m.name, m.dtype, m.shape) for m in metas]
    for b in plan:
        assert b.entries, "no empty bucket"
        # budget respected, padding included, unless a single tensor is alone in its bucket
        if b.nbytes > budget:
            assert len(b.entries) == 1, (budget, b)
        assert b.nbytes % ALIGNMENT == 0
        covered = bytearray(b.nbytes)
        for e in b.entries:
            assert e.start % ALIGNMENT == 0
            assert e.nbytes == math.prod(e.shape) * e.dtype.itemsize
            assert 0 <= e.start <= e.end <= b.nbytes
            for i in range(e.start, e.end):
                assert covered[i] == 0, f"byte {i} of bucket covered twice"
                covered[i] = 1
        assert sum(covered) == b.payload_bytes
        starts = [e.start for e in b.entries]
        assert starts == sorted(starts)
    # a bucket closes only when the next tensor would not fit
    for b, nxt in zip(plan, plan[1:]):
        e = nxt.entries[0]
        end = -(-b.entries[-1].end // ALIGNMENT) * ALIGNMENT + e.nbytes
        assert -(-end // ALIGNMENT) * ALIGNMENT > budget


@settings(max_examples=120, deadline=None)
@given(metas=metas_st, budget=st.integers(16, 2048), seed=st.integers(0, 2**31 - 1))
def test_flatten_unflatten_round_trip_is_bit_exact(metas, budget, seed):
    gen = torch.Generator().manual_seed(seed)
    tensors = {m.name: _random_tensor(m, gen) for m in metas}
    for b in plan_buckets(metas, budget):
        flat = flatten(b, tensors)
        assert flat.dtype == torch.uint8 and flat.numel() == b.nbytes
        padding = torch.ones(b.nbytes, dtype=torch.bool)
        for name, view in unflatten(flat, b.entries):
            src = tensors[name]
            assert view.dtype == src.dtype and view.shape == src.shape
            assert _bytes(view) == _bytes(src)
            assert view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()  # zero copy
        for e in b.entries:
            padding[e.start:e.end] = False
        assert not flat[padding].any(), "padding bytes must be zero"
        # the same plan read back through SGLang-form metadata
        again = unflatten(flat, bucket.entries_from_metadata(bucket.sglang_metadata(b)))
        assert [n for n, _ in again] == b.names


def test_bf16_3_then_int64_is_aligned_and_rebuildable():
    metas = [TensorMeta("norm", torch.bfloat16, (3,)), TensorMeta("step", torch.int64, (2,))]
    (b,) = plan_buckets(metas, 1 << 20)
    assert [(e.start, e.end) for e in b.entries] == [(0, 6), (16, 32)]
    norm = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)
    step = torch.tensor([2**40 + 3, -7], dtype=torch.int64)
    out = dict(unflatten(flatten(b, [norm, step]), b.entries))
    assert torch.equal(out["norm"], norm) and torch.equal(out["step"], step)
    # what an unpadded layout (SGLang's own) would do: the int64 would start at byte 6
    unpadded = torch.zeros(6 + 16, dtype=torch.uint8)
    with pytest.raises(RuntimeError):
        unpadded[6:22].view(torch.int64)


def test_mixed_dtypes_round_trip_including_float8():
    gen = torch.Generator().manual_seed(0)
    metas = [TensorMeta("a", torch.bfloat16, (3,)), TensorMeta("b", torch.int64, (5,)),
             TensorMeta("c", F8, (7, 3)), TensorMeta("d", torch.float16, (1,)),
             TensorMeta("e", torch.float32, (2, 2)), TensorMeta("f", F8, ()),
             TensorMeta("g", torch.float32, (0, 4))]
    tensors = [_random_tensor(m, gen) for m in metas]
    (b,) = plan_buckets(metas, 1 << 16)
    flat = flatten(b, tensors, out=torch.full((b.nbytes + 32,), 0xAB, dtype=torch.uint8))
    for (name, view), src, m in zip(unflatten(flat, b.entries), tensors, metas):
        assert name == m.name and view.dtype == m.dtype and tuple(view.shape) == m.shape
        assert _bytes(view) == _bytes(src)


def test_oversize_tensor_gets_a_bucket_of_its_own():
    metas = [TensorMeta("small0", torch.float32, (4,)), TensorMeta("huge", torch.float32, (1000,)),
             TensorMeta("small1", torch.float32, (4,)), TensorMeta("small2", torch.float32, (4,))]
    plan = plan_buckets(metas, 64)
    assert [b.names for b in plan] == [["small0"], ["huge"], ["small1", "small2"]]
    assert plan[1].nbytes == 4000


@pytest.mark.parametrize("metas, budget, exc, words", [
    ([TensorMeta("w", torch.float32, (2,)), TensorMeta("w", torch.float32, (2,))], 64, ValueError, ["'w'", "twice"]),
    ([TensorMeta("z", torch.complex64, (2,))], 64, TypeError, ["complex64", "'z'"]),
    ([TensorMeta("w", torch.float32, (2,))], 0, ValueError, ["bucket_bytes", "0"]),
])
def test_plan_rejects_bad_input(metas, budget, exc, words):
    with pytest.raises(exc) as info:
        plan_buckets(metas, budget)
    for w in words:
        assert w in str(info.value)
    with pytest.raises(ValueError, match="power of two, got 12"):
        plan_buckets([TensorMeta("w", torch.float32, (2,))], 64, alignment=12)


def test_flatten_errors_name_the_tensor_and_the_expectation():
    (b,) = plan_buckets([TensorMeta("q.weight", torch.bfloat16, (2, 3))], 1024)
    with pytest.raises(TypeError, match=r"expected dtype bfloat16 for 'q.weight', got float32"):
        flatten(b, {"q.weight": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match=r"expected shape \(2, 3\) for 'q.weight', got \(3, 2\)"):
        flatten(b, {"q.weight": torch.zeros(3, 2, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="contiguous tensor for 'q.weight'"):
        flatten(b, {"q.weight": torch.zeros(3, 2, dtype=torch.bfloat16).t()})
    with pytest.raises(ValueError, match="1 entries, got 2 tensors"):
        flatten(b, [torch.zeros(2, 3, dtype=torch.bfloat16)] * 2)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        flatten(b, [torch.zeros(2, 3, dtype=torch.bfloat16)], out=torch.empty(8, dtype=torch.uint8))


def test_unflatten_rejects_entries_that_do_not_fit_or_are_misaligned():
    flat = torch.zeros(32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="'x' .* does not fit a buffer of 32 bytes"):
        unflatten(flat, [bucket.BucketEntry("x", torch.float32, (10,), 0, 40)])
    with pytest.raises(ValueError, match="'y' starts at byte 6, not a multiple of 8"):
        unflatten(flat, [bucket.BucketEntry("y", torch.int64, (1,), 6, 14)])
    with pytest.raises(ValueError, match="1-D uint8"):
        unflatten(flat.view(torch.int32), [])


def _metadata():
    b = plan_buckets([TensorMeta("a.weight", torch.bfloat16, (4, 3)), TensorMeta("b.weight", torch.float32, (5,))],
                     10_000)[0]
    return b, bucket.sglang_metadata(b)


def test_known_metadata_is_checked_once_and_only_while_it_is_the_same():
    """`KnownMetadata` (a receiver's checked buckets): equal metadata, a new list of new objects as
    every payload brings, is taken from what was kept; a payload that differs in any field is
    checked in full, so a bad one is refused after a good one was kept, and its entries are the
    checked ones, never the payload's own values."""
    b, md = _metadata()
    known = bucket.KnownMetadata()
    first = known.entries(md)
    assert first == list(b.entries) and (known.hits, known.misses) == (0, 1)
    again = known.entries(bucket.sglang_metadata(b))             # new objects, same fields
    assert again == first and (known.hits, known.misses) == (1, 1)
    again.clear()                                                 # a caller's list is its own
    assert known.entries(bucket.sglang_metadata(b)) == first
    # True == 1 in Python: an equal value of another type reads as the checked entry
    md2 = bucket.sglang_metadata(b)
    md2[0].start_idx = False          # == 0
    got = known.entries(md2)
    assert type(got[0].start) is int and got == first
    # a field changed: checked in full, and refused
    for field, value, words in [("end_idx", 23, "range"), ("dtype", torch.float64, "bytes"),
                                ("start_idx", 16, "range")]:
        bad = bucket.sglang_metadata(b)
        setattr(bad[0], field, value)
        with pytest.raises(ValueError, match=words):
            known.entries(bad)
    overlap = bucket.sglang_metadata(b)
    overlap[1].start_idx, overlap[1].end_idx = 8, 28
    with pytest.raises(ValueError, match="overlap"):
        known.entries(overlap)
    assert known.entries(bucket.sglang_metadata(b)) == first     # the good one is still kept


def test_known_metadata_keeps_no_payload_object_but_plain_fields():
    """Metadata that passed its check while holding something else than plain values (a tensor as
    ``numel``, which compares equal to its byte count) is not kept: it would keep the payload's
    storage mapped after the acknowledgement."""
    b, md = _metadata()
    md[1].numel = torch.tensor(md[1].end_idx - md[1].start_idx)
    known = bucket.KnownMetadata()
    assert known.entries(md) == list(b.entries)
    assert not known._kept
    known.entries(bucket.sglang_metadata(b))
    assert len(known._kept) == 1
    other = [bucket.sglang_metadata(b)[0], dict(vars(bucket.sglang_metadata(b)[1]))]
    other[0].name = "c.weight"
    assert len(known.entries(other)) == 2 and len(known._kept) == 2   # dict entries are kept too

    class Slotted:                    # a producer's own entry class: checked, not kept
        __slots__ = ("name", "dtype", "shape", "start_idx", "end_idx")

        def __init__(self, ns):
            for k in self.__slots__:
                setattr(self, k, getattr(ns, k))
    mixed = [bucket.sglang_metadata(b)[0], Slotted(bucket.sglang_metadata(b)[1])]
    mixed[0].name = "d.weight"
    assert len(known.entries(mixed)) == 2 and len(known._kept) == 2


def test_known_metadata_keeps_at_most_its_size():
    known = bucket.KnownMetadata(size=2)
    mds = []
    for i in range(3):
        b = plan_buckets([TensorMeta(f"l{i}.weight", torch.bfloat16, (i + 1,))], 100)[0]
        mds.append(bucket.sglang_metadata(b))
        known.entries(mds[-1])
    assert len(known._kept) == 2
    known.entries(mds[0])                                          # dropped: checked again
    known.entries(mds[2])
    assert (known.hits, known.misses) == (1, 4)


def test_metadata_entries_overlapping_by_one_byte_are_refused():
    """Two entries sharing only their last/first byte still overlap: a producer that sends
    [0, 8) and [7, 15) would have the second tensor's load overwrite the first one's last byte."""
    md = [{"name": "a.weight", "dtype": torch.float32, "shape": (2,), "start_idx": 0, "end_idx": 8},
          {"name": "b.weight", "dtype": torch.uint8, "shape": (8,), "start_idx": 7, "end_idx": 15}]
    with pytest.raises(ValueError, match=r"'a.weight' \[0, 8\) and 'b.weight' \[7, 15\) overlap"):
        bucket.entries_from_metadata(md)
    md[1]["start_idx"], md[1]["end_idx"] = 8, 16                   # touching, not overlapping
    assert [(e.start, e.end) for e in bucket.entries_from_metadata(md)] == [(0, 8), (8, 16)]


def test_plan_tight_opens_a_bucket_where_the_next_offset_is_misaligned():
    """SGLang's broadcast layout has no padding: a bf16[3] (6 bytes) then an fp32 cannot share a
    bucket (the fp32 would start at byte 6), however large the budget."""
    plan = bucket.plan_tight([TensorMeta("a", torch.bfloat16, (3,)), TensorMeta("b", torch.float32, (2,))],
                             1 << 20)
    assert [b.names for b in plan] == [["a"], ["b"]]
    assert [(e.start, e.end) for b in plan for e in b.entries] == [(0, 6), (0, 8)]
