"""`shards.sharded_tensor_pieces` takes an FSDP1 ``ShardedTensor`` as rank-ordered pieces only where
its dim-0 shards ascend with the ranks: shards laid out the other way (rank 1 holding the first
rows) would be gathered in rank order, each rank's rows in the other's place, so they are refused
naming the tensor and the shard. (h22 mutation pass: dropping the rank-order check survived every
test, as FSDP1 always lays them out in order.) In process: a duck-typed ShardedTensor, the
collective queries answered as for a two-rank group."""

from __future__ import annotations

import types

import pytest
import torch

from fsdp_sync.weights import shards


def _st(owners: list[int], me: int):
    metas = [types.SimpleNamespace(shard_offsets=[2 * i, 0], shard_sizes=[2, 3],
                                   placement=types.SimpleNamespace(rank=lambda r=r: r))
             for i, r in enumerate(owners)]
    md = types.SimpleNamespace(size=torch.Size([4, 3]), shards_metadata=metas,
                               tensor_properties=types.SimpleNamespace(dtype=torch.float32))
    local = torch.full((2, 3), float(me))
    return types.SimpleNamespace(metadata=lambda: md, _process_group=None,
                                 local_shards=lambda: [types.SimpleNamespace(tensor=local)])


@pytest.fixture
def two_ranks(monkeypatch):
    monkeypatch.setattr(shards.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(shards.dist, "get_rank", lambda group=None: 1)


def test_shards_in_rank_order_are_pieces_the_other_order_is_refused(two_ranks):
    p = shards.sharded_tensor_pieces("w", _st([0, 1], 1))
    assert p.counts == (6, 6) and p.rank == 1 and torch.equal(p.local, torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"'w' .* not split along dim 0 in rank order: shard at "
                                         r"offsets \[2, 0\] sizes \[2, 3\] on group rank 0"):
        shards.sharded_tensor_pieces("w", _st([1, 0], 1))
