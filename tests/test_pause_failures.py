"""`SyncConfig.pause_mode` when a sync, its pause or its continue fails (`fsdp_sync.manager_pause`).

- a pause that fails on one trainer rank continues the engines the other ranks paused;
- a failed sync that left partly new weights on a replica (an engine that applies each call as it
  arrives) ends that replica's requests as aborted and keeps generation paused there (a fleet: out
  of service too) until the next sync commits, which continues it;
- a continue that fails after the commit leaves the manager's version the committed one, on every
  rank, and says so.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env

P = [11, 27, 93, 5]


def _sp(n: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


def _returns(engine, timeout_s: float = 10.0):
    """Generate a few tokens in a thread: the spans, or None if it did not return in time."""
    out: dict = {}
    th = threading.Thread(target=lambda: out.setdefault("r", engine.generate_requests([P], _sp(3))[0]),
                          daemon=True)
    th.start()
    th.join(timeout_s)
    return out["r"]["weight_versions"] if "r" in out else None


def _dp2_job(rank, world, fail):
    """Tensor method, dp=2 (one colocated engine per rank, TP 1), pause_mode="retract"; on rank 1
    ``fail`` ("pause": every pause_generation, "continue": the first continue_generation) raises."""
    from fsdp_sync import FSDPShardingManager, SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import make_mesh

    torch.set_num_threads(1)
    cfg = load_config("tiny")
    with ReferenceEngine(cfg, tp_size=1, kv_cache_tokens=256, call_timeout_s=30) as eng:
        if rank == 1:
            real, calls = getattr(eng, f"{fail}_generation"), []

            def flaky(*args, **kwargs):
                calls.append(1)
                if fail == "pause" or len(calls) == 1:
                    raise ConnectionError(f"{fail}_generation: connection reset (simulated)")
                return real(*args, **kwargs)
            setattr(eng, f"{fail}_generation", flaky)
        mgr = FSDPShardingManager(build_model(cfg, seed=1), eng, mesh=make_mesh(2, 1), config=SyncConfig(
            method="tensor", free_cache_engine=False, pause_mode="retract", dtype=torch.float32,
            memory_probe="off"))
        err = None
        try:
            with mgr:
                pass
        except Exception as exc:  # noqa: BLE001 - the test reads it
            err = f"{type(exc).__name__}: {exc}"
        out = {"err": err, "paused": eng.generation_paused, "version": mgr.version,
               "status_version": mgr.fleet_status()["version"], "engine_version": eng.weight_version}
        if rank == 1 and fail == "continue":
            eng.continue_generation()           # what the error says to do (its second call works)
        out["spans"] = _returns(eng)
        if out["spans"] is None:
            real_continue = getattr(type(eng), "continue_generation")
            real_continue(eng)                  # let the thread finish before the engine closes
        mgr.close()
    return out


@pytest.mark.timeout(120)
def test_a_pause_failing_on_one_rank_continues_the_engines_paused_on_the_others():
    """Before: rank 1's pause_generation raised; rank 0 had paused its engine and only the rank
    that saw the error continued its own: rank 0's engine stayed paused ('retract') after the
    failed sync, and its generate_requests never returned. Now every rank continues what it
    paused before raising the agreed error."""
    r0, r1 = run_ranks(_dp2_job, 2, "pause", timeout_s=110, pg_timeout_s=30, env=spawn_env())
    for rank, got in enumerate((r0, r1)):
        assert got["err"] and "pause_generation failed on rank 1" in got["err"], (rank, got)
        assert got["paused"] is None, (rank, got)
        assert got["spans"] is not None, (rank, got)       # generate returned
    assert r0["spans"][0]["version"] == r0["engine_version"]


@pytest.mark.timeout(120)
def test_a_continue_failing_after_the_commit_reports_the_committed_version_on_every_rank():
    """Before: rank 1's continue_generation raised after every engine had committed version '0':
    the manager raised before recording it, so mgr.version and fleet_status()['version'] said
    None on both ranks while the engines served '0'. Now the version is recorded first and the
    error says it was committed and that generation there is still paused."""
    r0, r1 = run_ranks(_dp2_job, 2, "continue", timeout_s=110, pg_timeout_s=30, env=spawn_env())
    for rank, got in ((1, r1), (0, r0)):
        assert got["version"] == got["status_version"] == got["engine_version"] == "0", (rank, got)
        assert got["err"] and "continue_generation failed on rank 1" in got["err"], (rank, got)
        assert "version '0' was committed" in got["err"] and "still paused" in got["err"], got
        assert got["spans"] is not None, (rank, got)
    assert r0["paused"] is None and r1["paused"] == "retract", (r0, r1)


def _partial_job(rank, world, method):
    """A reference engine with transactional_updates=False serving version 'A', one request
    held by the sync's retract pause; the sync's third bucket fails (FSDP_SYNC_FAULT), then a
    second sync runs."""
    from fsdp_sync import FSDPShardingManager, SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import make_mesh

    torch.set_num_threads(1)
    cfg = load_config("tiny")
    with ReferenceEngine(cfg, tp_size=1, kv_cache_tokens=512, transactional_updates=False,
                         call_timeout_s=30) as eng:
        eng.update_weights_from_tensor(list(build_model(cfg, seed=0).state_dict().items()), weight_version="A")
        tensor = method == "tensor"
        mgr = FSDPShardingManager(build_model(cfg, seed=1), eng if tensor else [eng],
                                  mesh=make_mesh(1, 1) if tensor else None, config=SyncConfig(
                                      method=method, free_cache_engine=False, pause_mode="retract",
                                      dtype=torch.float32, bucket_bytes=16 << 10, memory_probe="off"))
        eng._pause_after_steps(3)        # the request is running (3 tokens made) when the sync begins
        res: dict = {}
        th = threading.Thread(target=lambda: res.setdefault("r", eng.generate_requests([P], _sp(200))[0]))
        th.start()
        deadline = time.monotonic() + 30
        while eng.generation_paused is None and time.monotonic() < deadline:
            time.sleep(0.01)
        err = None
        try:
            with mgr:
                pass
        except Exception as exc:  # noqa: BLE001 - the test reads it
            err = f"{type(exc).__name__}: {exc} {getattr(exc, '__notes__', '')}"
        th.join(30)
        r = res.get("r") or {}
        out = {"err": err, "finish": r.get("finish_reason"), "spans": r.get("weight_versions"),
               "paused": eng.generation_paused, "serving_state": eng.serving_state,
               "fleet": mgr.fleet_status()}
        out["spans_while_failed"] = _returns(eng, 2.0)     # paused: it does not return
        with mgr:
            pass
        out.update(version=mgr.version, engine_version=eng.weight_version,
                   paused_after=eng.generation_paused, serving_after=eng.serving_state,
                   spans_after=_returns(eng), fleet_after=mgr.fleet_status())
        mgr.close()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method,point", [("tensor", "stage"), ("distributed", "stage_broadcast")])
def test_a_failed_sync_leaving_partly_new_weights_keeps_generation_paused_there(method, point):
    """Before: the engine applied buckets 0 and 1 of version '0' and failed the third; the manager
    continued generation anyway, and the retracted request finished 200 tokens long ('length'),
    its tokens after the pause made by mixed weights but tagged 'A'; a fleet kept the replica in
    service. Now its requests come back aborted, generation stays paused there (a fleet: out of
    service too), and the next sync's commit continues it."""
    env = spawn_env({"FSDP_SYNC_FAULT": f"worker:0:{point}:raise", "FSDP_SYNC_FAULT_AFTER": "3"})
    (got,) = run_ranks(_partial_job, 1, method, timeout_s=110, pg_timeout_s=30, env=env)
    assert got["err"] and "holds partly new weights" in got["err"], got
    assert "generation stays paused on it until a sync succeeds" in got["err"], got
    assert got["finish"]["type"] == "abort", got                  # not 'length' on mixed weights
    assert [s["version"] for s in got["spans"]] == ["A"] and got["spans"][-1]["end"] == 3, got
    assert got["paused"] == "abort" and got["spans_while_failed"] is None, got
    assert got["fleet"]["replicas"][0]["generation_paused"], got    # fleet_status says so (review5)
    if method == "tensor":
        assert got["serving_state"] is None, got
    else:       # a fleet: out of service, to rejoin at the next sync
        assert got["serving_state"] and not got["fleet"]["replicas"][0]["serving"], got
    assert got["version"] == got["engine_version"] == "1", got
    assert got["paused_after"] is None and got["serving_after"] is None, got
    assert got["fleet_after"]["replicas"][0]["serving"], got
    assert not got["fleet_after"]["replicas"][0]["generation_paused"], got
    assert got["spans_after"] and got["spans_after"][-1]["version"] == "1", got
