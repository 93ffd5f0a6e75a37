"""A transformers-5 fused expert tensor (``experts.gate_up_proj`` [E, 2I, H]) held as a DTensor
that is not ``Shard(0)`` on a 1-D mesh cannot be cut into the Hub's per-expert tensors without
gathering all of it: the export refuses it before any collective, naming the tensor, its
placements and what to shard it with (H60's mutation pass: dropping the refusal survived every
export test; the stream then failed later with an AttributeError on a data-less item, outside
the agreed refusal). One process, a one-rank gloo group and mesh.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fsdp_sync.weights import export


def test_a_fused_expert_dtensor_not_sharded_by_rows_is_refused_naming_it():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        experts = nn.Module()
        experts.gate_up_proj = nn.Parameter(distribute_tensor(torch.randn(4, 8, 16), mesh, [Shard(1)]))
        mlp = nn.Module()
        mlp.experts = experts
        layer = nn.Module()
        layer.mlp = mlp
        model = nn.Module()
        model.config = SimpleNamespace(model_type="qwen3_moe")
        model.model = nn.Module()
        model.model.layers = nn.ModuleList([layer])
        want = ("'model.layers.0.mlp.experts.gate_up_proj' (rank 0): a fused expert tensor held as a DTensor "
                "with placements (Shard(dim=1),) cannot be cut expert by expert")
        with pytest.raises(ValueError, match=re.escape(want)):
            list(export.iter_params(model))
        with pytest.raises(ValueError, match=re.escape(want)):
            list(export.iter_buckets(model, 1 << 20, alloc=lambda n: torch.empty(n, dtype=torch.uint8)))
    finally:
        dist.destroy_process_group()
