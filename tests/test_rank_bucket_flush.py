"""Per-rank buckets (``layout="engine"``, `TensorTransport` with ``load_rank_bucket``) flush the
engine's cache with the LAST call of a sync only, pipelined or not: a flush on an earlier bucket
would let the engine serve from a cache of half-updated weights, and none at all would leave the
old weights' cache in place. One rank, a tiny model, a TP-1 reference engine wrapped to record
each call's ``flush_cache``."""

from __future__ import annotations

import pytest

from fsdp_sync.cli.launch import run_ranks, spawn_env


def _job(rank: int, world: int) -> dict:
    from fsdp_sync import FSDPShardingManager, SyncConfig, make_mesh
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.models import build_model, load_config

    class FlushRecorder:
        def __init__(self, engine):
            self._engine, self.flushes = engine, []

        def __getattr__(self, name):
            return getattr(self._engine, name)

        def load_rank_bucket(self, bucket, payloads, flush_cache=True, **kw):
            self.flushes.append(flush_cache)
            return self._engine.load_rank_bucket(bucket, payloads, flush_cache=flush_cache, **kw)

    cfg = load_config("tiny")
    out = {}
    with ReferenceEngine(model_config=cfg, tp_size=1) as engine:
        for pipelined in (False, True):
            rec = FlushRecorder(engine)
            m = FSDPShardingManager(build_model(cfg, seed=0), rec, mesh=make_mesh(1, 1),
                                    config=SyncConfig(method="tensor", layout="engine", strategy="flattened",
                                                      pipelined=pipelined, bucket_bytes=1 << 14,
                                                      free_cache_engine=False))
            with m:
                pass
            m.close()
            out[pipelined] = rec.flushes
    return out


@pytest.mark.timeout(150)
def test_per_rank_buckets_flush_the_cache_with_their_last_call_only():
    (out,) = run_ranks(_job, 1, timeout_s=120, pg_timeout_s=30, env=spawn_env())
    for pipelined, flushes in out.items():
        assert len(flushes) > 1 and flushes[-1] is True and True not in flushes[:-1], (pipelined, flushes)
