"""The distributed method's full-tensor path (``layout="full"``: what SGLang is sent) flushes the
cache with its last bucket, as the per-rank path does, and a failed sync aborts the engine's open
update (audit H30).

tests/test_pause_modes.py pins the rule with the reference engine under ``layout="auto"``, which
takes per-rank buckets (`DistributedTransport._send_ranks`): a mutant that never marked the full
path's last bucket (`_send`: no ``flush_cache=True`` at all, the radix cache left holding the old
weights' KV, SGLang's case) survived every test, as did one that skipped the abort after a
failed send (the engine's update left open, its transaction holding the staged buckets, and
no word of it in the error). In process, into a tp-1 reference engine.
"""

from __future__ import annotations

import pytest

from test_pause_modes import _BusyFlush


@pytest.mark.timeout(120)
def test_the_full_paths_last_bucket_flushes_and_no_other():
    from fsdp_sync import FSDPShardingManager, SyncConfig
    from fsdp_sync.engines.reference import ReferenceEngine
    from fsdp_sync.models import build_model, load_config

    module = build_model(load_config("tiny"), seed=0)
    with ReferenceEngine("tiny", tp_size=1, kv_cache_tokens=64, call_timeout_s=30) as ref:
        eng = _BusyFlush(ref)
        for fmt in ("flattened_bucket", "per_tensor"):
            eng.flushes.clear()
            manager = FSDPShardingManager(module, [eng], config=SyncConfig(
                method="distributed", bucket_bytes=64 << 10, dist_timeout_s=30.0, layout="full",
                dist_format=fmt, dist_group_name=f"h30_full_flush_{fmt}"))
            try:
                with manager:
                    pass
                assert manager.stats.extra["layout"] == "full", fmt
                assert eng.flush_calls == 0 and len(eng.flushes) > 1, (fmt, eng.flushes)
                assert eng.flushes == [False] * (len(eng.flushes) - 1) + [True], (fmt, eng.flushes)
            finally:
                manager.close()


class _Refuses(_BusyFlush):
    """Records begin/end; its second update call is refused (an engine that fails mid-sync)."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.ends: list[bool] = []

    def end_weight_update(self, *, abort=False, weight_version=None):
        self.ends.append(abort)
        return self._e.end_weight_update(abort=abort, weight_version=weight_version)

    def update_weights_from_distributed(self, *a, **kw):
        if len(self.flushes) == 1:
            self.flushes.append(None)
            raise RuntimeError("refused (injected)")
        return super().update_weights_from_distributed(*a, **kw)


@pytest.mark.timeout(120)
def test_a_failed_send_aborts_the_engines_update():
    from fsdp_sync import FSDPShardingManager, SyncConfig
    from fsdp_sync.engines.reference import ReferenceEngine
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncError

    module = build_model(load_config("tiny"), seed=0)
    with ReferenceEngine("tiny", tp_size=1, kv_cache_tokens=64, call_timeout_s=30) as ref:
        eng = _Refuses(ref)
        manager = FSDPShardingManager(module, [eng], config=SyncConfig(
            method="distributed", bucket_bytes=64 << 10, dist_timeout_s=30.0, layout="full",
            dist_group_name="h30_abort"))
        try:
            with pytest.raises(SyncError, match="engine 0 refused bucket 1 .*refused \\(injected\\)"):
                with manager:
                    pass
            assert eng.ends == [True], eng.ends            # aborted, never committed
        finally:
            manager.close()
