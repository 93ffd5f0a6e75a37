"""What a user can do wrong with the sharding manager between and inside syncs, each refused or
handled so that the engine never serves a model other than the trainer's (one rank, TP 1, a real
reference engine):

- ``close()`` inside the ``with`` block is refused, and the block's exit still gives the engine's
  memory back (it raised AttributeError and left the weights and KV cache resident);
- a config value that changes the engine's math, edited on the trainer between syncs, is refused
  at the next sync (the check ran once, at the first sync, and the second synced silently into an
  engine whose logits then differed);
- a module that ties lm_head to embed_tokens by hand under a config that unties them is refused
  with what to do about it (the message said to start the engine from the trainer's config,
  which it already was).
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env


def _job(rank, world):
    from fsdp_sync import FSDPShardingManager, SyncConfig, make_mesh
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncError

    torch.set_num_threads(1)
    cfg = load_config("tiny")
    out: dict = {}
    with ReferenceEngine(model_config=cfg, tp_size=1, kv_cache_tokens=64, dtype=torch.float32) as engine:
        def held() -> list:
            return [(w["weights_bytes"], w["kv_cache_bytes"]) for w in engine.memory_stats()["workers"]]

        module = build_model(cfg, seed=0)
        manager = FSDPShardingManager(module, engine, mesh=make_mesh(1, 1), config=SyncConfig(dtype=torch.float32))
        try:
            with manager:
                out["inside"] = held()
                manager.close()
        except RuntimeError as exc:
            out["close_inside"] = str(exc)
        out["after_exit"] = held()
        with manager:                      # still open: it syncs again
            out["synced_again"] = torch.equal(engine.get_weights_by_name("model.norm.weight"),
                                              module.model.norm.weight.detach())
        # a math value edited between syncs
        eps = module.config.rms_norm_eps
        module.config.rms_norm_eps = eps * 10
        try:
            with manager:
                pass
            out["edited"] = None
        except SyncError as exc:
            out["edited"] = str(exc)
        module.config.rms_norm_eps = eps
        with manager:
            pass
        out["restored"] = True
        manager.close()
        # lm_head tied by hand under an untied config
        tied = build_model(cfg, seed=1)
        tied.lm_head.weight = tied.model.embed_tokens.weight
        by_hand = FSDPShardingManager(tied, engine, mesh=make_mesh(1, 1), config=SyncConfig(dtype=torch.float32))
        try:
            with by_hand:
                pass
            out["by_hand"] = None
        except SyncError as exc:
            out["by_hand"] = str(exc)
        by_hand.close()
    return out


@pytest.mark.timeout(180)
def test_misuse_between_and_inside_syncs_is_refused():
    (out,) = run_ranks(_job, 1, timeout_s=170, env=spawn_env())
    assert "close() inside the with block" in out["close_inside"], out
    assert all(w > 0 and kv > 0 for w, kv in out["inside"]), out["inside"]
    assert all(w == 0 and kv == 0 for w, kv in out["after_exit"]), out["after_exit"]
    assert out["synced_again"]
    assert out["edited"] is not None and "rms_norm_eps" in out["edited"], out["edited"]
    assert out["restored"]
    msg = out["by_hand"]
    assert msg is not None and "tied by hand" in msg and "lm_head.weight" in msg, msg
    assert "start the engine from the trainer's config" not in msg, msg
