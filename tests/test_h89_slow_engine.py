"""Engine work on trainer rank 0 that outlasts the trainer group's timeout (a big checkpoint read
from disk, a slow commit) must not fail the sync: the other ranks wait with it
(`topology.agree_after_rank0`), however long it takes. Before, they waited in one collective bounded by
the group's timeout, and the sync failed with raw gloo errors (a different one on each rank:
"Connection closed by peer", "Application timeout caused pair closure") although the engine had
loaded the version.

Also: ranks that built different meshes (rank 0 ``make_mesh(1, 2)``, rank 1 ``make_mesh(2, 1)``)
are compared in the first stage's agree (`manager.FSDPShardingManager._stage_values`): one
`SyncError` on every rank naming the mesh, where before they gathered and called engines over
different groups."""

import datetime
import time

import pytest
import torch

PG_TIMEOUT_S = 2.0
LOAD_S = 2 * PG_TIMEOUT_S        # the engine's disk load: twice the group's timeout


def _slow_disk_job(rank, world, root):
    from fsdp_sync import FSDPShardingManager, SyncConfig
    from fsdp_sync.cli.trainer import wrap_fsdp
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.engines.base import checksum_named_tensors
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.weights import export

    from fsdp_sync import make_mesh

    torch.set_num_threads(1)
    # the ranks' own work before the first collective (the engines' start) is not what is tested:
    # they meet in a barrier of a group with a long timeout
    meet = torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    cfg = load_config("tiny")
    engine = None
    if rank == 0:
        engine = ReferenceEngine(model_config=cfg, tp_size=2, device="cpu", dtype=torch.float32)
    # rank 1's own (a one-rank TP group under its mesh), for the meshes' check
    other = ReferenceEngine(model_config=cfg, tp_size=2 if rank == 0 else 1, device="cpu",
                            dtype=torch.float32)
    torch.distributed.barrier(group=meet)
    model = wrap_fsdp(build_model(cfg, seed=3), world)
    if rank == 0:
        real = engine.update_weights_from_disk

        def slow(*a, **k):
            time.sleep(LOAD_S)
            return real(*a, **k)

        engine.update_weights_from_disk = slow
    out = {}
    try:
        m = FSDPShardingManager(model, [engine] if engine else None, config=SyncConfig(
            method="disk", disk_dir=root, dtype=torch.float32, memory_probe="off"))
        t0 = time.monotonic()
        try:
            with m:
                pass
            out["synced"] = True
        except Exception as exc:  # noqa: BLE001 - the test reports it
            out["synced"] = f"{type(exc).__name__}: {exc}"[:400]
        out["waited"] = time.monotonic() - t0 >= LOAD_S
        if out["synced"] is not True:     # the group is broken: no further collective
            return out
        full = list(export.iter_params(model, dtype=torch.float32))   # collective on every rank
        if engine is not None:
            out["exact"] = engine.weights_checksum() == checksum_named_tensors(full)
        m.close()
        mesh = make_mesh(1, 2) if rank == 0 else make_mesh(2, 1)
        m = FSDPShardingManager(model, other, mesh=mesh, config=SyncConfig(
            method="tensor", dtype=torch.float32, memory_probe="off"))
        try:
            with m:
                pass
            out["meshes"] = "synced"
        except Exception as exc:  # noqa: BLE001 - the test reports it
            out["meshes"] = f"{type(exc).__name__}: {exc}"
        m.close()
    finally:
        for e in (engine, other):
            if e is not None:
                e.shutdown()
    return out


@pytest.fixture(scope="module")
def results(leftovers_check, tmp_path_factory):
    from fsdp_sync.cli.launch import run_ranks, spawn_env

    with leftovers_check():
        return run_ranks(_slow_disk_job, 2, str(tmp_path_factory.mktemp("h89")), timeout_s=55,
                         pg_timeout_s=PG_TIMEOUT_S, env=spawn_env())


@pytest.mark.timeout(60)
def test_a_disk_load_longer_than_the_group_timeout_syncs_on_every_rank(results):
    assert [r["synced"] for r in results] == [True, True], results
    assert all(r["waited"] for r in results), results
    assert results[0]["exact"], results


@pytest.mark.timeout(60)
def test_ranks_that_built_different_meshes_raise_one_error_naming_the_mesh(results):
    texts = [r.get("meshes") for r in results]
    assert texts[0] is not None and texts[0] == texts[1], texts
    assert texts[0].startswith("SyncError: entering the with block failed: the ranks' settings "
                               "differ: mesh is {'dp': 1, 'infer_tp': 2, 'ranks': [[0, 1]]} on rank 0, "
                               "{'dp': 2, 'infer_tp': 1, 'ranks': [[0], [1]]} on rank 1"), texts
