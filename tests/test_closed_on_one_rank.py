"""A manager closed on one trainer rank only (an exception handler that ran there alone) is
refused on every rank, not on that one alone.

Before, the closed rank raised ``RuntimeError: ... was closed`` at once, from ``__enter__``,
`recover` or `add_engine`, while every other rank went on into the collective that came next (the
with block's first settled stage, `recover`'s decision from rank 0) and waited there for it until
the process group's timeout. Now the closure is agreed where the ranks next meet: each raises the
same `SyncError` naming the closed rank, well inside the timeout. One process alone still gets
its `RuntimeError` at once (tests/test_h40_manager.py)."""

from __future__ import annotations

import time

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env

PG_TIMEOUT_S = 20


def _closed_on_rank1(rank, world, disk_dir):
    from fsdp_sync import FSDPShardingManager, SyncConfig, SyncError
    from fsdp_sync.cli.trainer import wrap_fsdp
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.models import build_model, load_config

    torch.set_num_threads(1)
    cfg = load_config("tiny")
    module = wrap_fsdp(build_model(cfg, seed=0), 2)
    engine = ReferenceEngine(model_config=cfg, tp_size=1) if rank == 0 else None
    spare = ReferenceEngine(model_config=cfg, tp_size=1) if rank == 0 else None
    out: dict = {}
    manager = FSDPShardingManager(module, [engine] if engine is not None else None, config=SyncConfig(
        method="disk", disk_dir=disk_dir, memory_probe="off"))
    try:
        with manager:
            pass
        out["version"] = manager.version
        if rank == 1:
            manager.close()
        for what, call in (("enter", lambda: manager.__enter__()),
                           ("recover", lambda: manager.recover(engine)),
                           ("add_engine", lambda: manager.add_engine(spare))):
            t0 = time.monotonic()
            try:
                call()
                out[what] = "returned"
            except SyncError as exc:
                out[what] = f"SyncError: {exc}"
            except Exception as exc:  # noqa: BLE001 - the test reads it
                out[what] = f"{type(exc).__name__}: {exc}"
            out[what + "_s"] = time.monotonic() - t0
        out["engines"] = len(manager.fleet.replicas)
    finally:
        manager.close()
        for e in (engine, spare):
            if e is not None:
                e.shutdown()
    return out


@pytest.mark.timeout(240)
def test_every_rank_refuses_a_manager_closed_on_one(tmp_path):
    try:
        res = run_ranks(_closed_on_rank1, 2, str(tmp_path), timeout_s=200, pg_timeout_s=PG_TIMEOUT_S,
                        env=spawn_env())
    except Exception as exc:  # noqa: BLE001 - before: rank 1 raised, rank 0 timed out in a collective
        pytest.fail(f"the ranks did not both return: {type(exc).__name__}: {exc}"[:3000])
    for rank, got in enumerate(res):
        assert got["version"] == res[0]["version"] is not None, (rank, got)     # the first sync ran
        assert got["enter"].startswith("SyncError") and "RuntimeError: this FSDPShardingManager was closed" \
            in got["enter"] and "rank 1" in got["enter"], (rank, got)
        for what in ("recover", "add_engine"):
            assert got[what].startswith(f"SyncError: {what}: this FSDPShardingManager was closed on trainer "
                                        f"rank 1 (close(), or interpreter exit): make a new one on every "
                                        f"rank to sync again"), (rank, what, got)
        for what in ("enter", "recover", "add_engine"):
            assert got[what + "_s"] < PG_TIMEOUT_S / 2, (rank, what, got)     # no wait for a timeout
    assert res[0]["add_engine"].endswith("; it was not added to the fleet"), res[0]
    assert res[0]["engines"] == 1             # add_engine refused: the spare was not added
