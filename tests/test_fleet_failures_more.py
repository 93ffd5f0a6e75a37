"""The fleet's bookkeeping after failures (audit of the distributed method and the fleet, dist2):
what `fleet_status` says of a replica brought back, and the distributed method's fleet-wide end of
a failed sync (which replicas are aborted, which are named as holding partly new weights, none
left with an update open).

The engine-backed tests run in-process on one trainer rank with reference engines at TP 1, each
with its own ``dist_group_name`` and short timeouts, so the code before the fixes fails an
assertion instead of hanging.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.fleet import Fleet
from fsdp_sync.topology import SyncError


class _Engine:
    """What `Fleet` asks of an engine: nothing but its serving state."""

    def __init__(self) -> None:
        self.serving: list = []

    def set_serving(self, serving: bool, reason: str) -> None:
        self.serving.append((serving, reason))


def test_a_reinstated_replica_has_no_quarantine_time():
    """`Fleet.reinstate` kept ``quarantined_at``: fleet_status showed a quarantine time for a
    replica in service (after recover, or a rejoin at the next sync)."""
    engine = _Engine()
    fleet = Fleet([engine])
    rep = fleet.replicas[0]
    fleet.quarantine(rep, "drained")
    assert fleet.summary()["replicas"][0]["quarantined_at"] is not None
    fleet.reinstate(rep, "3")
    assert fleet.summary()["replicas"][0] == {"name": "replica 0", "serving": True, "reason": None,
                                              "version": "3", "quarantined_at": None}
    assert engine.serving == [(False, "drained"), (True, "")]


def _engine(**kw):
    from fsdp_sync.engines.reference import ReferenceEngine

    return ReferenceEngine("tiny", tp_size=1, kv_cache_tokens=64, call_timeout_s=20,
                           update_recv_timeout_s=6, **kw)


def _distributed(engines, name):
    from fsdp_sync import FSDPShardingManager, SyncConfig
    from fsdp_sync.models import build_model, load_config

    module = build_model(load_config("tiny"), seed=3)
    cfg = SyncConfig(method="distributed", bucket_bytes=1 << 16, layout="full", dist_timeout_s=15.0,
                     dist_group_name=name)
    return module, FSDPShardingManager(module, engines, config=cfg)


def _sync(manager) -> None:
    with manager:
        pass


@pytest.mark.timeout(120)
def test_a_failed_begin_closes_the_updates_opened_before_it(monkeypatch):
    """Replica 1's begin_weight_update fails (its worker died, say): replica 0's update, opened
    just before, was left open (no sync ends it), and the engine refused to release its memory
    (release_memory_occupation inside begin/end). Now it is aborted before the error is raised."""
    engines = [_engine() for _ in range(2)]
    try:
        module, manager = _distributed(engines, "dist2_begin")
        _sync(manager)

        def refuse():
            raise RuntimeError("injected: replica 1 cannot open an update")
        monkeypatch.setattr(engines[1], "begin_weight_update", refuse)
        with pytest.raises(SyncError, match="replica 1 cannot open an update"):
            _sync(manager)
        assert not engines[0]._in_txn, "replica 0 was left inside an update"
        engines[0].release_memory_occupation(["kv_cache"])
        engines[0].resume_memory_occupation(["kv_cache"])
        monkeypatch.undo()
        _sync(manager)
        manager.close()
    finally:
        for e in engines:
            e.shutdown()
