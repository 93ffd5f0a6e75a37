"""What the fleet reports after a failed sync is what its replicas serve (one process, the disk
method, reference engines of TP 1):

- a commit that fails on one replica under ``on_replica_failure="abort"``: the others committed
  the new version (it cannot be undone), and `fleet_status` says so per replica (it said the old
  version while their engines served the new one); the manager's version stays the old one;
- every replica dead before a sync under ``"quarantine"``: the sync is refused, naming them, and
  the manager's version stays (the sync 'succeeded' and published a version nobody held).
"""

from __future__ import annotations

import time

import pytest
import torch

from fsdp_sync import FSDPShardingManager, SyncConfig
from fsdp_sync.engines import ReferenceEngine
from fsdp_sync.models import build_model, load_config
from fsdp_sync.topology import SyncError

pytestmark = pytest.mark.timeout(180)


def _engines(n):
    return [ReferenceEngine("tiny", tp_size=1, kv_cache_tokens=64, call_timeout_s=6,
                            update_recv_timeout_s=6) for _ in range(n)]


def test_fleet_status_names_what_each_replica_committed(tmp_path):
    eng = _engines(3)
    module = build_model(load_config("tiny"), seed=0)
    m = FSDPShardingManager(module, eng, config=SyncConfig(method="disk", disk_dir=str(tmp_path),
                                                           bucket_bytes=1 << 20))
    try:
        with m:
            pass
        with torch.no_grad():
            for p in module.parameters():
                p.add_(0.01)
        eng[1]._set_fault(0, "die_in_commit")
        with pytest.raises(SyncError, match="committing cannot be undone"):
            with m:
                pass
        assert m.version == "0"
        status = m.fleet_status()["replicas"]
        for i in (0, 2):
            assert eng[i].get_weight_version() == "1"
            assert status[i]["serving"] and status[i]["version"] == "1", status[i]
        assert not status[1]["serving"] and status[1]["version"] == "0"
    finally:
        m.close()
        for e in eng:
            e.shutdown()


def test_a_sync_with_every_replica_dead_is_refused(tmp_path):
    eng = _engines(2)
    module = build_model(load_config("tiny"), seed=0)
    m = FSDPShardingManager(module, eng, config=SyncConfig(method="disk", disk_dir=str(tmp_path),
                                                           bucket_bytes=1 << 20,
                                                           on_replica_failure="quarantine"))
    try:
        with m:
            pass
        for e in eng:
            e._w.procs[0].kill()
        deadline = time.monotonic() + 20
        while not all(e.dead_reason() for e in eng):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        before = sorted(p.name for p in tmp_path.iterdir())
        with pytest.raises(SyncError, match=r"no replica can take version '1': every one is out of "
                                            r"service \(replica 0: .*exited.*; replica 1: .*recover\(\)"):
            with m:
                pass
        assert m.version == "0" and sorted(p.name for p in tmp_path.iterdir()) == before
        assert m.fleet_status()["version"] == "0"
    finally:
        m.close()
        for e in eng:
            e.shutdown()
