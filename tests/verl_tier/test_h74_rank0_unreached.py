"""Infer-TP rank 0 failing to reach its SGLang server before a sync (audit H74, item a).

verl's colocated sync: every rank of the infer-TP group calls ``resume(["weights"])`` then
``update_weights``; only rank 0 talks to SGLang. Before, a failure there (verl's server actor not
found: the replica died; the server's memory not resumed) raised on rank 0 alone, and rank 1 went
on into the sync and waited in a collective rank 0 never reached: at the first sync
``dist_timeout_s`` in the peer check, then "did not start fsdp_sync's adapter" (wrong: it did),
at a later one the process group's timeout, then gloo's error. Now rank 0's error is raised on
both ranks at the sync's first agreement, naming the actor and the verl key to set.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _fail_actor_lookup(monkeypatch=None) -> None:
    """Ray's ``get_actor`` answering as for a name no live actor has (this process's, or with
    ``monkeypatch`` the test's only)."""
    import ray

    def get_actor(name, namespace=None):
        raise ValueError(f"Failed to look up actor with name '{name}'. This could because "
                         f"1. You are trying to look up a named actor you didn't create. 2. The "
                         f"named actor died.")
    if monkeypatch is not None:
        monkeypatch.setattr(ray, "get_actor", get_actor)
    else:
        ray.get_actor = get_actor


def rank_steps(rank: int, world: int, cfg: dict, fail: str):
    """One or two of verl's naive syncs (resume weights, update_weights); ``fail``: ``"lookup"``
    (rank 0 finds no server actor at the first) or ``"resume"`` (the first goes through, rank 0's
    resume of the server's memory fails at the second). Returns per sync the error text or None."""
    import verl_ranks

    if fail == "lookup":
        _fail_actor_lookup()
    adapter, _ = verl_ranks._adapter(rank, world, cfg)
    out = []
    for step in (1, 2) if fail == "resume" else (1,):
        if step == 2 and rank == 0:
            def refused(**kw):
                raise ConnectionError("http://127.0.0.1:1/resume_memory_occupation: Connection refused")
            adapter._engine.resume_memory_occupation = refused

        async def one():
            await adapter.resume(tags=["weights"])
            await adapter.update_weights(verl_ranks._tiny_stream(step), global_steps=step)

        t0 = time.monotonic()
        try:
            asyncio.run(one())
            out.append(None)
        except Exception as exc:  # noqa: BLE001 - returned to the test
            out.append((f"{type(exc).__name__}: {exc}", time.monotonic() - t0))
    return out


def _config(extra=()):
    from test_verl_adapter_checks import rollout_config

    return rollout_config(["actor_rollout_ref.rollout.free_cache_engine=true",
                           "+actor_rollout_ref.rollout.custom.fsdp_sync.dist_timeout_s=20", *extra])


def rank_both(rank: int, world: int, lookup_cfg: dict, resume_cfg: dict):
    """`rank_steps` for both failures, one after the other, in one launch of the ranks."""
    return rank_steps(rank, world, lookup_cfg, "lookup"), rank_steps(rank, world, resume_cfg, "resume")


def test_rank0_failing_to_reach_its_server_fails_both_ranks_with_its_error():
    """No server actor at the first sync; the server's memory not resumed at a later one."""
    from fsdp_sync.cli.launch import run_ranks
    from fsdp_sync.engines.reference import ReferenceEngine
    from fsdp_sync.engines.reference.serve import EngineServer

    with ReferenceEngine("tiny", tp_size=2, seed=5) as engine, EngineServer(engine) as server:
        resume_cfg = _config([f"+actor_rollout_ref.rollout.custom.fsdp_sync.base_url={server.url}"])
        ((l0,), (first0, r0)), ((l1,), (first1, r1)) = run_ranks(
            rank_both, 2, _config(), resume_cfg, pg_timeout_s=40, timeout_s=240)
        version = engine.weight_version
    # no server actor: the same error on both ranks, rank 0's
    assert l0[0] == l1[0], (l0, l1)
    assert l0[0].startswith("SyncError: "), l0
    assert ("fsdp_sync's verl adapter on infer-TP rank 0 (global rank 0): verl's SGLang server of "
            "rollout replica 0 (Ray actor sglang_server_0_0) cannot be reached: ValueError: Failed "
            "to look up actor with name 'sglang_server_0_0'") in l0[0], l0
    assert "+actor_rollout_ref.rollout.custom.fsdp_sync.base_url" in l0[0], l0
    # the server's weights not resumed at the second sync: the same, and nothing reached it
    assert first0 is None and first1 is None
    assert version == "1"
    assert r0[0] == r1[0], (r0, r1)
    assert r0[0].startswith("SyncError: "), r0
    assert ("resume_memory_occupation(tags=['weights']) of verl's SGLang server failed: "
            "ConnectionError: http://127.0.0.1:1/resume_memory_occupation: Connection refused") in r0[0], r0
