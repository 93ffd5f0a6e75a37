"""FSDP2 buckets that mix an unevenly sharded tensor with evenly sharded ones (a vocabulary that
does not split over the ranks, beside the layers): the packed all-gather puts every entry in its
own slot of the send buffer, and an even entry is copied back from ITS slot. H9 mutation pass:
copying every even entry of such a bucket from slot 0 survived tests/test_export.py (its uneven
case has no even entry after an uneven one in one bucket); it gives the first entry's bytes.

Two ranks, a module of three plain parameters (no model build), one bucket; compared bit for bit
with the unsharded tensors, cast (bfloat16) and not."""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env


def _values():
    g = torch.Generator().manual_seed(11)
    return {"emb": torch.randn(5, 4, generator=g),     # 5 rows over 2 ranks: 3 + 2 (uneven)
            "w": torch.randn(4, 4, generator=g),       # 2 + 2
            "b": torch.randn(6, generator=g)}          # 3 + 3


def _job(rank: int, world: int) -> dict:
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from fsdp_sync.weights import bucket, export

    torch.set_num_threads(1)
    m = nn.Module()
    for k, v in _values().items():
        setattr(m, k, nn.Parameter(v.clone()))
    fully_shard(m)
    out = {}
    for dtype in (None, torch.bfloat16):
        got = {}
        buckets = list(export.iter_buckets(m, 1 << 20, dtype=dtype))
        assert len(buckets) == 1
        for b, flat in buckets:
            got.update({n: t.clone() for n, t in bucket.unflatten(flat, b.entries)})
        out[str(dtype)] = got
    return out


@pytest.mark.timeout(90)
def test_even_entries_beside_an_uneven_one_come_from_their_own_slots():
    want = _values()
    for rank, res in enumerate(run_ranks(_job, 2, timeout_s=80, env=spawn_env())):
        for key, got in res.items():
            dtype = None if key == "None" else torch.bfloat16
            assert list(got) == ["emb", "w", "b"]
            for n, t in got.items():
                ref = want[n] if dtype is None else want[n].to(dtype)
                assert t.dtype == ref.dtype and torch.equal(t, ref), (rank, key, n)
