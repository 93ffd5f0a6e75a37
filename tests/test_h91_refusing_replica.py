"""One replica of a fleet refuses a bucket of a ``method="distributed"`` sync (H91).

gloo's broadcast is a tree: with three replicas at TP 1 (group ranks 1, 2, 3 after the trainer's 0)
replica 2 (rank 3) receives from replica 0 (rank 1), not from the trainer. A replica that refuses
the bucket at once never joins the broadcast, so the replica below it waits in a receive, and the
one above it in its send to it, that can never complete. Before, the failed sync waited for that
replica's answer until ``dist_timeout_s`` (30 s measured, with the refusal 0.01 s in; the replica
was then marked stuck, left inside its update and not told to leave the group). Now the refusing
replica leaves the group at once and our end is destroyed, so the others fail their receive (or
send) at once: the sync fails within a second, naming the refusing replica, every replica aborted
on the old weights, and the next sync remakes the group and delivers the trainer's weights.

In-process: one trainer rank (no process group), reference engines at TP 1. ``dist_timeout_s`` is
8 s and the engines' ``update_recv_timeout_s`` 20 s, so the code before fails the timing
assertion (about 8 s) instead of hanging.
"""

from __future__ import annotations

import time

import pytest
import torch

DIST_TIMEOUT_S = 8.0


def _engine():
    from fsdp_sync.engines.reference import ReferenceEngine

    return ReferenceEngine("tiny", tp_size=1, kv_cache_tokens=64, call_timeout_s=30,
                           update_recv_timeout_s=20)


def _refusing(how: str):
    def refuse(**kw):
        if how == "raise":      # the reference engine's and the SGLang adapter's way
            raise RuntimeError("injected: this replica refuses the bucket")
        return False, "injected: this replica refuses the bucket"    # SGLang's in-process Engine's
    return refuse


@pytest.mark.timeout(120)
def test_a_replica_that_refuses_a_bucket_fails_the_sync_at_once_and_the_next_sync_works(monkeypatch):
    from fsdp_sync import FSDPShardingManager, SyncConfig
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncError

    torch.set_num_threads(1)
    engines = [_engine() for _ in range(3)]
    manager = None
    try:
        module = build_model(load_config("tiny"), seed=5)
        manager = FSDPShardingManager(module, engines, config=SyncConfig(
            method="distributed", bucket_bytes=1 << 16, layout="full", dist_timeout_s=DIST_TIMEOUT_S,
            dist_group_name="h91_refusing_replica"))
        with manager:
            pass
        # replica 0 refusing leaves replica 2 (its child in the tree) in its receive; replica 2
        # refusing leaves replica 0 in its send to it
        for bad, how in ((0, "raise"), (2, "answer")):
            version = manager.version
            trained = engines[0].weights_checksum()
            assert all(e.weights_checksum() == trained for e in engines)
            with torch.no_grad():
                for p in module.parameters():
                    p.add_(0.01)
            monkeypatch.setattr(engines[bad], "update_weights_from_distributed", _refusing(how))
            t0 = time.monotonic()
            with pytest.raises(SyncError) as info:
                with manager:
                    pass
            seconds = time.monotonic() - t0
            monkeypatch.undo()
            assert f"engine {bad} refused bucket 0" in str(info.value), str(info.value)
            assert "injected: this replica refuses the bucket" in str(info.value), str(info.value)
            assert seconds < 3.0, (f"replica {bad} refused at once but the sync failed after "
                                   f"{seconds:.1f} s (dist_timeout_s={DIST_TIMEOUT_S})")
            # every replica aborted on the old weights, none committed, none left inside its update
            assert manager.version == version
            assert [e._in_txn for e in engines] == [False] * 3, f"replica {bad}'s refusal"
            assert [e.weights_checksum() for e in engines] == [trained] * 3, f"replica {bad}'s refusal"
            assert manager.transport.broken or manager.transport.pg is None
            # the next sync remakes the group and every replica takes the trainer's weights
            with manager:
                pass
            assert manager.version != version
            from fsdp_sync.engines.base import checksum_named_tensors
            from fsdp_sync.weights import export

            want = checksum_named_tensors(export.iter_params(module, dtype=torch.float32))
            assert [e.weights_checksum() for e in engines] == [want] * 3, f"after replica {bad}'s refusal"
    finally:
        if manager is not None:
            manager.close()
        for e in engines:
            e.shutdown()
