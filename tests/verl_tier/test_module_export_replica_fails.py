"""One replica's sync failing with fsdp_sync's own export of verl's FSDP module (`module_stream`),
with another replica beside it: the module-export twin of test_h74_replica_fails_alone.py.

Two trainer ranks holding one FSDP2 model, rollout TP 1: two replicas, each its own server; verl
0.9.1's ``FSDPEngine.get_per_tensor_param`` (wrapped by `module_stream.install`) hands each rank a
`ModuleStream`, and fsdp_sync's bucketed export replaces verl's generator. Each bucket is one
all-gather over both ranks. Replica 0's engine refuses its second bucket. Before, replica 0's rank
closed the export and replica 1's rank waited in the next bucket's all-gather until the process
group's timeout, then failed with gloo's error (its sync lost too). Now the failed rank walks the
rest of the export: replica 1's server ends bit-exact, replica 0 raises its engine's error.
"""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.timeout(300)]

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def replica_rank_sync(rank: int, world: int, cfg: dict, urls: list):
    from types import SimpleNamespace

    import torch
    import verl_ranks
    from verl.workers.engine.fsdp import transformer_impl as impl

    from fsdp_sync.cli.trainer import wrap_fsdp
    from fsdp_sync.integrations import module_stream
    from fsdp_sync.models import build_model, load_config

    torch.set_num_threads(1)
    adapter = verl_ranks.replica_adapter(rank, world, cfg, urls)
    module_stream.install()
    hf = load_config("tiny")
    module = wrap_fsdp(build_model(hf, seed=0), world)
    # what FSDPEngine.get_per_tensor_param reads of its engine (test_verl_module_export.py)
    engine = SimpleNamespace(module=module, _uses_fsdp2_cpu_offload_policy=False,
                             _is_offload_param=False, _qat_enabled=False,
                             model_config=SimpleNamespace(lora={}, hf_config=SimpleNamespace(
                                 model_type=hf.model_type)))
    stream, _ = impl.FSDPEngine.get_per_tensor_param(engine, layered_summon=False, base_sync_done=True)
    assert isinstance(stream, module_stream.ModuleStream), type(stream)
    try:
        asyncio.run(adapter.update_weights(stream, global_steps=1))
        return None, adapter.last_stats["export"]
    except Exception as exc:  # noqa: BLE001 - returned to the test
        return f"{type(exc).__name__}: {exc}", None


def test_a_replica_whose_sync_fails_lets_the_other_replica_finish_with_fsdp_syncs_export():
    from fsdp_sync.cli.launch import run_ranks, spawn_env
    from fsdp_sync.engines.base import checksum_named_tensors
    from fsdp_sync.engines.reference import ReferenceEngine
    from fsdp_sync.engines.reference.serve import EngineServer
    from fsdp_sync.models import build_model, load_config
    from test_verl_adapter_checks import rollout_config

    cfg = rollout_config(["+actor_rollout_ref.rollout.custom.fsdp_sync.bucket_mb=0.1"])
    cfg["tensor_model_parallel_size"] = 1
    want = list(build_model(load_config("tiny"), seed=0).state_dict().items())
    with ReferenceEngine("tiny", tp_size=1, seed=5) as e0, EngineServer(e0) as s0, \
            ReferenceEngine("tiny", tp_size=1, seed=6) as e1, EngineServer(e1) as s1:
        (r0, _), (r1, export1) = run_ranks(replica_rank_sync, 2, cfg, [s0.url, s1.url], pg_timeout_s=60,
                                     timeout_s=240, env=spawn_env({"VERL_PLATFORM": "cpu"}))
        assert r1 is None, r1                                  # replica 1's sync went through
        assert export1 == "fsdp_sync", export1       # fsdp_sync's export, not verl's generator
        assert e1.weight_version == "1"
        assert e1.weights_checksum() == checksum_named_tensors(want)
        assert e0.weight_version != "1"          # replica 0's update: aborted, not committed
    assert r0 is not None and r0.startswith("SyncError: ") and \
        "replica 0's engine refused its second bucket" in r0, r0
