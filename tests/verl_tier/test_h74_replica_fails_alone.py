"""One replica's sync failing in verl's colocated mode, with another replica beside it (audit H74).

verl's colocated export is one ``full_tensor()`` per parameter, an all-gather over every trainer
rank, and each infer-TP group (replica) walks it with its own sync. Two trainer ranks, rollout TP 1:
two replicas, each its own server. Replica 0's engine refuses its second bucket. Before, replica
0's rank raised and stopped walking the export, and replica 1's rank waited in its next
all-gather for the process group's timeout, then failed with gloo's error (its sync lost too).
Now the failed rank walks the rest of the export (`stream.Walked`): replica 1 finishes its sync,
bit-exact on its server, and replica 0 raises its engine's error.
"""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.timeout(300)]

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def replica_rank_sync(rank: int, world: int, cfg: dict, urls: list):
    import verl_ranks

    adapter = verl_ranks.replica_adapter(rank, world, cfg, urls)
    try:
        asyncio.run(adapter.update_weights(verl_ranks._tiny_stream(1), global_steps=1))
        return None
    except Exception as exc:  # noqa: BLE001 - returned to the test
        return f"{type(exc).__name__}: {exc}"


def test_a_replica_whose_sync_fails_lets_the_other_replica_finish_its_own():
    from fsdp_sync.cli.launch import run_ranks
    from fsdp_sync.engines.base import checksum_named_tensors
    from fsdp_sync.engines.reference import ReferenceEngine
    from fsdp_sync.engines.reference.serve import EngineServer
    from fsdp_sync.models import build_model, load_config
    from test_verl_adapter_checks import rollout_config

    cfg = rollout_config(["+actor_rollout_ref.rollout.custom.fsdp_sync.bucket_mb=0.1"])
    cfg["tensor_model_parallel_size"] = 1
    want = [(n, (t * 1.125).contiguous())
            for n, t in build_model(load_config("tiny"), seed=0).state_dict().items()]
    with ReferenceEngine("tiny", tp_size=1, seed=5) as e0, EngineServer(e0) as s0, \
            ReferenceEngine("tiny", tp_size=1, seed=6) as e1, EngineServer(e1) as s1:
        r0, r1 = run_ranks(replica_rank_sync, 2, cfg, [s0.url, s1.url], pg_timeout_s=60,
                           timeout_s=240)
        assert r1 is None, r1                                  # replica 1's sync went through
        assert e1.weight_version == "1"
        assert e1.weights_checksum() == checksum_named_tensors(want)
        assert e0.weight_version != "1"          # replica 0's update: aborted, not committed
    assert r0 is not None and r0.startswith("SyncError: ") and \
        "replica 0's engine refused its second bucket" in r0, r0
