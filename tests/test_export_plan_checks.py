"""`export.iter_buckets` refuses what would pack the wrong bytes instead of packing them: a caller's
``plan=`` made for other tensors or another dtype than the module exports (the engine would read
byte ranges that do not hold its tensors, or never get one), and an FSDP1 ``"local"`` flat shard
that contradicts the offset its rank must start at, or is too short for the elements it must hold
(`export._flat_pieces`). One process, no process group."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch
from torch import nn

from fsdp_sync.weights import bucket, export


def _two_params() -> nn.Module:
    m = nn.Module()
    m.a = nn.Parameter(torch.arange(6, dtype=torch.float32).reshape(2, 3))
    m.b = nn.Parameter(torch.arange(4, dtype=torch.float32) + 100)
    return m


@pytest.mark.timeout(60)
def test_a_plan_for_other_tensors_or_dtype_is_refused_not_packed():
    m = _two_params()
    good = bucket.plan_buckets(export.param_metas(m, torch.bfloat16), 1 << 20)
    got = [(b, f.clone()) for b, f in export.iter_buckets(m, 1 << 20, dtype=torch.bfloat16, plan=good)]
    named = dict(bucket.unflatten(got[0][1], got[0][0].entries))
    assert torch.equal(named["b"], m.b.detach().to(torch.bfloat16))
    # planned for float32 but exported as bfloat16: the byte ranges would not match the data
    wrong = bucket.plan_buckets(export.param_metas(m, None), 1 << 20)
    with pytest.raises(ValueError, match="does not cover this module"):
        list(export.iter_buckets(m, 1 << 20, dtype=torch.bfloat16, plan=wrong))
    # a plan missing a tensor (the engine would never get it)
    short = bucket.plan_buckets(export.param_metas(m, None)[:1], 1 << 20)
    with pytest.raises(ValueError, match="does not cover this module"):
        list(export.iter_buckets(m, 1 << 20, plan=short))


class _Rank1Of2:
    """The process group of an FSDP1 unit, as `export._flat_pieces` reads it: rank 1 of 2."""

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return 1


@pytest.mark.timeout(60)
def test_a_local_flat_shard_that_contradicts_its_offset_is_refused():
    # FSDP1 "local": rank 1 of 2 holds elements [4, 8) of the flat parameter; a 6-element item at
    # flat offset 0 has its last 2 elements there. A shard that says it starts at 0, or is too short
    # for the item's elements, is refused by name.
    unit = NS(_handle=NS(flat_param=NS(_sharded_size=torch.Size([4]))), process_group=_Rank1Of2())
    item = export._Item("w", (6,), torch.float32, True, unit=unit, offset=0)
    ok = export._flat_pieces(item, torch.arange(4.0), 4)
    assert ok.counts == (4, 2) and ok.local.tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match="does not hold"):
        export._flat_pieces(item, torch.arange(4.0), 0)
    with pytest.raises(ValueError, match="does not hold"):
        export._flat_pieces(item, torch.arange(1.0), 4)
