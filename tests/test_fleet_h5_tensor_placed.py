"""``method='tensor'``: the engine is each infer-TP group's own, fixed by placement. `add_engine`
was refused there, but `quarantine` and `remove_engine` were taken (review H5): the engine went
out of the fleet (quarantine also told it it was out of service) and every later sync failed on
the rank that held it with "AttributeError: 'NoneType' object has no attribute
'update_weights_from_tensor'", naming neither the call nor what to do. Now both are refused
before anything changes, naming the method, and the next sync goes on as before. `recover` too
(H40: it re-sent to trainer rank 0's engine alone, inside the block with the other ranks' engines
not sent to; no replica is ever out of service there)."""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env


def _job(rank, world):
    from fsdp_sync import FSDPShardingManager, SyncConfig, make_mesh
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.models import build_model, load_config

    torch.set_num_threads(1)
    cfg = load_config("tiny")
    out: dict = {}
    with ReferenceEngine(cfg, tp_size=1, kv_cache_tokens=256, call_timeout_s=30) as eng:
        m = FSDPShardingManager(build_model(cfg, seed=1), eng, mesh=make_mesh(1, 1), config=SyncConfig(
            method="tensor", free_cache_engine=False, dtype=torch.float32, memory_probe="off"))
        with m:
            pass
        for what in ("quarantine", "remove_engine", "recover"):
            try:
                getattr(m, what)(eng)
                out[what] = None
            except ValueError as exc:
                out[what] = str(exc)
        out["serving_state"] = eng.serving_state
        try:
            with m:
                pass
            out["next"] = (m.version, eng.weight_version)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out["next"] = f"{type(exc).__name__}: {exc}"[:400]
        m.close()
    return out


@pytest.mark.timeout(120)
def test_quarantine_and_remove_engine_are_refused_for_the_tensor_method():
    (got,) = run_ranks(_job, 1, timeout_s=110, pg_timeout_s=30, env=spawn_env())
    for what in ("quarantine", "remove_engine", "recover"):
        assert got[what] and got[what].startswith(f"{what}: method='tensor'"), got   # before: None
        assert "'distributed' or 'disk'" in got[what], got
    assert got["serving_state"] is None, got
    assert got["next"] == ("1", "1"), got          # before: SyncError ... AttributeError
