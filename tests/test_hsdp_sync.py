"""Tensors gathered with ``full_tensor()`` (FSDP2 on HSDP's 2-D mesh, FSDP2 ``Shard(1)``) into a
TP-2 reference engine: bit-exact, and what each trainer rank received counted in
``trainer_rank_bytes_in`` (as the 1-D ``Shard(0)`` all-gather's is).
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env

TINY_HALF = 279_680      # tiny's float32 bytes / 2: what each of 2 ranks gathers of the other's half


def _wrap(cfg, kind: str, seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from fsdp_sync.models import build_model

    model = build_model(cfg, seed=seed)
    kw = {}
    if kind == "hsdp":     # replicate 1 x shard 2: placements (Replicate(), Shard(0))
        kw["mesh"] = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
    else:                  # tensor-parallel-like Shard(1) for the matrices
        kw["shard_placement_fn"] = lambda p: Shard(1) if p.dim() == 2 else Shard(0)
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def _gathered(model) -> int:
    """What full_tensor() brings one rank: every DTensor's elements it does not hold, float32."""
    return sum((p.numel() - p.to_local().numel()) * 4 for p in model.parameters())


def _syncs(rank: int, world: int) -> list[dict]:
    from fsdp_sync import FSDPShardingManager, SyncConfig, make_mesh
    from fsdp_sync.engines import ReferenceEngine, checksum_named_tensors
    from fsdp_sync.models import load_config
    from fsdp_sync.weights import export

    torch.set_num_threads(1)
    cfg = load_config("tiny")
    engine = ReferenceEngine(model_config=cfg, tp_size=2, device="cpu", dtype=torch.float32) \
        if rank == 0 else None
    mesh = make_mesh(1, 2, "cpu")
    out = []
    try:
        for seed, (kind, layout) in enumerate((("hsdp", "engine"), ("hsdp", "full"), ("shard1", "full"))):
            model = _wrap(cfg, kind, 21 + seed)
            conf = SyncConfig(layout=layout, free_cache_engine=False, dtype=torch.float32,
                              memory_probe="off", bucket_bytes=64 << 10)
            manager = FSDPShardingManager(model, engine, mesh=mesh, config=conf)
            try:
                with manager:
                    pass
                extra = dict(manager.stats.extra)
            finally:
                manager.close()
            rec = {"kind": kind, "layout": layout, "gathered": _gathered(model),
                   **{k: extra.get(k) for k in ("layout", "reshard_path", "trainer_rank_bytes_in")}}
            trainer = checksum_named_tensors(export.iter_params(model, dtype=torch.float32))
            if engine is not None:
                rec["exact"] = engine.weights_checksum() == trainer
            out.append(rec)
    finally:
        if engine is not None:
            engine.shutdown()
    return out


@pytest.mark.timeout(120)
def test_what_full_tensor_gathers_is_counted_in_trainer_rank_bytes_in():
    """Before: trainer_rank_bytes_in was 0 for HSDP (engine and full layouts) and 1,152 for
    Shard(1) full (only its 1-D Shard(0) tensors), where each rank gathers 279,680 bytes."""
    per_rank = run_ranks(_syncs, 2, timeout_s=110, pg_timeout_s=60, env=spawn_env())
    for rank, recs in enumerate(per_rank):
        assert [(r["layout"], r["reshard_path"]) for r in recs] == [
            ("engine", "local"), ("full", None), ("full", None)], recs
        for rec in recs:
            assert rec["gathered"] == TINY_HALF, rec
            assert rec["trainer_rank_bytes_in"] == TINY_HALF, (rank, rec)
    assert all(r["exact"] for r in per_rank[0]), per_rank[0]
