"""``method="distributed"``: the update group is made again when the fleet changes, with each
engine's ``rank_offset`` after every TP rank of the engines before it (mutation pass, H7).

Survivors this kills: `DistributedTransport._open_group` keeping the group while the engines
changed (an engine added between syncs never joined it), and `update_group.open_group` stepping
the offset by 1 instead of the engine's TP size (every test fleet had a TP-1 engine first, where
the two agree; a TP-2 engine first puts the next engine's rank 0 on its rank 1). One trainer rank
in a fresh process (torch's group names are per process); the weights are checked bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env

from _util import timed_sync


def _grow_fleet(rank, world):
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.engines.base import checksum_named_tensors
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.weights import export

    torch.set_num_threads(1)
    cfg = load_config("tiny")
    module = build_model(cfg, seed=7)

    def engine(tp):
        return ReferenceEngine(model_config=cfg, tp_size=tp, dtype=torch.float32, kv_cache_tokens=64,
                               update_recv_timeout_s=15.0, call_timeout_s=30.0)

    def trainer():
        return checksum_named_tensors(export.iter_params(module, dtype=torch.float32))

    out = {}
    with engine(2) as e0, engine(1) as e1:
        manager = FSDPShardingManager(module, [e0], config=SyncConfig(
            method="distributed", dtype=torch.float32, dist_timeout_s=20))
        try:
            out["first"] = timed_sync(manager)[0]
            out["e0_first"] = e0.weights_checksum() == trainer()
            try:
                manager.add_engine(e1)
                out["add"] = None
            except Exception as exc:  # noqa: BLE001 - the test reads it
                out["add"] = f"{type(exc).__name__}: {exc}"
            with torch.no_grad():
                for p in module.parameters():
                    p.mul_(-0.5)
            out["second"] = timed_sync(manager)[0]
            out["e0"] = e0.weights_checksum() == trainer()
            out["e1"] = e1.weights_checksum() == trainer()
        finally:
            manager.close()
    return out


@pytest.mark.timeout(240)
def test_an_engine_added_after_a_tp2_engine_joins_a_new_group_at_offset_3():
    (res,) = run_ranks(_grow_fleet, 1, timeout_s=220, env=spawn_env())
    assert res["first"] is None and res["e0_first"], res
    assert res["add"] is None and res["second"] is None, res
    assert res["e0"] and res["e1"], res
