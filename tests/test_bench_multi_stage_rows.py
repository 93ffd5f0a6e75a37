"""`fsdp-sync bench --multi-stage off` with the distributed and disk methods runs their syncs with
multi-stage wake-up off (cli3 audit). Before, those rows' `SyncConfig` never got the job's setting:
they ran the staged wake-up (resume_weights ... resume_kv_cache) while the row and the table said
"multi-stage off", so `--multi-stage on,off` measured one thing twice under two labels."""

from __future__ import annotations

import pytest

from fsdp_sync.cli.launch import run_ranks, spawn_env


@pytest.mark.timeout(200)
@pytest.mark.parametrize("multi_stage", [False, True], ids=["off", "on"])
def test_distributed_and_disk_rows_run_the_wake_up_their_row_names(multi_stage):
    from fsdp_sync.cli.bench.main import Job, bench_rank

    job = Job(model="tiny", ranks=1, tp=1, multi_stage=multi_stage, device="cpu", dtype="float32",
              strategies=(), bucket_mb=(1.0,), repeats=1, warmup=0, methods=("distributed", "disk"),
              layouts=("full",))
    rows = run_ranks(bench_rank, 1, job, timeout_s=180, pg_timeout_s=60, env=spawn_env())[0]["rows"]
    assert {r["method"] for r in rows} == {"distributed", "disk"}
    for r in rows:
        names = {s["name"] for s in r["stages"]}
        assert r["multi_stage"] is multi_stage
        if multi_stage:
            assert {"resume_weights", "resume_kv_cache"} <= names and "resume_all" not in names, names
        else:
            assert "resume_all" in names and not names & {"resume_weights", "resume_kv_cache"}, names
