"""The bytes a trainer rank receives, as the sync's own stats count them (from the pieces' sizes,
no collective of their own), equal `fsdp-sync plan`'s: on the all-gather path of an MoE whose
experts one rank holds whole (broadcast from it) and whose rows split unevenly, on the gather to
rank 0, and through FSDP1's full state dict (every unit all-gathered by torch first)."""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env
from fsdp_sync.plan import Cluster, PlanJob, plan_row

CPU = Cluster("cpu-test", "cpu", 64, 10**12, 5.0, 1.0, 1.0, 1.0, 1.0, 1e-4, 1e-4)
JOBS = [  # (model, method, layout, fsdp, fsdp1_state_dict)
    ("tiny-qwen2-moe", "tensor", "full", 2, "full"),
    ("tiny-qwen2-moe", "distributed", "full", 2, "full"),
    ("small", "tensor", "engine", 1, "full"),
    ("small", "tensor", "full", 1, "sharded"),
]


def _syncs(rank: int, world: int) -> list:
    from fsdp_sync.cli.trainer import wrap_fsdp
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncTopology, make_mesh

    torch.set_num_threads(1)
    out = []
    for model_name, method, layout, fsdp, kind in JOBS:
        cfg = load_config(model_name)
        model = wrap_fsdp(build_model(cfg, seed=0), fsdp)
        conf = SyncConfig(method=method, bucket_bytes=2**20, dtype=torch.float32, memory_probe="off",
                          layout=layout, share_host_memory=False, fsdp1_state_dict=kind,
                          **({"dist_master_address": "127.0.0.1"} if method == "distributed" else {}))
        mesh = make_mesh(world // 2, 2, "cpu") if method == "tensor" else None
        src = SyncTopology.from_mesh(mesh).is_tp_src if mesh is not None else rank == 0
        engine = ReferenceEngine(model_config=cfg, tp_size=2, device="cpu", dtype=torch.float32) if src else None
        manager = FSDPShardingManager(model, engine, config=conf, **({"mesh": mesh} if mesh is not None else {}))
        try:
            with manager:
                pass
            out.append(manager.stats.extra["trainer_rank_bytes_in"])
        finally:
            manager.close()
            if engine is not None:
                engine.shutdown()
    return out


@pytest.mark.timeout(240)
def test_the_syncs_stats_count_what_each_trainer_rank_received_as_the_plan_does():
    """Before: the full layout's stats had no trainer_rank_bytes_in (the bench wrote the formula
    model - model / ranks: 330,112 for tiny-qwen2-moe at 2 ranks, where the busiest rank receives
    330,368; the gather to rank 0 the same, though only rank 0 receives), and an FSDP1 sync through
    the full state dict reported 0 for the 17,838,592 bytes torch gathered on each rank of `small`."""
    per_rank = run_ranks(_syncs, 2, timeout_s=220, env=spawn_env())
    for i, (model, method, layout, fsdp, kind) in enumerate(JOBS):
        plan = plan_row(PlanJob(model, method, layout, 2**20, "float32", None, 2, fsdp, 2,
                                share_host_memory=False, engine="reference", fsdp1_state_dict=kind), CPU)
        measured = max(r[i] for r in per_rank)
        assert measured == plan["trainer_rank_bytes_in"] > 0, (JOBS[i], [r[i] for r in per_rank], plan["path"])


@pytest.mark.timeout(200)
def test_the_bench_counts_the_busiest_writers_quantized_tensors_as_the_plan_does():
    """A disk row with FP8 took quantized_tensors from trainer rank 0's stats, the plan from the
    busiest writer: tiny-fp8 in 192 KiB buckets, bucket k written (and quantized) by writer k mod 2,
    is 6 quantized tensors on writer 0 and 8 on writer 1; the bench row said 6, the plan 8."""
    from fsdp_sync.cli.bench.main import BenchSpec, run_bench

    spec = BenchSpec(models=("tiny-fp8",), strategies=("flattened",), methods=("disk",), layouts=("full",),
                     bucket_mb=(0.1875,), ranks=(2,), tp=(2,), dtype="bfloat16", quantization=("fp8",),
                     repeats=3, warmup=0)
    (row,) = [r for r in run_bench(spec, timeout_s=180)["rows"] if not r.get("skipped")]
    plan = plan_row(PlanJob("tiny-fp8", "disk", "full", row["bucket_bytes"], "bfloat16", "fp8", 2, 2, 2,
                            engine="reference"), CPU)
    assert row["quantized_tensors"] == plan["quantized_tensors"] == 8, (row["quantized_tensors"], plan["quantized_tensors"])
