"""Tensors gathered with ``full_tensor()`` (FSDP2 on HSDP's 2-D mesh, FSDP2 ``Shard(1)``) into a
TP-2 reference engine: bit-exact, what each trainer rank received counted in
``trainer_rank_bytes_in`` (as the 1-D ``Shard(0)`` all-gather's is), and with per-rank buckets each
trainer rank builds only its own infer-TP rank's buffers (the local path of
`reshard.iter_rank_buckets`), materializing one tensor at a time.
"""

from __future__ import annotations

import gc
import time
import weakref

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


def _one_sync(manager) -> dict:
    """One sync (an empty ``with`` block), then close: the sync's ``stats.extra``."""
    try:
        with manager:
            pass
        return dict(manager.stats.extra)
    finally:
        manager.close()


def _syncs(rank: int, world: int) -> list[dict]:
    from fsdp_sync import FSDPShardingManager, SyncConfig, make_mesh
    from fsdp_sync.engines import ReferenceEngine, checksum_named_tensors
    from fsdp_sync.models import load_config
    from fsdp_sync.weights import export, reshard

    torch.set_num_threads(1)
    # how many tensors the per-rank stream has materialized and still holds, at each materialize
    alive: list = []
    most = [0]
    waited = [0.0]
    real = reshard.materialize

    def counting(*args, **kw):
        # torch's gloo worker thread drops a finished all-gather's output a moment after it is
        # waited on (on a loaded CI machine, the one before it too): what this sync holds itself
        # never drops, so wait a little (5 s in all per rank) for what only torch still holds
        while True:
            alive[:] = [r for r in alive if r() is not None]
            if len(alive) <= 1 or waited[0] > 5.0:
                break
            gc.collect()
            time.sleep(0.01)
            waited[0] += 0.01
        most[0] = max(most[0], len(alive))
        out = real(*args, **kw)
        alive.append(weakref.ref(out.untyped_storage()))    # its memory, whatever views it
        return out

    reshard.materialize = counting
    cfg = load_config("tiny")
    engine = ReferenceEngine(model_config=cfg, tp_size=2, device="cpu", dtype=torch.float32) \
        if rank == 0 else None
    mesh = make_mesh(1, 2, "cpu")
    out = []
    try:
        for seed, (kind, layout) in enumerate((("hsdp", "engine"), ("hsdp", "full"), ("shard1", "full"))):
            model = _wrap(cfg, kind, 21 + seed)
            most[0] = 0
            conf = SyncConfig(layout=layout, free_cache_engine=False, dtype=torch.float32,
                              memory_probe="off", bucket_bytes=64 << 10)
            extra = _one_sync(FSDPShardingManager(model, engine, mesh=mesh, config=conf))
            rec = {"kind": kind, "layout": layout, "gathered": _gathered(model), "held": most[0],
                   **{k: extra.get(k) for k in ("layout", "reshard_path", "trainer_rank_bytes_in",
                                                "trainer_rank_bytes_written", "engine_rank_shard_bytes")}}
            trainer = checksum_named_tensors(export.iter_params(model, dtype=torch.float32))
            if engine is not None:
                rec["exact"] = engine.weights_checksum() == trainer
            out.append(rec)
        # the stream itself: a function of the bucket names the engine ranks this rank builds
        # (as the disk method's writers take turns); their bytes are those of all ranks' buffers
        from fsdp_sync.weights.layout import layout_for
        model, layout = _wrap(cfg, "hsdp", 30), layout_for(cfg, 2)
        every = [{i: b.clone() for i, b in rb.buffers.items()}
                 for rb in reshard.iter_rank_buckets(model, layout, 64 << 10, dtype=torch.float32)]
        some = [{i: b.clone() for i, b in rb.buffers.items()}
                for rb in reshard.iter_rank_buckets(model, layout, 64 << 10, dtype=torch.float32,
                                                    ranks=lambda k: [(k + rank) % 2])]
        out.append({"every": [sorted(b) for b in every], "some": [sorted(b) for b in some],
                    "same": all(torch.equal(b, every[k][i]) for k, bufs in enumerate(some) for i, b in bufs.items())})
    finally:
        reshard.materialize = real
        if engine is not None:
            engine.shutdown()
    return out


@pytest.fixture(scope="module")
def runs():
    """Each rank's records: the three syncs, then the stream's own (one 2-rank job for both tests)."""
    return run_ranks(_syncs, 2, timeout_s=110, pg_timeout_s=60, env=spawn_env())


