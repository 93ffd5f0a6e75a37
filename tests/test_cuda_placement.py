"""Where the CUDA path puts things, checked on a CPU (torch.cuda faked, engines recorded).

- `FSDPShardingManager`'s parameter offload moves FSDP1's flat parameters by their handles, with
  ``_local_shard`` pointed at the moved data (FSDP1 points ``flat_param.data`` back at it after
  every unshard, so ``module.to`` alone kept the GPU shard); a dtype move stands in for the device
  move (both go through ``nn.Module._apply`` and ``flat_param_to``); FSDP2 was never affected;
- `fsdp-sync bench` puts a distributed engine after the trainer's GPUs;
- each bench rank builds its model on its own GPU;
- each colocated bench engine runs on its TP group's GPUs;
- `cli.args.check_gpus`: one GPU per trainer rank whatever the method, refused up front;
- `ReferenceEngine` refuses a ``base_gpu_id`` whose workers would run past the last GPU;
- the GPU tier's release/resume test reads the engine's own allocator, not the whole device.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from fsdp_sync.engines.base import EngineError


class _Stop(Exception):
    pass


def _record_engine(monkeypatch) -> dict:
    import fsdp_sync.engines as engines

    seen: dict = {}

    class Rec:
        def __init__(self, **kw):
            seen.update(kw)
            raise _Stop

    monkeypatch.setattr(engines, "ReferenceEngine", Rec)
    return seen


def _fake_gpus(monkeypatch, n: int) -> list:
    """``n`` CUDA devices as torch.cuda reports them; ``set_device`` recorded, not done."""
    calls: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(torch, "set_num_threads", lambda k: None)    # bench_rank's, not this process's
    return calls


# --------------------------------------------------------------------------- 1. FSDP1 offload

def _moves(rank, world):
    """Each wrapping's parameters moved as the manager's reload moves them (float64 standing in
    for the device), then where FSDP will find them at its next unshard."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from fsdp_sync.manager import FSDPShardingManager

    out = {}
    for kind in ("fsdp1-orig-params", "fsdp1-flat-params", "fsdp2"):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
        if kind == "fsdp2":
            fully_shard(m[0])
            fully_shard(m)
        else:
            m = FSDP(m, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=torch.device("cpu"),
                     use_orig_params=kind == "fsdp1-orig-params")
        m(torch.randn(2, 64)).sum().backward()          # lazy init: FSDP1 sets _local_shard here
        stub = types.SimpleNamespace(module=m, _offloaded={"w": torch.float64})
        FSDPShardingManager._reload_params(stub)
        facts = []
        if kind == "fsdp2":
            for group in [m[0]._get_fsdp_state()._fsdp_param_group, m._get_fsdp_state()._fsdp_param_group]:
                for fp in group.fsdp_params:
                    local = fp.sharded_param._local_tensor
                    facts.append((str(local.dtype), str(fp._sharded_param_data.dtype),
                                  fp._sharded_param_data.untyped_storage().data_ptr()
                                  == local.untyped_storage().data_ptr()))
        else:
            for unit in FSDP.fsdp_modules(m):
                if unit._handle is None:
                    continue
                flat = unit._handle.flat_param
                views = [p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
                         for p in unit.parameters() if p is not flat and p.numel()]
                facts.append((str(flat.dtype), str(flat._local_shard.dtype),
                              flat._local_shard.data_ptr() == flat.data_ptr(), all(views)))
        out[kind] = facts
    return out


@pytest.mark.timeout(120)
def test_reload_and_offload_move_fsdp1_local_shards_too():
    """Before: ``module.to`` moved ``flat_param.data`` but left ``_local_shard`` (what FSDP1 points
    the flat parameter back at after every unshard) on the old storage: offload_params freed none
    of a GPU shard, and the next forward ran on it. FSDP2 re-points its shards itself."""
    from fsdp_sync.cli.launch import run_ranks, spawn_env

    for got in run_ranks(_moves, 2, timeout_s=100, env=spawn_env()):
        for kind in ("fsdp1-orig-params", "fsdp1-flat-params"):
            assert got[kind] and all(f == ("torch.float64", "torch.float64", True, True)
                                     for f in got[kind]), (kind, got[kind])
        assert got["fsdp2"] and all(f == ("torch.float64", "torch.float64", True)
                                    for f in got["fsdp2"]), got["fsdp2"]


