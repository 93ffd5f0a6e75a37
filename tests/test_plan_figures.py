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


# ---------------------------------------------------------------- the plan alone (no sync)

MiB = 1 << 20


def _cpu(**kw):
    import dataclasses

    from fsdp_sync.plan import Cluster

    return dataclasses.replace(Cluster("cpu-test", "cpu", 64, 10**12, 5.0, 1.0, 1.0, 1.0, 1.0, 1e-4, 1e-4), **kw)


def _phase(row: dict, what: str) -> float:
    hits = [p["seconds"] for p in row["phases"] if p["what"].startswith(what)]
    assert len(hits) == 1, (what, [p["what"] for p in row["phases"]])
    return hits[0]


@pytest.mark.parametrize("ranks", [2, 4])
def test_fsdp1_sharded_state_dict_budget_is_the_model_and_its_sharded_copy(ranks):
    """FSDP1's "sharded" state dict: the model (each unit unsharded in turn, the root's held) plus
    its sharded copy, model / ranks, on top of the buffers' rule; "full": 2 x the model. Both
    against the same job exported through "local" (no state dict: the buffers alone)."""
    from fsdp_sync.plan import PlanJob, plan_row

    job = dict(model="small", method="tensor", layout="engine", bucket_bytes=MiB, dtype="float32", ranks=ranks,
               fsdp=1, tp=2, share_host_memory=False, engine="reference")
    full, sharded = (plan_row(PlanJob(**job, fsdp1_state_dict=k), _cpu()) for k in ("full", "sharded"))
    model = full["params"] * 4          # the trainer's float32
    assert model == full["model_bytes"] == 35_677_184
    buffers = full["memory_budget_bytes"] - 2 * model
    assert full["memory_budget_rule"].endswith("+ FSDP1's full state dict 2 x the model")
    assert sharded["memory_budget_rule"].endswith("+ FSDP1's sharded state dict the model + model / ranks")
    assert sharded["memory_budget_bytes"] == buffers + model + model // ranks, (ranks, sharded["memory_budget_rule"])


def test_host_shared_per_rank_buffers_first_touch_is_the_groups_share_of_every_engine_ranks():
    """Per-rank buckets through the host-shared buffer: one buffer per engine TP rank per set (two,
    pipelined), each the largest per-rank bucket, touched a part by each of the group's ranks:
    tp x 2 x largest / ranks each; without the shared buffer each rank touches them all."""
    from fsdp_sync.models import load_config
    from fsdp_sync.plan import PlanJob, plan_row
    from fsdp_sync.weights import reshard
    from fsdp_sync.weights.layout import layout_for

    ranks, tp = 2, 2
    largest = max(b.nbytes for b in reshard.plan_rank_buckets(layout_for(load_config("small"), tp),
                                                             torch.float32, MiB))
    job = dict(model="small", method="tensor", layout="engine", bucket_bytes=MiB, dtype="float32", ranks=ranks,
               tp=tp, engine="reference")
    host = _cpu(touch_gbps=1.0)
    shared = plan_row(PlanJob(**job, share_host_memory=True), host)
    alone = plan_row(PlanJob(**job, share_host_memory=False), host)
    assert (shared["path"], alone["path"]) == ("host-shared", "all-to-all")
    touch = "first touch of the sync's fresh buffers"
    assert _phase(shared, touch) == pytest.approx(tp * 2 * largest / ranks / 1e9)
    assert _phase(alone, touch) == pytest.approx(tp * 2 * largest / 1e9)


def test_distributed_full_tensors_overlap_whatever_pipelined_says():
    """The distributed method with full tensors always double-buffers (trainer rank 0's two
    gather buffers: bucket k on the wire while k+1 is gathered): ``pipelined=False`` changes
    nothing there, so its estimate is the overlapped one, less than the sum of its phases."""
    from fsdp_sync.plan import PlanJob, plan_row

    job = dict(model="small", method="distributed", layout="full", bucket_bytes=MiB, dtype="float32", ranks=2,
               tp=1, engine="sglang", share_host_memory=False)
    on, off = (plan_row(PlanJob(**job, pipelined=p), _cpu()) for p in (True, False))
    assert on["buckets"] > 1
    assert off["estimate_rule"].endswith("(pipelined)"), off["estimate_rule"]
    assert off["seconds"] == on["seconds"] < sum(p["seconds"] for p in off["phases"])