@pytest.mark.timeout(120)
def test_what_full_tensor_gathers_is_counted_in_trainer_rank_bytes_in(runs):
    """Before: trainer_rank_bytes_in was 0 for HSDP (engine and full layouts) and 1,152 for
    Shard(1) full (only its 1-D Shard(0) tensors), where each rank gathers 279,680 bytes."""
    for rank, recs in enumerate(runs):
        syncs = recs[:-1]
        assert [(r["layout"], r["reshard_path"]) for r in syncs] == [
            ("engine", "local"), ("full", None), ("full", None)], syncs
        for rec in syncs:
            assert rec["gathered"] == TINY_HALF, rec
            assert rec["trainer_rank_bytes_in"] == TINY_HALF, (rank, rec)
    assert all(r["exact"] for r in runs[0][:-1]), runs[0]


@pytest.mark.timeout(120)
def test_each_hsdp_rank_builds_only_its_own_engine_ranks_buffers(runs):
    """Before: with per-rank buckets each HSDP trainer rank built both engine ranks' buffers
    (560,640 bytes written, twice its own rank's 280,320), holding a bucket's full tensors at
    once (10 at the most)."""
    for rank, recs in enumerate(runs):
        engine, stream = recs[0], recs[-1]
        # its own infer-TP rank's shard, written once: as the 1-D FSDP2 path's 280,320
        assert engine["trainer_rank_bytes_written"] == engine["engine_rank_shard_bytes"] == 280_320, (rank, engine)
        # each full tensor dropped before the next is made (torch's finished all-gather may hold
        # the last one a moment longer)
        assert engine["held"] <= 1, (rank, engine)
        assert all(b == [0, 1] for b in stream["every"]), stream
        assert stream["some"] == [[(k + rank) % 2] for k in range(len(stream["every"]))], stream
        assert stream["same"], rank
    assert runs[0][0]["exact"], runs[0][0]


def _disaggregated_sync(rank: int, world: int, method: str, tmp: str) -> dict:
    from fsdp_sync import FSDPShardingManager, SyncConfig
    from fsdp_sync.engines import ReferenceEngine, checksum_named_tensors
    from fsdp_sync.models import load_config
    from fsdp_sync.weights import export

    torch.set_num_threads(1)
    cfg = load_config("tiny")
    engine = ReferenceEngine(model_config=cfg, tp_size=2, device="cpu", dtype=torch.float32) \
        if rank == 0 else None
    try:
        model = _wrap(cfg, "hsdp", 40)
        extra = ({"disk_dir": tmp} if method == "disk" else
                 {"dist_timeout_s": 30.0, "dist_group_name": "hsdp_dist"})
        conf = SyncConfig(method=method, layout="engine", dtype=torch.float32, memory_probe="off",
                          bucket_bytes=64 << 10, **extra)
        extra = _one_sync(FSDPShardingManager(model, [engine] if engine is not None else None, config=conf))
        rec = {k: extra.get(k) for k in ("layout", "reshard_path", "trainer_rank_bytes_written")}
        trainer = checksum_named_tensors(export.iter_params(model, dtype=torch.float32))   # collective
        if engine is not None:
            rec["exact"] = engine.weights_checksum() == trainer
        return rec
    finally:
        if engine is not None:
            engine.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["distributed", "disk"])
def test_disaggregated_methods_build_only_the_per_rank_buffers_a_rank_sends(method, tmp_path):
    """Whole tensors on every rank (HSDP's local path): the distributed method's trainer rank 0
    sends every engine rank's buffer and no other rank any; each disk writer builds the buffers of
    the files it writes (at TP 2 on 2 ranks: one engine rank's). Before: every trainer rank built
    them all (560,640 bytes on each, where rank 1 sends nothing, or each writes half)."""
    zero, one = run_ranks(_disaggregated_sync, 2, method, str(tmp_path), timeout_s=110, pg_timeout_s=60,
                          env=spawn_env())
    assert zero["layout"] == one["layout"] == "engine" and zero["reshard_path"] == "local", zero
    want = (2 * 280_320, 0) if method == "distributed" else (280_320, 280_320)
    assert (zero["trainer_rank_bytes_written"], one["trainer_rank_bytes_written"]) == want, (zero, one)
    assert zero["exact"], zero
