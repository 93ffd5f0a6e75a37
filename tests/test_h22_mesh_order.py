"""`shards.dim0_pieces` takes a ``Shard(0)`` DTensor's local shards as rank-ordered pieces only where
the 1-D mesh lists its ranks in group order: on a mesh such as ``[1, 0]`` mesh coordinate 0 is
group rank 1, so pieces gathered in group order would put each rank's rows in the other's
place. Such a tensor falls back to ``full_tensor()`` (None here). (h22 mutation pass: treating
every 1-D mesh as ordered survived every test.) In process, duck-typed mesh and DTensor."""

from __future__ import annotations

import types

import torch
from torch.distributed.tensor import Shard

from fsdp_sync.weights.shards import dim0_pieces


def _dtensor(order: list[int], me: int):
    mesh = types.SimpleNamespace(ndim=1, mesh=torch.tensor(order), get_group=lambda: "group",
                                 get_local_rank=lambda: me)
    local = torch.arange(6, dtype=torch.float32).view(3, 2) + 100 * me
    return types.SimpleNamespace(device_mesh=mesh, placements=(Shard(0),), shape=torch.Size([6, 2]),
                                 ndim=2, _local_tensor=local)


def test_a_mesh_in_group_order_gives_pieces_another_order_falls_back():
    p = dim0_pieces("w", _dtensor([0, 1], 1), {})
    assert p is not None and p.counts == (6, 6) and p.rank == 1 and p.group == "group"
    assert torch.equal(p.local, torch.arange(6, dtype=torch.float32).view(3, 2) + 100)
    assert dim0_pieces("w", _dtensor([1, 0], 0), {}) is None
