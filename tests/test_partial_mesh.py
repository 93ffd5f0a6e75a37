"""A ``("dp", "infer_tp")`` mesh over part of the world (the trainer on rank 0, rank 1 doing
something else) is refused when the manager is made (`SyncTopology.from_mesh`): every agreement of
the sync runs over the whole default group. Before: accepted, and the sync's first agreement waited
for rank 1 until the group's timeout (a raw gloo "Timed out waiting 30000ms for recv").
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env


def _partial_mesh(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import DeviceMesh

    from fsdp_sync import FSDPShardingManager, SyncConfig

    if rank != 0:            # the trainer is rank 0 alone; rank 1 does something else
        return "not a member"
    mesh = DeviceMesh("cpu", torch.tensor([[0]]), mesh_dim_names=("dp", "infer_tp"))
    try:
        FSDPShardingManager(torch.nn.Linear(2, 2), object(), mesh=mesh, config=SyncConfig(memory_probe="off"))
    except ValueError as exc:
        return f"ValueError: {exc}"
    return "accepted"


@pytest.mark.timeout(60)
def test_a_mesh_over_part_of_the_world_is_refused_when_the_manager_is_made():
    """Before: accepted; the sync's agreement on the default group waited for rank 1 until the
    group's timeout (a raw gloo 'Timed out waiting 30000ms for recv')."""
    zero, one = run_ranks(_partial_mesh, 2, timeout_s=50, pg_timeout_s=30, env=spawn_env())
    assert one == "not a member"
    assert zero.startswith("ValueError: the ('dp', 'infer_tp') mesh spans 1 ranks [0] but the "
                           "default process group has 2: fsdp_sync agrees over the whole default group"), zero