def test_offload_and_reload_both_move_through_move_params(monkeypatch):
    import fsdp_sync.manager as manager

    moved = []
    monkeypatch.setattr(manager, "move_params", lambda module, device: moved.append(device), raising=False)
    monkeypatch.setattr(manager, "empty_cache", lambda: None)
    gpu = torch.device("cuda", 0)
    module = types.SimpleNamespace(named_parameters=lambda: [("w", types.SimpleNamespace(device=gpu))],
                                   to=lambda d: moved.append(("module.to", d)))
    stub = types.SimpleNamespace(module=module, config=types.SimpleNamespace(offload_params=True),
                                 _offloaded={})
    manager.FSDPShardingManager._offload_params(stub)
    manager.FSDPShardingManager._reload_params(stub)
    assert moved == ["cpu", gpu], moved


# --------------------------------------------------------------------------- 2. bench: distributed engine

@pytest.mark.parametrize("method, want", [("distributed", 2), ("disk", 0)])
def test_bench_distributed_engine_sits_after_the_trainer_gpus(monkeypatch, method, want):
    """Before: no base_gpu_id, so the distributed engine's worker 0 sat on GPU 0 with trainer rank 0
    and `check_distinct_gpus` refused every distributed row on every machine."""
    from fsdp_sync.cli.bench.methods import method_rows

    seen = _record_engine(monkeypatch)
    job = types.SimpleNamespace(tp=1, ep=1, device="cuda", dtype="bfloat16", quantization=None,
                                engine_kw={"ep_size": 1})
    with pytest.raises(_Stop):
        method_rows(0, 2, job, None, None, 0, 0, method, [], 0)
    assert seen.get("base_gpu_id", 0) == want, seen


# --------------------------------------------------------------------------- 3. bench: each rank's GPU

def _bench_rank_until_engine(monkeypatch, rank: int, world: int, tp_ranks: list[int]) -> list:
    import fsdp_sync.cli.trainer as trainer
    import fsdp_sync.models as models
    import fsdp_sync.topology as topology
    import fsdp_sync.weights.export as export
    from fsdp_sync.cli.bench import main

    order = _fake_gpus(monkeypatch, world)

    def build(cfg, **kw):
        order.append(("build", kw.get("device")))
        return object()

    monkeypatch.setattr(models, "build_model", build)
    monkeypatch.setattr(models, "count_params", lambda m: (0, 0))
    monkeypatch.setattr(trainer, "wrap_fsdp", lambda m, v, device: m)
    monkeypatch.setattr(export, "param_metas", lambda m, d: [])
    monkeypatch.setattr(main, "copy_seconds", lambda *a: 0.0)
    monkeypatch.setattr(topology, "make_mesh", lambda *a: None)
    monkeypatch.setattr(topology.SyncTopology, "from_mesh",
                        staticmethod(lambda mesh: types.SimpleNamespace(is_tp_src=True, tp_ranks=tp_ranks)))
    job = types.SimpleNamespace(model="tiny", device="cuda", dtype="bfloat16", tp=len(tp_ranks),
                                methods=("tensor",), engine_kw={"ep_size": 1}, repeats=1)
    with pytest.raises(_Stop):
        main.bench_rank(rank, world, job)
    return order


def test_bench_rank_builds_its_cuda_model_on_its_own_gpu(monkeypatch):
    """Before: build_model(device="cuda") ran before wrap_fsdp's set_device, so every rank's full
    fp32 model (and CUDA context) landed on cuda:0 first."""
    _record_engine(monkeypatch)
    order = _bench_rank_until_engine(monkeypatch, 1, 2, [1])
    assert order[:2] == [("set_device", 1), ("build", "cuda")], order


# --------------------------------------------------------------------------- 4. bench: colocated engines

@pytest.mark.parametrize("rank, world, tp_ranks", [(1, 2, [1]), (2, 4, [2, 3])])
def test_bench_colocated_engine_sits_on_its_tp_groups_gpus(monkeypatch, rank, world, tp_ranks):
    """Before: no base_gpu_id, so every DP group's engine ran on GPUs 0..tp-1 (the demo's fix,
    113b8fe, base_gpu_id=topo.tp_ranks[0], had not reached the bench)."""
    seen = _record_engine(monkeypatch)
    _bench_rank_until_engine(monkeypatch, rank, world, tp_ranks)
    assert seen.get("base_gpu_id", 0) == tp_ranks[0] and seen["tp_size"] == len(tp_ranks), seen


