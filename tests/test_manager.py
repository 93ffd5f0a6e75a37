"""FSDPShardingManager end to end on CPU: real FSDP training ranks, a real reference engine.

Each launch runs several configurations on one set of ranks (a new manager each, the same engine),
so every strategy × multi-stage × FSDP version × layout is covered without paying a process start
for each; the 2-rank jobs (FSDP2 and FSDP1 steps, an exception inside the block, an engine failure
mid-sync) run one after another in one 2-rank launch, each with a module and engine of its own. After every step the engine's logits must equal the trainer's own forward (fp32,
≤ 1e-5) and must differ from the previous step's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from fsdp_sync.cli.launch import RankError, run_ranks, spawn_env

from _util import cli_here

PROMPTS = [[11, 27, 93, 5], [201, 3, 64, 64, 17, 88, 42, 9, 120], [7]]
ATOL = 1e-5
# The five 2-rank jobs (`two_rank_jobs`, below) once had a launch each (deadlines 170 + 170 + 110
# + 110 + 110 s); one launch pays two rank start-ups instead of ten, and the test that starts it
# waits for all five.
TWO_RANK_DEADLINE = 400
TWO_RANK_TIMEOUT = TWO_RANK_DEADLINE + 20


def _setup(rank, world, tp, fsdp, model="tiny"):
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncTopology, make_mesh
    from fsdp_sync.cli.trainer import wrap_fsdp

    torch.set_num_threads(1)
    cfg = load_config(model)
    module = wrap_fsdp(build_model(cfg, seed=0), fsdp)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    mesh = make_mesh(world // tp, tp)
    topo = SyncTopology.from_mesh(mesh)
    engine = ReferenceEngine(model_config=cfg, tp_size=tp, dtype=torch.float32) if topo.is_tp_src else None
    return cfg, module, opt, mesh, topo, engine


def _steps(rank, world, tp, fsdp, configs):
    """Train one step per config, sync with a fresh manager, compare logits; return per-step facts."""
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.cli.trainer import last_logits, synthetic_batch, train_step

    cfg, module, opt, mesh, topo, engine = _setup(rank, world, tp, fsdp)
    out = []
    prev = None
    try:
        for step, kw in enumerate(configs):
            train_step(module, opt, synthetic_batch(cfg.vocab_size, step=step, rank=rank))
            manager = FSDPShardingManager(module, engine, mesh=mesh,
                                          config=SyncConfig(dtype=torch.float32, bucket_bytes=64 << 10, **kw))
            with manager:
                assert not module.training
                mine = {"input_ids": torch.full((2, 3), rank), "tags": [f"r{rank}a", f"r{rank}b"]}
                batch = manager.preprocess_data(mine)
                group = [g for g in range(world) if g // tp == rank // tp]   # this rank's TP group
                assert batch["input_ids"][:, 0].tolist() == [g for g in group for _ in range(2)]
                assert batch["tags"] == [f"r{g}{x}" for g in group for x in "ab"]
                back = manager.postprocess_data(batch)
                assert torch.equal(back["input_ids"], mine["input_ids"]) and back["tags"] == mine["tags"]
                ref = last_logits(module, PROMPTS)
                gen = torch.rand(3)  # generation RNG: same on TP ranks, different per dp rank
                rec = {"config": kw, "rng": gen.tolist(), "engine_calls": manager.stats.engine_calls,
                       "bytes": manager.stats.bytes, "stage_names": None}
                if engine is not None:
                    got = engine.forward_logits(PROMPTS).float()
                    rec["diff"] = float((got - ref).abs().max())
                    rec["changed"] = prev is None or not torch.equal(prev, got)
                    prev = got
            assert module.training
            rec["stage_names"] = [s.name for s in manager.timeline.stages]
            if engine is not None:
                rec["weights_bytes_after_exit"] = _engine_weight_bytes(engine)
            out.append(rec)
    finally:
        if engine is not None:
            engine.shutdown()
    return out


def _engine_weight_bytes(engine) -> int:
    stats = engine.memory_stats()
    return sum(int(w.get("weights_bytes", 0)) for w in stats["workers"])


def _check(results, tp, n_configs):
    world = len(results)
    for rank, recs in enumerate(results):
        assert len(recs) == n_configs
        for rec in recs:
            if rank % tp == 0:
                assert rec["diff"] <= ATOL, (rank, rec)
                assert rec["changed"], (rank, rec)
                assert rec["weights_bytes_after_exit"] == 0, rec  # released on exit
            assert rec["bytes"] > 0
    # generation RNG: equal across the TP ranks of a group, different across dp groups
    for step in range(n_configs):
        groups = [[results[r][step]["rng"] for r in range(g, g + tp)] for g in range(0, world, tp)]
        for g in groups:
            assert all(x == g[0] for x in g)
        if len(groups) > 1:
            assert groups[0][0] != groups[1][0]


ALL_FSDP2 = [
    {"strategy": "flattened", "multi_stage_wake_up": True},
    {"strategy": "flattened", "share_host_memory": False},    # the all-gather path
    {"strategy": "bucketed", "multi_stage_wake_up": True},
    {"strategy": "per_tensor", "multi_stage_wake_up": True},
    {"strategy": "flattened", "multi_stage_wake_up": False, "layout": "full"},   # full tensors
    {"strategy": "per_tensor", "multi_stage_wake_up": False},
]


@pytest.mark.timeout(TWO_RANK_TIMEOUT)
def test_fsdp2_two_ranks_every_strategy_and_stage_mode(two_rank_jobs):
    results = [r["fsdp2"] for r in two_rank_jobs]
    _check(results, 2, len(ALL_FSDP2))
    names = results[0][0]["stage_names"]
    assert names.index("resume_weights") < names.index("sync_weights") < names.index("resume_kv_cache")
    assert names[-3:] == ["release_memory", "restore_module", "restore_rng"]
    off = results[0][4]["stage_names"]
    assert off.index("resume_all") < off.index("sync_weights") and "resume_kv_cache" not in off
    # per_tensor makes one engine call per tensor; flattened one per bucket
    assert results[0][3]["engine_calls"] > results[0][0]["engine_calls"]


FSDP1 = [
    {"strategy": "flattened", "fsdp1_state_dict": "full"},
    {"strategy": "bucketed", "fsdp1_state_dict": "sharded"},
    {"strategy": "per_tensor", "fsdp1_state_dict": "local"},
    {"strategy": "flattened", "fsdp1_state_dict": "local", "multi_stage_wake_up": False},
]


@pytest.mark.timeout(TWO_RANK_TIMEOUT)
def test_fsdp1_two_ranks_every_state_dict_type(two_rank_jobs):
    results = [r["fsdp1"] for r in two_rank_jobs]
    _check(results, 2, len(FSDP1))


@pytest.mark.timeout(240)
def test_four_ranks_dp2_tp2():
    configs = [{"strategy": "flattened"}, {"strategy": "per_tensor", "multi_stage_wake_up": False},
               {"strategy": "bucketed"}, {"strategy": "flattened", "share_host_memory": False, "layout": "full"}]
    results = run_ranks(_steps, 4, 2, 2, configs, timeout_s=230, env=spawn_env())
    _check(results, 2, len(configs))


def _exception_inside(rank, world):
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.manager import FSDPShardingManager

    cfg, module, opt, mesh, topo, engine = _setup(rank, world, 2, 2)
    try:
        manager = FSDPShardingManager(module, engine, mesh=mesh, config=SyncConfig(dtype=torch.float32))
        torch.manual_seed(123)
        before = torch.get_rng_state()
        module.train()
        raised = None
        try:
            with manager:
                inside_weights = _engine_weight_bytes(engine) if engine else None
                raise KeyError("boom in rollout")
        except KeyError as exc:
            raised = str(exc)
        # async rollouts: wake_up / sleep run the same stages (verl once shipped a wake_up that
        # never resumed memory)
        import asyncio

        after_weights = _engine_weight_bytes(engine) if engine else None
        training_after_exc = module.training
        rng_restored = torch.equal(before, torch.get_rng_state())
        asyncio.run(manager.wake_up())
        awake_weights = _engine_weight_bytes(engine) if engine else None
        awake_training = module.training
        asyncio.run(manager.sleep())
        return {"raised": raised, "training": training_after_exc, "awake_training": awake_training,
                "awake_weights": awake_weights, "rng_restored": rng_restored,
                "training_after_sleep": module.training,
                "inside_weights": inside_weights, "after_weights": after_weights}
    finally:
        if engine is not None:
            engine.shutdown()


@pytest.mark.timeout(TWO_RANK_TIMEOUT)
def test_exception_inside_block_releases_and_restores(two_rank_jobs):
    results = [r["exception"] for r in two_rank_jobs]
    for r in results:
        assert r["raised"] == "'boom in rollout'"
        assert r["training"] is True
        assert r["rng_restored"]
    assert results[0]["inside_weights"] > 0
    assert results[0]["after_weights"] == 0
    assert results[0]["awake_weights"] == results[0]["inside_weights"]
    assert all(r["awake_training"] is False and r["training_after_sleep"] is True for r in results)


class _FailingEngine:
    """Wraps a real engine; its n-th weight update raises (as a dead or refusing engine would)."""

    def __init__(self, engine, fail_at: int, kill: bool = False):
        self.engine, self.fail_at, self.kill, self.calls = engine, fail_at, kill, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls += 1
        if self.calls == self.fail_at:
            if self.kill:
                import os
                import signal

                os.kill(self.engine.worker_pids[1], signal.SIGKILL)
            else:
                raise RuntimeError("engine refused the update (injected)")
        return self.engine.update_weights_from_tensor(named_tensors, load_format=load_format,
                                                      flush_cache=flush_cache)


def _engine_failure(rank, world, kill):
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.topology import SyncError

    cfg, module, opt, mesh, topo, engine = _setup(rank, world, 2, 2)
    wrapped = _FailingEngine(engine, fail_at=3, kill=kill) if engine else None
    try:
        manager = FSDPShardingManager(module, wrapped, mesh=mesh,
                                      config=SyncConfig(strategy="per_tensor", dtype=torch.float32))
        t0 = time.monotonic()
        try:
            with manager:
                return {"error": None}
        except SyncError as exc:
            return {"error": str(exc), "seconds": time.monotonic() - t0, "training": module.training}
    finally:
        if engine is not None:
            engine.shutdown()


@pytest.mark.timeout(TWO_RANK_TIMEOUT)
@pytest.mark.parametrize("kill", [False, True], ids=["engine-error", "worker-killed"])
def test_engine_failure_mid_sync_raises_on_every_rank(two_rank_jobs, kill):
    results = [r["worker-killed" if kill else "engine-error"] for r in two_rank_jobs]
    msgs = [r["error"] for r in results]
    assert msgs[0] is not None and msgs[0] == msgs[1], msgs
    assert "failed on rank 0" in msgs[0]
    if not kill:
        assert "injected" in msgs[0]
    for r in results:
        assert r["seconds"] < 60, r
        assert r["training"] is True


def _two_rank_jobs(rank, world):
    """The 2-rank jobs, in order; the killed worker last, so no job after it meets what it leaves."""
    jobs = [("fsdp2", _steps, (2, 2, ALL_FSDP2)), ("fsdp1", _steps, (2, 1, FSDP1)),
            ("exception", _exception_inside, ()), ("engine-error", _engine_failure, (False,)),
            ("worker-killed", _engine_failure, (True,))]
    return {name: fn(rank, world, *args) for name, fn, args in jobs}


@pytest.fixture(scope="module")
def two_rank_jobs(leftovers_check):
    with leftovers_check():
        return run_ranks(_two_rank_jobs, 2, timeout_s=TWO_RANK_DEADLINE, env=spawn_env())


@pytest.mark.timeout(240)
def test_demo_end_to_end_json(tmp_path, capsys):
    out = tmp_path / "demo.json"
    proc = cli_here(capsys, "demo", "--ranks", "4", "--tp", "2", "--steps", "2", "--no-progress",
                    "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["config"]["ranks"] == 4 and data["config"]["tp"] == 2
    assert [s["step"] for s in data["steps"]] == [0, 1]
    for s in data["steps"]:
        assert isinstance(s["sync_seconds"], float) and s["sync_seconds"] > 0
        assert isinstance(s["bytes"], int) and s["bytes"] > 0
        assert s["max_abs_logit_diff"] <= 1e-5
        assert s["tokens_match"] is True
        names = [st["name"] for st in s["stages"]]
        assert "sync_weights" in names
        for st in s["stages"]:
            assert isinstance(st["seconds"], float) and isinstance(st["memory"], dict)
    assert "weight sync per training step" in proc.stdout


def test_config_validation_names_the_value():
    from fsdp_sync.config import SyncConfig

    with pytest.raises(ValueError, match="strategy must be one of .* got 'fast'"):
        SyncConfig(strategy="fast")
    with pytest.raises(ValueError, match="bucket_bytes must be a positive int, got 0"):
        SyncConfig(bucket_bytes=0)
    with pytest.raises(ValueError, match="unknown rollout dtype 'fp8'"):
        SyncConfig(dtype="fp8")
    cfg = SyncConfig.from_verl({"actor_rollout_ref": {
        "rollout": {"free_cache_engine": False, "multi_stage_wake_up": False, "dtype": "bfloat16",
                    "checkpoint_engine": {"update_weights_bucket_megabytes": 256}},
        "actor": {"fsdp_config": {"param_offload": True}}}})
    assert (cfg.free_cache_engine, cfg.multi_stage_wake_up, cfg.dtype, cfg.bucket_bytes, cfg.offload_params) == \
        (False, True, torch.bfloat16, 256 << 20, True)   # verl >= 0.9 ignores multi_stage_wake_up


def test_launcher_reports_the_failing_rank():
    with pytest.raises(RankError, match="rank 1 failed"):
        run_ranks(_fail_on_rank1, 2, timeout_s=60)


def _fail_on_rank1(rank, world):
    if rank == 1:
        raise ValueError("rank one is unhappy")
    import torch.distributed as dist

    dist.barrier()  # rank 0 waits here until the launcher tears the job down


def test_empty_cache_hands_freed_heap_back():
    """`memory.empty_cache` (called by the manager on entry and exit) returns glibc heap pages a
    process freed but glibc kept: 32 MiB of 64 KiB blocks freed below a live one (so the heap's
    top cannot shrink by itself) stay in RSS until it runs. In a fresh interpreter, so the test
    runner's own heap does not blur the figures."""
    code = (
        "import psutil\n"
        "from fsdp_sync.memory import empty_cache\n"
        "p = psutil.Process()\n"
        "r0 = p.memory_info().rss\n"
        "blocks = [bytearray(64 << 10) for _ in range(512)]\n"
        "keep = blocks[-1]\n"
        "del blocks\n"
        "r1 = p.memory_info().rss\n"
        "empty_cache()\n"
        "r2 = p.memory_info().rss\n"
        "print((r1 - r0) >> 20, (r1 - r2) >> 20)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=spawn_env(), check=True).stdout.split()
    kept, returned = int(out[0]), int(out[1])
    assert kept >= 24, f"freed blocks did not stay in RSS ({kept} MiB): the test proves nothing here"
    assert returned >= 24, f"empty_cache handed back only {returned} of {kept} MiB"
