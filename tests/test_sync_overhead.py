"""A steady-state sync's host overhead (issue 35), counted on 2 gloo ranks with a real engine: the
collectives the manager runs per sync (agreement included), and the memory probes' reads of
``/proc/<pid>/smaps_rollup`` (only when ``memory_probe="full"`` asks for USS and PSS).

Counts, not timings: every ``torch.distributed`` collective a sync calls is wrapped and counted
(on every rank); the engine's weights must equal the trainer's after each sync, so the counted
sync is a real one. The failure half of agreement (a stage that fails on one rank raises the same
error on every rank) is kept by the fault tests (`test_faults.py`, `test_manager.py`).
"""

from __future__ import annotations

import collections
import sys

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "all_gather_single",
               "broadcast", "broadcast_object_list", "barrier", "all_to_all_single", "gather_object",
               "scatter_object_list", "reduce", "gather", "send", "recv", "isend", "irecv")


def _counting():
    """Wrap every collective of torch.distributed (module attributes, as the library calls them)."""
    import torch.distributed as dist

    counts: collections.Counter = collections.Counter()
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def wrapped(*a, _fn=fn, _name=name, **kw):
            # a one-word all-reduce: `topology.agree_after_each`'s "still working" round, one per
            # second the engine's end_weight_update runs (at least one): counted apart
            poll = _name == "all_reduce" and sys._getframe(1).f_code.co_name == "still_working"
            counts["all_reduce_poll" if poll else _name] += 1
            return _fn(*a, **kw)
        setattr(dist, name, wrapped)
    return counts


def _syncs(rank, world, configs):
    """Three syncs per (layout, memory_probe) of ``configs``, in one job (the ranks start and
    the model is built once); a manager and an engine per config."""
    import builtins

    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncTopology, make_mesh
    from fsdp_sync.cli.trainer import synthetic_batch, train_step, wrap_fsdp

    torch.set_num_threads(1)
    cfg = load_config("tiny")
    module = wrap_fsdp(build_model(cfg, seed=0), 2)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    mesh = make_mesh(world, 1)
    topo = SyncTopology.from_mesh(mesh)
    counts = _counting()
    rollups = [0]
    real_open = builtins.open

    def open_counting(path, *a, **k):
        if str(path).endswith("smaps_rollup"):
            rollups[0] += 1
        return real_open(path, *a, **k)
    results = {}
    for layout, probe in configs:
        engine = ReferenceEngine(model_config=cfg, tp_size=1, dtype=torch.float32) if topo.is_tp_src else None
        kw = {} if probe is None else {"memory_probe": probe}
        conf = SyncConfig(dtype=torch.float32, bucket_bytes=64 << 10, layout=layout, **kw)
        manager = FSDPShardingManager(module, engine, mesh=mesh, config=conf)
        out = results[(layout, probe)] = []
        try:
            for step in range(3):
                train_step(module, opt, synthetic_batch(cfg.vocab_size, step=step, rank=rank))
                full = {n: t.full_tensor() if hasattr(t, "full_tensor") else t
                        for n, t in module.state_dict().items()}
                counts.clear()
                rollups[0] = 0
                builtins.open = open_counting
                rec = {}
                try:
                    with manager:
                        builtins.open = real_open        # the engine's read-back is not the sync's
                        if engine is not None:
                            names = engine.hf_names()
                            rec["compared"] = len(names)
                            rec["equal"] = all(torch.equal(engine.get_weights_by_name(n).float(),
                                                           full[n].float()) for n in names)
                        builtins.open = open_counting
                finally:
                    builtins.open = real_open
                rec.update(collectives=dict(counts), rollups=rollups[0], buckets=manager.stats.buckets,
                           memory_keys=sorted(manager.timeline.stages[0].memory.get("trainer", {})))
                out.append(rec)
        finally:
            manager.close()
            if engine is not None:
                engine.shutdown()
    return results


@pytest.fixture(scope="module")
def runs(leftovers_check):
    with leftovers_check():
        out = {}
        for world, configs in ((2, [("full", None), ("engine", None), ("engine", "full")]),
                               (1, [("engine", None)])):
            ranks = run_ranks(_syncs, world, configs, timeout_s=300, env=spawn_env())
            out.update({(world, *c): [r[c] for r in ranks] for c in configs})
        return out


def _steady(runs, key):
    """The last of three syncs on every rank (the first ones make buffers and plans); the engine
    held the trainer's weights after each."""
    for rank_out in runs[key]:
        assert all(r["equal"] and r["compared"] == 27 for r in rank_out if "equal" in r), rank_out
    return [rank_out[-1] for rank_out in runs[key]]


