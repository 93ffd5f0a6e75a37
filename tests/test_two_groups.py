"""A model whose sharded tensors span two process groups: FSDP2 layers on a DeviceMesh of their
own (over the same ranks as the default one), the root on the default mesh. Per-rank buckets are
cut over one shard group, so ``layout="auto"`` sends full tensors (bit-exact) and
``layout="engine"`` is refused before anything is sent, naming why, for the tensor, disk and
distributed methods alike (`reshard.rank_buckets_refusal`, asked while the transports choose the layout).
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env


def _two_groups_model(cfg, seed: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from fsdp_sync.models import build_model

    model = build_model(cfg, seed=seed)
    other = DeviceMesh.from_group(dist.new_group([0, 1]), "cpu", mesh_dim_names=("fsdp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=other)        # a mesh of their own
    fully_shard(model)                        # the default (world) mesh
    return model


def _syncs(rank: int, world: int, method: str, tmp: str) -> list[dict]:
    from fsdp_sync import FSDPShardingManager, SyncConfig, make_mesh
    from fsdp_sync.engines import ReferenceEngine, checksum_named_tensors
    from fsdp_sync.models import load_config
    from fsdp_sync.topology import SyncError
    from fsdp_sync.weights import export, reshard

    torch.set_num_threads(1)
    cfg = load_config("tiny")
    engine = ReferenceEngine(model_config=cfg, tp_size=2, device="cpu", dtype=torch.float32) \
        if rank == 0 else None
    mesh = make_mesh(1, 2, "cpu") if method == "tensor" else None
    out = []
    try:
        for i, layout in enumerate(("auto", "engine")):
            model = _two_groups_model(cfg, seed=11 + i)
            rec = {"refusal": reshard.rank_buckets_refusal(model)}
            kw = dict(method=method, layout=layout, free_cache_engine=False, dtype=torch.float32,
                      memory_probe="off")
            if method == "distributed":
                kw.update(dist_timeout_s=30.0, dist_group_name=f"two_groups_{layout}")
            if method == "disk":
                kw["disk_dir"] = f"{tmp}/{layout}"
            before = engine.weights_checksum() if engine is not None else None
            engines = engine if method == "tensor" else ([engine] if engine is not None else None)
            manager = FSDPShardingManager(model, engines, config=SyncConfig(**kw),
                                          **({"mesh": mesh} if mesh is not None else {}))
            try:
                with manager:
                    rec["layout"] = manager.stats.extra.get("layout")
            except SyncError as exc:
                rec["error"] = str(exc)
            finally:
                manager.close()
            trainer = checksum_named_tensors(export.iter_params(model, dtype=torch.float32))
            if engine is not None:
                rec["exact"] = engine.weights_checksum() == trainer
                rec["unchanged"] = engine.weights_checksum() == before
            out.append(rec)
    finally:
        if engine is not None:
            engine.shutdown()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["tensor", "disk", "distributed"])
def test_tensors_over_two_shard_groups_sync_full_and_engine_is_refused_up_front(method, tmp_path):
    """Before: "auto" agreed on per-rank buckets and the stream failed every sync with 'found 2
    (HSDP / 2-D meshes are not supported here)': the engine kept its old weights."""
    per_rank = run_ranks(_syncs, 2, method, str(tmp_path), timeout_s=110, pg_timeout_s=60, env=spawn_env())
    for rank, (auto, engine) in enumerate(per_rank):
        assert "span 2 process groups" in (auto["refusal"] or ""), auto
        assert "error" not in auto and auto["layout"] == "full", (rank, auto)
        assert "span 2 process groups" in engine.get("error", ""), (rank, engine)
        assert "not supported" not in engine["error"] and "layout='full'" in engine["error"], engine["error"]
    auto, engine = per_rank[0]
    assert auto["exact"] and not auto["unchanged"], auto       # the trainer's weights, bit for bit
    assert engine["unchanged"] and not engine["exact"], engine    # refused before anything was sent
