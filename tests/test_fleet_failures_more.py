"""The fleet's bookkeeping after failures (audit of the distributed method and the fleet, dist2):
what `fleet_status` says of a replica brought back, and the distributed method's fleet-wide end of
a failed sync (which replicas are aborted, which are named as holding partly new weights, none
left with an update open).

The engine-backed tests run in-process on one trainer rank with reference engines at TP 1, each
with its own ``dist_group_name`` and short timeouts, so the code before the fixes fails an
assertion instead of hanging.
"""

from __future__ import annotations

import time

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
                                              "version": "3", "quarantined_at": None,
                                              "generation_paused": False}
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
def test_a_refusal_aborts_the_replicas_whose_request_was_in_flight_and_names_them(monkeypatch):
    """Two replicas that apply each call as it arrives (as SGLang does). Replica 1 refuses bucket
    2 while replica 0's request for it is still on its way. Before: every replica whose request
    was not answered yet was marked stuck, so replica 0 was neither aborted (left inside its
    update) nor named; the note said "replica 0" of replica 1 (its index once replica 0 was left
    out). Now its answer is waited for (within dist_timeout_s) and both are named."""
    engines = [_engine(transactional_updates=False) for _ in range(2)]
    try:
        module, manager = _distributed(engines, "dist2_in_flight")
        _sync(manager)
        with torch.no_grad():
            for p in module.parameters():
                p.add_(0.01)
        calls = {0: 0, 1: 0}

        def hook(i, real):
            def call(**kw):
                calls[i] += 1
                if calls[i] == 3 and i == 1:
                    raise RuntimeError("injected: replica 1 refuses bucket 2")
                if calls[i] == 3:
                    time.sleep(0.5)       # replica 0's request for bucket 2 is still in flight
                return real(**kw)
            return call
        for i, e in enumerate(engines):
            monkeypatch.setattr(e, "update_weights_from_distributed", hook(i, e.update_weights_from_distributed))
        with pytest.raises(SyncError, match="engine 1 refused bucket 2") as info:
            _sync(manager)
        notes = " ".join(getattr(info.value, "__notes__", []))
        assert "replica 0, replica 1 could not drop" in notes, notes
        assert [e._in_txn for e in engines] == [False, False], "a replica was left inside its update"
        monkeypatch.undo()
        _sync(manager)      # the group is made again; both take the trainer's weights
        assert all(e.weights_checksum() == engines[0].weights_checksum() for e in engines)
        manager.close()
    finally:
        for e in engines:
            e.shutdown()


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


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["distributed", "disk"])
def test_under_abort_a_dead_replica_fails_one_sync_and_is_quarantined(method, tmp_path):
    """on_replica_failure="abort", replica 2's worker killed between syncs. Before: the sync raised
    naming it, but it stayed in service (fleet_status serving True, /health 200) and every later
    sync failed on it until remove_engine. Now the failed sync quarantines it (the error says so),
    and the next sync commits on the others, bit for bit."""
    from fsdp_sync import FSDPShardingManager, SyncConfig
    from fsdp_sync.engines.base import checksum_named_tensors
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.weights import export

    engines = [_engine() for _ in range(3)]
    try:
        module = build_model(load_config("tiny"), seed=3)
        extra = {"disk_dir": str(tmp_path)} if method == "disk" else {
            "dist_timeout_s": 15.0, "dist_group_name": "dist2_abort_dead"}
        manager = FSDPShardingManager(module, engines, config=SyncConfig(
            method=method, bucket_bytes=1 << 20, layout="full", **extra))
        _sync(manager)
        engines[2]._w.procs[0].kill()
        for _ in range(100):
            if engines[2].dead_reason():
                break
            time.sleep(0.05)
        with torch.no_grad():
            for p in module.parameters():
                p.add_(0.01)
        with pytest.raises(SyncError, match="no replica committed") as info:
            _sync(manager)
        assert "replica 2" in str(info.value) and "quarantined" in str(info.value)
        assert [r["serving"] for r in manager.fleet_status()["replicas"]] == [True, True, False]
        _sync(manager)
        assert manager.version == "2"
        trained = checksum_named_tensors(list(export.iter_params(module, dtype=None)))
        assert engines[0].weights_checksum() == engines[1].weights_checksum() == trained
        assert [e.get_weight_version() for e in engines[:2]] == ["2", "2"]
        manager.close()
    finally:
        for e in engines:
            e.shutdown()