@pytest.mark.timeout(400)
def test_agreement_collectives_per_steady_sync(runs):
    """The stages with no collective of their own (prepare, offload_params, resume_kv_cache) are
    agreed with the next stage (6 stage all-reduces became 3), and a one-rank trainer runs no
    agreement collective at all. Per-bucket agreement stays: the next bucket's buffers are
    rewritten only after every rank has heard the engine took this one."""
    # + 1 - 1: the host-shared buffers' open is agreed by an all-reduce where a barrier was
    # (a7a6770: a rank that could not open them left its peers in the barrier); + 8 - 8: so is
    # each bucket's write into them (5333e74: a rank whose write raised left its peers there);
    # engine (pipelined): + 1, the first call's stand-in agree (`transport.unmade`). And the
    # engine's end_weight_update is waited for by every rank (`topology.agree_after_each`), so a
    # commit longer than the group's timeout does not fail the sync: one one-word all-reduce a
    # second it runs (one where it takes under a second: counted apart, as it depends on timing)
    for layout, before, barriers, first in (("full", 19, 17, 0), ("engine", 21, 9, 1)):
        for rec in _steady(runs, (2, layout, None)):
            assert rec["buckets"] == 8, rec
            n = rec["collectives"]
            assert (n.get("all_reduce") == before - 3 + 1 + 8 + first and n.get("all_reduce_poll", 0) >= 1
                    and n.get("barrier", 0) == barriers - 1 - 8), (layout, rec)
            # the handle gather to the engine rank and the scatter of its answers: per sync here
            # (one engine call per bucket, gathered over a TP group of one: no collective)
            assert rec["collectives"].get("all_gather_object", 0) <= 1, (layout, rec)
    (one,) = _steady(runs, (1, "engine", None))
    assert one["collectives"].get("all_reduce", 0) == 0, one


@pytest.mark.timeout(400)
def test_memory_probe_reads_smaps_rollup_only_when_asked(runs):
    """Default (``memory_probe="rss"``): no stage reads /proc/<pid>/smaps_rollup (about 9 ms a
    read under cProfile on the H100 host, 44 ms on this project's 2-core CI host against 84 µs
    for /proc/<pid>/status); ``"full"`` still records USS and PSS, for the trainer and the
    engine's worker after each of the 9 stages."""
    for rec in _steady(runs, (2, "engine", None)):
        assert rec["rollups"] == 0, rec
        assert {"rss", "rss_peak"} <= set(rec["memory_keys"]) and "uss" not in rec["memory_keys"], rec
    for rec in _steady(runs, (2, "engine", "full")):
        assert rec["rollups"] == 9 * 2, rec
        assert {"rss", "uss", "pss"} <= set(rec["memory_keys"]), rec


def _deferred_failures(rank, world):
    """A stage agreed with the next one fails on rank 1 only: both ranks raise the same error
    naming that stage and rank 1; rank 1 ran no later stage before the agreement, rank 0 did;
    the next sync, with no fault, goes through on both."""
    import os

    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.faultpoint import FAULT_ENV
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncError, SyncTopology, make_mesh
    from fsdp_sync.cli.trainer import wrap_fsdp

    torch.set_num_threads(1)
    cfg = load_config("tiny")
    module = wrap_fsdp(build_model(cfg, seed=0), 2)
    mesh = make_mesh(world, 1)
    engine = ReferenceEngine(model_config=cfg, tp_size=1, dtype=torch.float32) \
        if SyncTopology.from_mesh(mesh).is_tp_src else None
    manager = FSDPShardingManager(module, engine, mesh=mesh,
                                  config=SyncConfig(dtype=torch.float32, bucket_bytes=64 << 10))
    ran: list = []
    for name in ("_resume", "_sync_weights", "_swap_rng", "_offload_params"):
        fn = getattr(manager, name)
        setattr(manager, name, lambda *a, _fn=fn, _n=name: (ran.append(_n), _fn(*a))[1])
    out = {}
    try:
        for stage in ("prepare", "offload_params", "resume_kv_cache"):
            os.environ[FAULT_ENV] = f"trainer:1:{stage}:raise"
            ran.clear()
            try:
                with manager:
                    pass
                out[stage] = {"raised": None}
            except SyncError as exc:
                out[stage] = {"raised": str(exc), "failures": sorted(exc.failures)}
            out[stage]["ran"] = list(ran)
        os.environ.pop(FAULT_ENV)
        with manager:
            full = {n: t.full_tensor() for n, t in module.state_dict().items()}
            if engine is not None:
                out["equal"] = all(torch.equal(engine.get_weights_by_name(n), full[n]) for n in engine.hf_names())
    finally:
        manager.close()
        if engine is not None:
            engine.shutdown()
    return out


@pytest.mark.timeout(300)
def test_a_stage_agreed_with_the_next_still_fails_every_rank(leftovers_check):
    with leftovers_check():
        r0, r1 = run_ranks(_deferred_failures, 2, timeout_s=200, env=spawn_env())
    for stage in ("prepare", "offload_params", "resume_kv_cache"):
        for r in (r0, r1):
            assert r[stage]["raised"] is not None and r[stage]["raised"].startswith(
                f"stage {stage!r} failed on rank 1: InjectedFault"), (stage, r[stage])
            assert r[stage]["failures"] == [1], r[stage]
        assert r0[stage]["raised"] == r1[stage]["raised"]
    # prepare failed on rank 1: it resumed nothing; rank 0 resumed the weights, then both stopped
    assert r1["prepare"]["ran"] == [] and r0["prepare"]["ran"] == ["_resume"]
    # offload_params failed on rank 1 (the fault fires before the stage's work): it skipped
    # resume_kv_cache and swap_rng, rank 0 ran both
    every = ["_resume", "_sync_weights", "_offload_params", "_resume", "_swap_rng"]
    assert r1["offload_params"]["ran"] == every[:2] and r0["offload_params"]["ran"] == every
    assert r1["resume_kv_cache"]["ran"] == every[:3] and r0["resume_kv_cache"]["ran"] == every
    assert r0["equal"] and r1["equal"]
