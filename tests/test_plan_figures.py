"""The plan's memory figures against what the sync really holds, or an independent count.

* FP8, distributed method, per-rank buckets, engine TP 2: trainer rank 0 quantizes each engine
  rank's part of a bucket into a buffer of its own (`transport.distributed`), so a quantized
  bucket is TP parts. The plan's ``quantized_bucket_bytes`` (`plan_bytes.largest_quantized_bucket`,
  which the bench also holds its FP8 rows to, so the bench cannot check it) equals the largest set
  of those buffers a real sync allocated.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env

TP, BUCKET = 2, 1 << 20


def _fp8_job(rank, world):
    from fsdp_sync import FSDPShardingManager, SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.plan import Cluster, PlanJob, plan_row
    from fsdp_sync.plan_bytes import sync_quantized_bucket
    from fsdp_sync.transport import distributed

    torch.set_num_threads(1)
    pools = []

    class Recorded(distributed._RankBufferPool):
        def __init__(self, *a):
            super().__init__(*a)
            pools.append(self)

    distributed._RankBufferPool = Recorded
    cfg = load_config("tiny-fp8")
    model = build_model(cfg, seed=0)
    with ReferenceEngine(model_config=cfg, tp_size=TP, quantization="fp8", kv_cache_tokens=128) as engine:
        conf = SyncConfig(method="distributed", layout="engine", quantization="fp8", bucket_bytes=BUCKET,
                          dtype=torch.float32, free_cache_engine=False, dist_timeout_s=60)
        manager = FSDPShardingManager(model, engine, config=conf)
        with manager:
            pass
        manager.close()
    assert len(pools) == 2, len(pools)      # the bf16/fp32 parts, then the quantized parts
    bufs = pools[1].bufs
    held = [sum(b.numel() for b in bufs[s:s + TP] if b is not None) for s in range(0, len(bufs), TP)]
    row = plan_row(PlanJob(model="tiny-fp8", method="distributed", layout="engine", bucket_bytes=BUCKET,
                           dtype="float32", quantization="fp8", ranks=1, fsdp=2, tp=TP, engine="reference"),
                   Cluster("cpu-test", "cpu", 64, 10**12, 5.0, 1.0, 1.0, 1.0, 1.0, 1e-4, 1e-4))
    return {"held": held, "largest": sync_quantized_bucket(cfg, model, "distributed", "engine", BUCKET,
                                                           torch.float32, TP),
            "plan": row["quantized_bucket_bytes"]}


@pytest.mark.timeout(120)
def test_fp8_per_rank_quantized_bucket_is_every_engine_ranks_part():
    (out,) = run_ranks(_fp8_job, 1, timeout_s=110, env=spawn_env())
    # one buffer set per bucket in flight, each TP quantized parts: the largest set is the figure
    assert len(out["held"]) == 2 and min(out["held"]) > 0, out
    assert out["largest"] == max(out["held"]) == out["plan"], out
