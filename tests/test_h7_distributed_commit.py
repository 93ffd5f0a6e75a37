"""``method="distributed"``: a commit that fails on trainer rank 0 is raised, not swallowed.

Mutation pass (H7): the `_agree` after the fleet's commit in `DistributedTransport.sync` dropped
survived every distributed test: the engine's ``end_weight_update`` refusing the commit then left
``sync`` returning as if the weights were served (a wrong result: the caller's step reports a sync
that did not happen). One trainer rank in a fresh process (torch's group names are per process).
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env

from _util import timed_sync


class _CommitRefused:
    """A real reference engine whose commit (``end_weight_update`` without abort) is refused."""

    def __init__(self, engine) -> None:
        self.engine, self.refused = engine, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def end_weight_update(self, *, abort: bool = False, **kw):
        if not abort:
            self.refused += 1
            self.engine.end_weight_update(abort=True)
            raise RuntimeError("commit refused (injected)")
        return self.engine.end_weight_update(abort=True, **kw)


def _commit_refused(rank, world):
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.engines.base import checksum_named_tensors
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.weights import export

    torch.set_num_threads(1)
    cfg = load_config("tiny")
    module = build_model(cfg, seed=3)
    with ReferenceEngine(model_config=cfg, tp_size=1, dtype=torch.float32, kv_cache_tokens=64,
                         update_recv_timeout_s=20.0, call_timeout_s=30.0) as real:
        before = real.weights_checksum()
        engine = _CommitRefused(real)
        manager = FSDPShardingManager(module, [engine], config=SyncConfig(
            method="distributed", dtype=torch.float32, dist_timeout_s=60))
        try:
            err, _ = timed_sync(manager)
        finally:
            manager.close()
        trainer = checksum_named_tensors(export.iter_params(module, dtype=torch.float32))
        return {"err": err, "refused": engine.refused, "changed": before != trainer}


@pytest.mark.timeout(120)
def test_a_refused_commit_raises_from_the_distributed_sync():
    (res,) = run_ranks(_commit_refused, 1, timeout_s=100, env=spawn_env())
    assert res["refused"] == 1 and res["changed"], res
    assert res["err"] is not None and "committing the update" in res["err"], res
    assert "commit refused (injected)" in res["err"], res
