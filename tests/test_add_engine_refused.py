"""`FSDPShardingManager.add_engine` that fails leaves the fleet as it was: the engine is not in
``fleet_status()`` (before: it stayed listed, out of service, "joining: waiting for the current
weights", for good), and a refusal of its config reads as one ("replica 1 is refused, before
anything was sent: ...", not "replica 1 cannot take updates", which names a dead or silent
replica), saying it was not added (/tmp/audit/fleet3 fp8_fleet.py, ranked_addtp2.py).

One trainer process, the disk method; reference engines of "tiny-fp8" (FP8 fleet, a plain engine
offered) and "tiny" (TP-1 per-rank files, a TP-2 engine offered).
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync import FSDPShardingManager, SyncConfig
from fsdp_sync.engines import ReferenceEngine
from fsdp_sync.models import build_model, load_config
from fsdp_sync.topology import SyncError

pytestmark = pytest.mark.timeout(240)


def _sync(m):
    with m:
        pass


def test_a_plain_engine_offered_to_an_fp8_fleet_is_refused_and_not_added(tmp_path):
    model = build_model(load_config("tiny-fp8"), seed=0).to(torch.bfloat16)
    kw = dict(tp_size=1, call_timeout_s=20, update_recv_timeout_s=10, kv_cache_tokens=64, dtype=torch.bfloat16)
    with ReferenceEngine("tiny-fp8", quantization="fp8", **kw) as a, ReferenceEngine("tiny-fp8", **kw) as plain:
        m = FSDPShardingManager(model, [a], config=SyncConfig(
            method="disk", disk_dir=str(tmp_path), quantization="fp8", dtype=torch.bfloat16, verify="full"))
        try:
            _sync(m)
            before = m.fleet_status()
            with pytest.raises(SyncError, match=r"add_engine: replica 1 is refused, before anything was sent: "
                                                r"ValueError: the engine serves quantization=None but "
                                                r"SyncConfig.quantization='fp8'.*it was not added to the fleet"):
                m.add_engine(plain)
            assert m.fleet_status() == before and plain.weight_version == "default"
            _sync(m)
            assert m.version == a.weight_version == "1" and m.engines == [a]
        finally:
            m.close()


def test_a_replica_that_cannot_load_the_served_files_is_not_added(tmp_path):
    """Per-rank files cut for TP 1 (``layout="engine"``); a TP-2 replica refuses to load them."""
    model = build_model(load_config("tiny"), seed=0)
    with ReferenceEngine("tiny", tp_size=1) as a, ReferenceEngine("tiny", tp_size=2) as b:
        m = FSDPShardingManager(model, [a], config=SyncConfig(method="disk", disk_dir=str(tmp_path),
                                                             layout="engine", verify="full"))
        try:
            _sync(m)
            before = m.fleet_status()
            with pytest.raises(SyncError, match=r"holds shards for 1 engine TP ranks, this engine has 2.*"
                                                r"it was not added to the fleet"):
                m.add_engine(b)
            assert m.fleet_status() == before and m.engines == [a]
        finally:
            m.close()