# --------------------------------------------------------------------------- 5. ranks beyond the GPUs

def test_more_trainer_ranks_than_gpus_is_refused_for_every_method():
    """Before: only --method distributed was checked; tensor/disk with --ranks 2 on one GPU put both
    ranks on cuda:0 and NCCL refused the FSDP group (Duplicate GPU) after the model was built."""
    from fsdp_sync.cli.args import check_gpus

    for method in ("tensor", "disk", "distributed"):
        with pytest.raises(ValueError, match=r"--device cuda --ranks 2 needs 2 GPUs \(one per trainer "
                                             r"rank.*this machine has 1\. Use --ranks 1 or fewer"):
            check_gpus(method, "cuda", 2, 1, gpus=1)
        check_gpus(method, "cpu", 2, 1, gpus=0)
    check_gpus("tensor", "cuda", 1, 1, gpus=1)
    check_gpus("disk", "cuda", 2, 2, gpus=2)
    with pytest.raises(ValueError, match=r"--methods distributed --device cuda needs --ranks \+ --tp = 3 "
                                         r"GPUs.*has 2\. Use --methods tensor"):
        check_gpus("distributed", "cuda", 2, 1, gpus=2, method_flag="--methods")


# --------------------------------------------------------------------------- 6. base_gpu_id past the last GPU

def test_engine_refuses_workers_past_the_last_gpu(monkeypatch):
    """Before: worker i ran on (base_gpu_id + i) % device_count, so base_gpu_id=1, tp_size=2 on two
    GPUs put worker 1 on GPU 0, beside whatever was there; now refused before anything starts."""
    import fsdp_sync.engines.reference.engine as engine_mod
    from fsdp_sync.engines import ReferenceEngine

    _fake_gpus(monkeypatch, 2)

    def stop(*a, **kw):           # past the argument checks: start nothing
        raise _Stop

    monkeypatch.setattr(engine_mod, "load_config", stop)
    with pytest.raises(EngineError, match=r"base_gpu_id 1 \+ tp_size 2 needs GPUs 1\.\.2, one per TP "
                                          r"rank .*this process sees 2"):
        ReferenceEngine(model_config="tiny", tp_size=2, device="cuda", base_gpu_id=1)
    with pytest.raises(EngineError, match=r"base_gpu_id 0 \+ tp_size 3 .*sees 2"):
        ReferenceEngine(model_config="tiny", tp_size=3, device="cuda")
    for base, tp in ((0, 2), (1, 1)):
        with pytest.raises(_Stop):
            ReferenceEngine(model_config="tiny", tp_size=tp, device="cuda", base_gpu_id=base)


# --------------------------------------------------------------------------- 7. the GPU tier's memory test

def _figures(*, gave_back: bool) -> dict:
    """What `test_gpu._release_resume` returns (its old and new figures) when another xdist worker
    allocated 3 GiB on the same GPU between the reads of the device's free memory."""
    held, gib = 600 << 20, 1 << 30
    reserved = 900 << 20
    released = reserved - (held if gave_back else 0)
    return {"held": held, "allocated_drop": held, "generates": True,
            "reserved_before": reserved, "reserved_released": released, "reserved_resumed": reserved,
            "free_before": 40 * gib, "free_released": 40 * gib + (held if gave_back else 0) - 3 * gib,
            "free_resumed": 40 * gib - 3 * gib}


@pytest.mark.parametrize("gave_back", [True, False])
def test_gpu_release_test_reads_the_engines_allocator_not_the_device(monkeypatch, gave_back):
    """Before: it asserted on torch.cuda.mem_get_info (the whole device) while `make test-gpu`
    runs -n 8 on one GPU: another test's allocation meanwhile failed it. It still fails an engine
    that kept its memory."""
    import fsdp_sync.cli.launch as launch
    import test_gpu

    monkeypatch.setattr(launch, "run_ranks", lambda *a, **kw: [_figures(gave_back=gave_back)])
    monkeypatch.setattr(launch, "spawn_env", lambda *a, **kw: {})
    if gave_back:
        test_gpu.test_release_and_resume_really_move_gpu_memory()
    else:
        with pytest.raises(AssertionError):
            test_gpu.test_release_and_resume_really_move_gpu_memory()
