"""A per-rank disk writer builds the buffers of every engine rank whose files it writes
(`transport.disk_ranked.write_rank_buckets`: ceil(tp / ranks) of them a bucket), and the plan's
trainer budget counts them all: before, it counted one per bucket unless FSDP1's full state dict
was exported, so one FSDP2 rank writing for an engine of TP 2 (48 MiB buckets) was budgeted 145 MiB
and peaked at 127-187 MiB (RSS, four syncs)."""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env
from fsdp_sync.plan import Cluster, PlanJob, plan_row

MiB = 2**20
CPU = Cluster("cpu-test", "cpu", 64, 10**12, 5.0, 1.0, 1.0, 1.0, 1.0, 1e-4, 1e-4)
# 8 layers of 256 x 1024 MLPs: 1 MiB largest tensor (float32), about 15 MiB per engine rank at TP 2
MODEL = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=8, vocab_size=1024)
BUCKET = 4 * MiB


def _per_bucket_buffer_bytes(rank: int, world: int, tp: int) -> list[int]:
    """One per-rank disk sync of FSDP2 ``world`` ranks into a reference engine of TP ``tp``: the
    bytes of the per-rank buffers this rank built for each bucket (the stream the writer consumes)."""
    import shutil
    import tempfile

    from fsdp_sync.cli.trainer import wrap_fsdp
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.weights import reshard

    torch.set_num_threads(1)
    seen: list[int] = []
    stream = reshard.iter_rank_buckets

    def counted(*args, **kw):
        for rb in stream(*args, **kw):
            seen.append(sum(b.numel() * b.element_size() for b in rb.buffers.values()))
            yield rb

    reshard.iter_rank_buckets = counted       # this rank's process only
    cfg = load_config("tiny", **MODEL)
    model = wrap_fsdp(build_model(cfg, seed=0), 2)
    d = tempfile.mkdtemp(prefix="fsdp-sync-test-writers-")
    conf = SyncConfig(method="disk", layout="engine", bucket_bytes=BUCKET, dtype=torch.float32,
                      memory_probe="off", disk_dir=d, share_host_memory=False)
    engine = ReferenceEngine(model_config=cfg, tp_size=tp, device="cpu", dtype=torch.float32) if rank == 0 else None
    manager = FSDPShardingManager(model, engine, config=conf)
    try:
        with manager:
            pass
        return seen
    finally:
        manager.close()
        if engine is not None:
            engine.shutdown()
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.timeout(120)
def test_a_disk_writer_for_two_engine_ranks_is_budgeted_both_buffers():
    from fsdp_sync.models import load_config

    (seen,) = run_ranks(_per_bucket_buffer_bytes, 1, 2, timeout_s=100, env=spawn_env())
    plan = plan_row(PlanJob(load_config("tiny", **MODEL), "disk", "engine", BUCKET, "float32", None, 1, 2, 2,
                            engine="reference"), CPU)
    assert len(seen) == plan["buckets"] and plan["path"] == "local"
    most = max(seen)
    assert most > BUCKET, seen             # two engine ranks' buffers in one bucket
    # the rule's 3 buckets in flight (made, serialized, being written) of what the writer builds
    # for one, + the largest tensor gathered whole: 3 x 2 x 4 MiB + 1 MiB = 25 MiB (was 13 MiB)
    assert 3 * most + plan["largest_tensor_bytes"] <= plan["memory_budget_bytes"], (seen, plan["memory_budget_rule"])
    assert plan["memory_budget_rule"].startswith("3 x 2 x max(bucket")
    # one quantized buffer per engine rank it writes for (`StreamQuantizer.rank_bucket`); a writer
    # per engine rank builds one
    job = dict(model="tiny-fp8", method="disk", layout="engine", bucket_bytes=MiB, dtype="bfloat16",
               quantization="fp8", tp=2, engine="reference")
    assert "+ 2 quantized buckets" in plan_row(PlanJob(**job, ranks=1), CPU)["memory_budget_rule"]
    assert plan_row(PlanJob(**job, ranks=2), CPU)["memory_budget_rule"].startswith("3 x max(bucket")
