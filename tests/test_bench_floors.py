"""`fsdp-sync bench`'s floors: each row beside the floor of what its sync did, timed as its sync.

One bench job of ``tiny-fp8`` (bf16 rollout, FP8 on the wire, 2 trainer ranks, engine TP 2, 1 MiB
buckets) runs once for the module: its tensor rows with host-shared memory asked for but not to be
had (`HostShared.create` answers None, as with several hosts, CUDA tensors or no shared memory),
its distributed rows as usual. Each test reads the figures of one rule off those rows."""

from __future__ import annotations

import pytest

MiB = 2**20


def _bench_job(rank: int, world: int, job):
    """`bench_rank` with the tensor method's host-shared path unavailable; the distributed rows
    (`methods.method_rows`, after the tensor rows) get it back."""
    from fsdp_sync.cli.bench import main, methods
    from fsdp_sync.weights import hostbuf

    create, rows_of = hostbuf.HostShared.create, methods.method_rows

    def distributed_rows(*a, **kw):
        hostbuf.HostShared.create = create
        return rows_of(*a, **kw)

    hostbuf.HostShared.create = classmethod(lambda cls, group, count, nbytes: None)
    methods.method_rows = distributed_rows
    return main.bench_rank(rank, world, job)


@pytest.fixture(scope="module")
def fp8_rows():
    import torch

    from fsdp_sync.cli.bench.main import Job
    from fsdp_sync.cli.launch import run_ranks, spawn_env
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.weights.export import param_metas

    job = Job(model="tiny-fp8", ranks=2, tp=2, multi_stage=True, device="cpu", dtype="bfloat16",
              strategies=("flattened",), bucket_mb=(1.0,), repeats=3, warmup=1, share_host_memory=(True,),
              methods=("tensor", "distributed"), layouts=("full", "engine"), pipelined=(False,),
              quantization="fp8")
    rows = run_ranks(_bench_job, 2, job, timeout_s=200, pg_timeout_s=60, env=spawn_env())[0]["rows"]
    model_bytes = sum(m.nbytes for m in param_metas(build_model(load_config("tiny-fp8"), seed=0), torch.bfloat16))
    return {(r["method"], r["strategy"], r.get("layout")): r for r in rows}, model_bytes


@pytest.mark.timeout(240)
def test_tensor_rows_say_the_path_their_sync_took_and_sit_beside_its_floor(fp8_rows):
    """Before: a tensor row said what was asked (``share_host_memory`` on) and, per-rank, was put
    beside the all-gather floor with no all-to-all floor measured, whenever the transport gathered
    instead (silently, as on CUDA or several hosts): 'shared host memory yes', judged against
    floor_shared_seconds, a floor of a path it did not take. Now the row says what its sync did
    (`layout_figures`: bytes received; per-rank: ``reshard_path``) and has that path's floor."""
    rows, model_bytes = fp8_rows
    full, engine = rows[("tensor", "flattened", "full")], rows[("tensor", "flattened", "engine")]
    assert full["trainer_rank_bytes_in"] > 0 and engine["reshard_path"] == "all-to-all"
    for r in (full, engine):
        assert r["share_host_memory"] is False, r["share_host_memory"]
        assert r["floor_shared_seconds"] is None and r["floor_shared_bytes"] is None
    # the full row: a bare all-gather of the model's bytes; per-rank: the all-to-all of what a
    # trainer rank received, beside each rank's copy of its own shard
    assert full["floor_bytes"]["all_gather"] - model_bytes in range(0, 2 * 4)   # pieces split in 2
    assert engine["floor_bytes"]["all_to_all_in"] >= engine["trainer_rank_bytes_in"] > 0
    assert engine["floor_bytes"]["own_copy"] == model_bytes // 2


@pytest.mark.timeout(240)
def test_tensor_fp8_all_gather_floor_copies_the_engines_fp8_shard(fp8_rows):
    """Before: the all-gather floor's engine copy was model_bytes // tp in the rollout dtype (bf16)
    where the FP8 engine rank holds its FP8 shard (the shared floor already copied that)."""
    rows, model_bytes = fp8_rows
    for lay in ("full", "engine"):
        r = rows[("tensor", "flattened", lay)]
        assert r["floor_bytes"]["engine_copy"] == r["engine_rank_shard_bytes"] < 0.6 * model_bytes // 2, r


@pytest.mark.timeout(240)
def test_distributed_fp8_floor_gathers_the_rollout_dtype_and_sends_the_fp8_bytes(fp8_rows):
    """Before: the distributed floor gathered stats.bytes, the FP8 total, while the sync gathers
    the bf16 tensors to trainer rank 0 and quantizes there (docs/data/bench-fp8.json: 201.9 MiB
    gathered where the sync gathered 309.8). Now it gathers the model's rollout-dtype bytes and
    sends the FP8 bytes the sync sent, for the flattened, per-rank and per-tensor formats."""
    rows, model_bytes = fp8_rows
    full = rows[("distributed", "distributed:flattened_bucket", "full")]
    per_tensor = rows[("distributed", "distributed:per_tensor", "full")]
    per_rank = rows[("distributed", "distributed:per_rank_bucket", "engine")]
    for r in (full, per_tensor):
        assert r["bytes"] < 0.6 * model_bytes                        # FP8 on the wire
        # rank 0 received the other rank's half: the floor gathers both halves
        assert r["trainer_rank_bytes_in"] * 2 <= r["floor_bytes"]["gathered"] < model_bytes + 2 * 4, r
        assert r["floor_bytes"]["broadcast"] == r["bytes"], r
    # per-rank, host-shared (the trainer ranks write their bf16 shards, rank 0 quantizes)
    assert per_rank["share_host_memory"] is True and per_rank["reshard_path"] == "host-shared"
    assert per_rank["floor_bytes"] == {"own_copy": model_bytes // 2,
                                       "sent_to_each_engine_rank": per_rank["engine_rank_bytes_in"]}


def test_floors_are_timed_as_the_syncs_are(monkeypatch):
    """Before: every floor timed max(repeats, 5) runs after exactly one warm-up, whatever the
    job's ``warmup`` and ``repeats`` (a recipe's ``warmup: 0`` timed its syncs cold and its floors
    warm). Now `median_seconds` runs ``warmup`` runs not counted, then ``repeats`` timed."""
    import torch.distributed as dist

    from fsdp_sync.cli.bench import floors

    monkeypatch.setattr(floors, "cpu_group", lambda *a: None)
    monkeypatch.setattr(dist, "barrier", lambda *a, **kw: None)
    calls = []
    for warmup, repeats in ((0, 3), (2, 3), (1, 5)):
        calls.clear()
        floors.median_seconds(lambda: calls.append(1), "cpu", repeats, warmup)
        assert len(calls) == warmup + repeats
    assert floors.bucket_pieces(5 * MiB + 3, MiB) == [MiB] * 5 + [3] and floors.bucket_pieces(0, MiB) == []
