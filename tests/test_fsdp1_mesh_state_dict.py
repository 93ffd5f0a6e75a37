"""FSDP1 wrapped with a ``device_mesh`` (HSDP) under ``SyncConfig(fsdp1_state_dict="local")`` is
refused before the export, naming the `SyncConfig` field and the values that work
(`weights.export_checks.state_dict_refusal`). Before: torch's own "DeviceMesh is not compatible with
LOCAL_STATE_DICT. Please set state_dict_type to SHARDED_STATE_DICT", raised inside the export,
which names no field of the sync's. "sharded" on the same model syncs, and so does "local" where
the mesh's shard dimension has one rank (torch runs those units as NO_SHARD and does not refuse).
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env


def _syncs(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from fsdp_sync import FSDPShardingManager, SyncConfig, SyncError, make_mesh
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.models import build_model, load_config

    torch.set_num_threads(1)
    cfg = load_config("tiny")
    engine = ReferenceEngine(model_config=cfg, tp_size=world, device="cpu") if rank == 0 else None
    mesh = make_mesh(1, world)
    out = {}
    try:
        for shape, kind, verify in (((1, 2), "local", "off"), ((1, 2), "sharded", "off"),
                                    ((1, 2), "sharded", "sample"), ((2, 1), "local", "sample")):
            model = build_model(cfg, seed=0)
            model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({type(model.model.layers[0])}),
                         device_id=torch.device("cpu"), use_orig_params=True,
                         sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                         device_mesh=init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")))
            manager = FSDPShardingManager(model, engine, mesh=mesh, config=SyncConfig(
                fsdp1_state_dict=kind, memory_probe="off", verify=verify))
            key = f"{shape[0]}x{shape[1]} {kind}" + (f" verify={verify}" if verify != "off" else "")
            try:
                with manager:
                    pass
                out[key] = "synced"
            except SyncError as exc:
                out[key] = f"SyncError: {exc}"
            finally:
                manager.close()
    finally:
        if engine is not None:
            engine.shutdown()
    return out


@pytest.mark.timeout(100)
def test_fsdp1_with_a_device_mesh_refuses_the_local_state_dict_naming_the_sync_config_field():
    zero, one = run_ranks(_syncs, 2, timeout_s=90, pg_timeout_s=30, env=spawn_env())
    assert zero == one, (zero, one)
    refused = zero["1x2 local"]
    assert refused.startswith("SyncError: weight sync failed on rank 0 (ranks [1] failed too): "
                              "SyncConfig.fsdp1_state_dict='local' cannot export this FSDP1 model: its "
                              "units were made with a device_mesh (HYBRID_SHARD over a mesh of shape (1, 2)"), refused
    assert "set SyncConfig.fsdp1_state_dict='sharded'" in refused and "or 'full'" in refused, refused
    assert zero["1x2 sharded"] == "synced" and zero["2x1 local verify=sample"] == "synced", zero
    # verify="sample" read its tensors with "local" whatever the sync's type: torch refused it on a
    # meshed model after the weights had gone, in the very set-up the refusal above recommends
    assert zero["1x2 sharded verify=sample"] == "synced", zero
