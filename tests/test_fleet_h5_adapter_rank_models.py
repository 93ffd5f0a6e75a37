"""A sync that sends a LoRA adapter alone (``lora="adapter"``, the base sent before, or a manager
made with ``base_sync_done=True`` as verl makes it) compares the trainer ranks' models before the
adapter export's collectives, as a full sync does (`weights.export_checks`). Before (review H5):
only the full sync did; ranks holding adapters of another rank went into the export's all-gathers
with other sizes, and no rank got the `SyncError` naming the rank and the tensor."""

from __future__ import annotations

import time

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env

PG_TIMEOUT_S = 20


def _ranks_with_other_adapters(rank, world):
    from fsdp_sync import FSDPShardingManager, SyncConfig, SyncError, make_mesh
    from fsdp_sync.cli.lora_model import ALL_LINEAR, add_lora
    from fsdp_sync.cli.trainer import wrap_fsdp
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.models import build_model, load_config

    torch.set_num_threads(1)
    r = 4 if rank == 0 else 8            # rank 1's adapter has another rank: other shapes
    module = wrap_fsdp(add_lora(build_model(load_config("tiny"), seed=0), r, 2 * r, ALL_LINEAR, seed=1), 2)
    engine = ReferenceEngine(model_config=load_config("tiny"), tp_size=world, max_lora_rank=8) if rank == 0 else None
    out: dict = {}
    try:
        manager = FSDPShardingManager(module, engine, mesh=make_mesh(1, world), config=SyncConfig(
            dtype=torch.float32, lora="adapter", memory_probe="off"))
        manager.base_sync_done = True      # as verl passes it: the adapter alone from the first sync
        t0 = time.monotonic()
        try:
            with manager:
                out["err"] = None
        except SyncError as exc:
            out["err"] = f"SyncError: {exc}"
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out["err"] = f"{type(exc).__name__}: {exc}"
        out["seconds"] = time.monotonic() - t0
        out["engine_holds"] = dict(engine.lora_adapters) if engine is not None else None
        manager.close()
    finally:
        if engine is not None:
            engine.shutdown()
    return out


@pytest.mark.timeout(240)
def test_an_adapter_only_sync_refuses_ranks_holding_other_adapters_by_name():
    try:
        results = run_ranks(_ranks_with_other_adapters, 2, timeout_s=200, pg_timeout_s=PG_TIMEOUT_S,
                            env=spawn_env())
    except Exception as exc:  # noqa: BLE001 - before: a rank died or timed out in the export
        pytest.fail(f"the ranks did not both return a SyncError: {type(exc).__name__}: {exc}"[:2000])
    for rank, got in enumerate(results):
        assert got["err"] and got["err"].startswith("SyncError"), (rank, got)
        assert "the trainer ranks hold different models" in got["err"], (rank, got)
        assert "lora_A" in got["err"] or "lora_B" in got["err"], (rank, got)
        assert got["seconds"] < PG_TIMEOUT_S / 2, (rank, got)
    assert results[0]["err"] == results[1]["err"]
    assert not results[0]["engine_holds"], results[0]       # nothing was loaded
