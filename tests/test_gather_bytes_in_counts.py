"""The bytes a rank receives gathering, as `gather` counts them from sizes alone (the sync's
``bytes_in`` stat and `fsdp_sync.plan`'s figures use these counts; no collective is run for them).

- `materialized_bytes_in` (one tensor, `gather_pieces`): an all-gather of pieces padded to the
  largest brings (world - 1) x the largest piece; a tensor one rank holds whole is broadcast from
  it (the others receive all of it, the owner nothing); one rank, or no elements: nothing.
- `bucket_bytes_in` (one bucket, `gather_bucketed`): a run of consecutive entries one rank holds
  whole is broadcast as ONE span, the alignment padding between its entries included, as
  `_broadcast_owned` sends it; the rest in one all-gather.
"""

from __future__ import annotations

import types

import torch

from fsdp_sync.weights.bucket import BucketEntry
from fsdp_sync.weights.gather import Pieces, bucket_bytes_in, materialized_bytes_in

BF16 = torch.bfloat16


def _item(counts, rank):
    p = Pieces(torch.zeros(counts[rank], dtype=BF16), tuple(counts), None, rank)
    return types.SimpleNamespace(full=None, dtensor=None, pieces=p)


def test_one_tensors_gather_brings_world_minus_one_largest_pieces_or_the_owners_whole():
    assert [materialized_bytes_in(_item((6, 6, 4), r), BF16) for r in range(3)] == [24, 24, 24]
    assert [materialized_bytes_in(_item((5, 5), r), torch.float32) for r in range(2)] == [20, 20]
    # one rank holds it all: a broadcast from it
    assert [materialized_bytes_in(_item((0, 10, 0), r), BF16) for r in range(3)] == [20, 0, 20]
    # a group of one rank, or an empty tensor: nothing travels
    assert materialized_bytes_in(_item((7,), 0), BF16) == 0
    assert materialized_bytes_in(_item((0, 0), 1), BF16) == 0
    whole = types.SimpleNamespace(full=torch.zeros(3), dtensor=None, pieces=None)
    assert materialized_bytes_in(whole, BF16) == 0


def _e(name, start, n, dtype=BF16):
    return BucketEntry(name, dtype, (n,), start, start + n * dtype.itemsize)


def test_a_run_of_entries_one_rank_holds_is_one_broadcast_with_its_padding():
    a, b = _e("a", 0, 3), _e("b", 16, 3)            # 6 bytes, 10 bytes of padding, 6 bytes
    held_by_1 = [(a, (0, 3)), (b, (0, 3))]
    assert bucket_bytes_in(held_by_1, 0) == 22      # bytes [0, 22): one span
    assert bucket_bytes_in(held_by_1, 1) == 0       # the owner receives nothing
    # owned by different ranks: two broadcasts, each of its own entry
    assert bucket_bytes_in([(a, (3, 0)), (b, (0, 3))], 0) == 6
    # a gap wider than the alignment ends the run
    c = _e("c", 32, 3)
    assert bucket_bytes_in([(a, (0, 3)), (c, (0, 3))], 0) == 12


def test_the_rest_is_one_all_gather_of_equal_or_padded_pieces():
    x, y = _e("x", 0, 8), _e("y", 16, 5, torch.float32)
    assert bucket_bytes_in([(x, (4, 4))], 0) == 8                          # (2 - 1) x 4 x 2
    # uneven: every entry in a slot as wide as its largest piece, 16-byte aligned
    assert bucket_bytes_in([(x, (5, 3)), (y, (3, 2))], 1) == 32            # slots 16 + 16
    assert bucket_bytes_in([(x, (4, 4))], 0, dst=0) == 8                   # to rank 0 only
    assert bucket_bytes_in([(x, (4, 4))], 1, dst=0) == 0
