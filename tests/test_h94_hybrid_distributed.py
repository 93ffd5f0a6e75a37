"""The 2 x 2 hybrid-sharded trainers of `test_h93_hybrid_2x2` (4 ranks: 2 replicas x 2 shards)
synced by the distributed method: FSDP2 HSDP on a ("dp_replicate", "dp_shard") mesh with shard
groups {0, 1}, {2, 3} and transposed {0, 2}, {1, 3}; FSDP1 HYBRID_SHARD over
``process_group=(shard, replicate)`` with ``fsdp1_state_dict="sharded"`` (transposed); FSDP1
HYBRID_SHARD over a 2 x 2 device_mesh with "sharded". An engine of TP 2 (a ReferenceEngine on
rank 0, its TP ranks joining the update group) is updated with ``layout`` "auto", "engine" and
"full" (64 KiB buckets: 8 per sync, the next gathered while one is on the wire), with new
weights (the same on both replicas) before each sync; after each it holds the
trainer's weights bit for bit (against the export and an unsharded copy), every rank records the
same answer, and the layout used is per-rank buckets ("engine") unless "full" was asked.
One 4-rank job for every case.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env

sys.path.insert(0, str(Path(__file__).parent))
from _hybrid import note_checksums, wrap_2x2  # noqa: E402

CASES = [   # (wrapping, SyncConfig.fsdp1_state_dict (None: the default), shard groups {0, 2}, {1, 3})
    ("fsdp2", None, False), ("fsdp2", None, True), ("fsdp1-groups", "sharded", True),
    ("fsdp1-mesh", "sharded", False)]
LAYOUTS = ("auto", "engine", "full")


def _job(rank: int, world: int) -> list[dict]:
    from fsdp_sync import FSDPShardingManager, SyncConfig, SyncError
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.models import build_model, load_config

    torch.set_num_threads(1)
    cfg = load_config("tiny")
    engine = ReferenceEngine(model_config=cfg, tp_size=2, device="cpu", dtype=torch.float32) \
        if rank == 0 else None
    out = []
    try:
        for c, (kind, state_dict, transposed) in enumerate(CASES):
            model, flats = wrap_2x2(kind, build_model(cfg, seed=60 + c), transposed)
            plain = build_model(cfg, seed=60 + c)
            for layout in LAYOUTS:
                with torch.no_grad():    # new weights for every sync, the same on both replicas
                    for t in flats + list(plain.parameters()):
                        t.mul_(1.5).add_(0.25)
                kw = dict(method="distributed", layout=layout, dtype=torch.float32,
                          free_cache_engine=False, memory_probe="off", dist_timeout_s=30.0,
                          dist_group_name=f"h94_{c}_{layout}", bucket_bytes=64 << 10)
                if state_dict is not None:
                    kw["fsdp1_state_dict"] = state_dict
                rec = {"case": f"{kind} {state_dict}" + " transposed" * transposed, "layout": layout}
                before = engine.weights_checksum() if engine is not None else None
                manager = FSDPShardingManager(model, [engine] if engine is not None else None,
                                              config=SyncConfig(**kw))
                try:
                    with manager:
                        rec["used"] = manager.stats.extra.get("layout")
                        rec["buckets"] = manager.stats.buckets
                except SyncError as exc:
                    rec["error"] = str(exc)
                finally:
                    manager.close()
                note_checksums(rec, model, plain, engine, before)
                out.append(rec)
            del model, plain, flats
    finally:
        if engine is not None:
            engine.shutdown()
    return out


@pytest.mark.timeout(60)
def test_hybrid_shard_2x2_syncs_bit_exact_by_the_distributed_method():
    per_rank = run_ranks(_job, 4, timeout_s=50, pg_timeout_s=30, env=spawn_env())
    assert all(len(recs) == len(CASES) * len(LAYOUTS) for recs in per_rank), per_rank
    for i, rec in enumerate(per_rank[0]):
        assert "error" not in rec, rec
        assert rec["trainer"] == rec["unsharded"], rec
        # per-rank buckets where the layout allows them (cut over each shard group)
        assert rec["used"] == ("full" if rec["layout"] == "full" else "engine"), rec
        assert rec["buckets"] > 4, rec     # 64 KiB buckets: several, the next gathered while one is sent
        # the engine holds the trainer's weights, bit for bit
        assert rec["engine"] == rec["trainer"] and rec["changed"], rec
        for r in range(1, 4):
            other = per_rank[r][i]
            assert other == {k: v for k, v in rec.items() if k not in ("engine", "changed")}, (r, other, rec)
