"""`gather.fill_shared` with uneven pieces: each rank writes its piece of every tensor at the
offset of the elements of the ranks before it (``sum(counts[:rank])``), not at ``rank x its own
count``. FSDP1's flat parameters (a parameter straddling a shard boundary) and a ``torch.chunk``
split of rows that do not divide evenly give such pieces; the multi-process host-shared tests
use an evenly sharded FSDP2 model only, where the two offsets agree (H9 mutation pass: the
offset written as ``rank * counts[rank]`` survived them).

In-process: the ranks of one host write into ONE buffer; here each rank's write runs in turn on
the same buffer (``HostShared.fill`` only adds the barriers around it)."""

from __future__ import annotations

import types

import torch

from fsdp_sync.weights import bucket, gather
from fsdp_sync.weights.gather import Pieces


class _OneHost:
    """A `hostbuf.HostShared` of one buffer as group rank ``me`` sees it (no barriers)."""

    def __init__(self, buf: torch.Tensor, me: int) -> None:
        self.bufs, self.me = [buf], me

    def fill(self, write, wait_readers: bool = True) -> None:
        write()


def _pieces(t: torch.Tensor, counts: tuple[int, ...], rank: int) -> Pieces:
    start = sum(counts[:rank])
    return Pieces(t.reshape(-1)[start:start + counts[rank]], counts, None, rank)


def test_each_rank_writes_its_uneven_pieces_where_they_belong_cast_included():
    g = torch.Generator().manual_seed(9)
    a = torch.randn(5, 3, generator=g)                 # 15 elements over 3 ranks: 7, 7, 1
    b = torch.randn(10, generator=g)                   # 10 elements: 0, 4, 6 (a flat-param tail)
    norm = torch.randn(4, generator=g)                 # replicated: rank 0 writes it
    splits = {"a": (7, 7, 1), "b": (0, 4, 6)}
    dtype = torch.bfloat16
    plan = bucket.plan_buckets([("a", dtype, (5, 3)), ("norm", dtype, (4,)), ("b", dtype, (10,))], 1 << 20)
    (bkt,) = plan
    buf = torch.full((bkt.nbytes,), 0xAB, dtype=torch.uint8)     # stale bytes of an earlier bucket
    for rank in range(3):
        items = [types.SimpleNamespace(pieces=_pieces(a, splits["a"], rank), full=None),
                 types.SimpleNamespace(pieces=None, full=norm),
                 types.SimpleNamespace(pieces=_pieces(b, splits["b"], rank), full=None)]
        flat = gather.fill_shared(_OneHost(buf, rank), bkt, items)
    want = bucket.flatten(bkt, {"a": a.to(dtype), "norm": norm.to(dtype), "b": b.to(dtype)})
    assert torch.equal(flat, want)        # every piece in place, cast, padding zeroed by rank 0
