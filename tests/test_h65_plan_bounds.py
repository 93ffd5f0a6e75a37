"""`fsdp_sync.plan` at the edges H65's mutation pass found no test holding: a CPU cluster whose
hosts hold exactly the trainer's ranks is one host (its shards in one host's memory, the
host-shared path the bench takes there), not several (mutant ``world < gpus_per_node``: the plan
said all-gather, 2 x the bytes each rank receives, for the 2-rank host it was measured on)."""

from __future__ import annotations

import dataclasses

import pytest

from fsdp_sync.plan import Cluster, PlanJob, plan_row

CPU = Cluster("cpu-test", "cpu", 2, 10**12, 5.0, 1.0, 1.0, 1.0, 1.0, 1e-4, 1e-4)


@pytest.mark.parametrize("method, layout, path", [("tensor", "full", "host-shared"),
                                                  ("tensor", "engine", "host-shared"),
                                                  ("disk", "full", "host-shared")])
def test_ranks_that_fill_one_cpu_host_share_its_memory(method, layout, path):
    job = PlanJob("tiny", method, layout, 1 << 20, "float32", None, 2, 2, 2, engine="reference")
    row = plan_row(job, CPU)
    assert (row["path"], row["share_host_memory"], row["trainer_rank_bytes_in"]) == (path, True, 0), row
    # one rank more than the host holds: several hosts, gathered
    wide = plan_row(dataclasses.replace(job, ranks=4), CPU)
    assert wide["path"] != "host-shared" and not wide["share_host_memory"], wide
    assert wide["trainer_rank_bytes_in"] > 0, wide


def test_a_plan_no_bucket_fits_suggests_none():
    """The largest tensor alone over the memory left: the refusal says no bucket fits and
    suggests none (``suggested_bucket_bytes`` None, as `plan_rows`' refused row and docs/plan.md
    say), not a bucket of 0 bytes (mutant ``best = lo * MiB``: 0, which no sync can take)."""
    from fsdp_sync.plan import PlanError

    small = Cluster("small-gpu", "cuda", 8, 2 * 2**20, 5.0, 1.0, 1.0, 1.0, 1.0, 1e-4, 1e-4)   # 307 KiB left < 3 x 128 KiB
    job = PlanJob("tiny", "tensor", "full", 64 << 20, "float32", None, 2, 2, 2, trainer_resident_bytes=0)
    with pytest.raises(PlanError, match="no bucket fits") as info:
        plan_row(job, small)
    assert info.value.suggested_bucket_bytes is None
    roomy = dataclasses.replace(small, memory_per_gpu=100 * 2**20)      # 15 MiB left: some buckets fit
    with pytest.raises(PlanError, match=r"the largest bucket that fits is \d+ MiB") as info:
        plan_row(job, roomy)
    assert info.value.suggested_bucket_bytes and info.value.suggested_bucket_bytes % 2**20 == 0


def test_a_cpu_host_counts_every_engine_worker_of_a_disaggregated_sync():
    """One host holds the trainer ranks and every engine worker (tp of them per engine): each
    worker's receive buffer is counted, as its weights are (mutant: one worker per engine, the
    other TP ranks' buffers left out of the host's need)."""
    from fsdp_sync.plan import PlanError, engine_memory_budget

    job = PlanJob("tiny", "distributed", "full", 1 << 20, "float32", None, 2, 2, 2, engine="sglang")
    row = plan_row(job, CPU)            # fits: its figures
    trainer, shard = row["memory_budget_bytes"], row["engine_rank_shard_bytes"]
    worker = engine_memory_budget("distributed", 1 << 20, row["largest_tensor_bytes"], shard, False)
    need = 2 * trainer + 2 * worker["engine_memory_budget_bytes"]      # 2 trainer ranks, 2 workers
    held = 2 * row["trainer_resident_bytes"] + 2 * shard
    tight = dataclasses.replace(CPU, memory_per_gpu=held + need - 1)   # a byte short
    with pytest.raises(PlanError, match=r"2 trainer rank\(s\) x .* \+ 2 engine worker\(s\) x "):
        plan_row(job, tight)
    assert plan_row(job, dataclasses.replace(CPU, memory_per_gpu=held + need))["memory_free_bytes"] == need


def test_trainer_resident_gib_is_gib():
    """``--trainer-resident-gib`` is GiB (mutant: read as MiB, a 2 GiB resident trainer planned
    as 2 MiB, its GPU's fit check 2 GiB too generous; survived the plan tests)."""
    from fsdp_sync.cli.app import parse_args
    from fsdp_sync.cli.plan import plan_rows

    args = parse_args(["plan", "--models", "tiny", "--methods", "distributed", "--trainer-resident-gib", "2",
                       "--cluster", "h100-node"])
    (row,) = plan_rows(args.sweep, "h100-node")
    assert row["trainer_resident_bytes"] == 2 << 30, row
    assert row["trainer_memory_free_bytes"] == 81_082 * 2**20 - (2 << 30), row     # beside it on a trainer GPU
