"""A sync that fails half-way says when the engine kept part of it.

An engine that applies each call as it arrives (a non-transactional reference engine; one without
``begin_weight_update``/``end_weight_update``, as SGLang before 0.5.21; SGLang itself, which
ignores an abort) cannot drop the buckets it took before the failure. The sync's error said only
which call failed, and the engine served 26 old tensors and 1 new one. Now the error carries a
note naming the engine and saying it holds partly new weights (both methods that send calls:
tensor and distributed), and a warning is logged; a
transactional engine drops the update, keeps its old weights, and no such note is made.
"""

from __future__ import annotations

import logging

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env


class _Flaky:
    """Forwards to the engine; its second weight-loading call raises (after the first went
    through), as an engine's out-of-memory half-way would."""

    def __init__(self, engine, hide_bracket: bool) -> None:
        object.__setattr__(self, "_e", engine)
        object.__setattr__(self, "_n", 0)
        object.__setattr__(self, "_hide", hide_bracket)

    def __getattr__(self, name):
        if self._hide and name in ("begin_weight_update", "end_weight_update"):
            raise AttributeError(name)
        value = getattr(self._e, name)
        if name not in ("update_weights_from_tensor", "load_rank_bucket", "update_weights_from_distributed"):
            return value

        def call(*a, **kw):
            object.__setattr__(self, "_n", self._n + 1)
            if self._n == 2:
                raise RuntimeError("simulated engine failure on call 2")
            return value(*a, **kw)
        return call


def _job(rank, world, method, variant):
    from fsdp_sync import FSDPShardingManager, SyncConfig, make_mesh
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncError

    torch.set_num_threads(1)
    records: list = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logging.getLogger("fsdp_sync").addHandler(handler)
    cfg = load_config("tiny")
    model = build_model(cfg, seed=0)
    out: dict = {}
    with ReferenceEngine(model_config=cfg, tp_size=1, dtype=torch.float32,
                         transactional_updates=variant != "notxn") as engine:
        mesh = make_mesh(1, 1) if method == "tensor" else None
        conf = SyncConfig(method=method, bucket_bytes=32 << 10, dtype=torch.float32, free_cache_engine=False)
        first = FSDPShardingManager(model, engine, mesh=mesh, config=conf)
        with first:
            pass
        first.close()
        old = {n: t.clone() for n, t in engine.named_full_tensors()}
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        manager = FSDPShardingManager(model, _Flaky(engine, variant == "nobracket"), mesh=mesh, config=conf)
        try:
            with manager:
                pass
        except SyncError as exc:
            out["notes"] = list(getattr(exc, "__notes__", []))
        manager.close()
        out["new"] = sum(not torch.equal(t, old[n]) for n, t in engine.named_full_tensors())
    out["logged"] = [r.getMessage() for r in records]
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method,variant", [("tensor", "notxn"), ("tensor", "nobracket"),
                                            ("tensor", "txn"), ("distributed", "notxn"),
                                            ("distributed", "txn")])
def test_an_engine_that_kept_part_of_a_failed_sync_is_named(method, variant):
    (out,) = run_ranks(_job, 1, method, variant, timeout_s=110, env=spawn_env())
    said = [m for m in out["logged"] if "could not drop" in m]
    if variant == "txn":
        assert out["new"] == 0 and not said, out
        assert not any("partly new" in n for n in out.get("notes", [])), out
        return
    assert out["new"] > 0, out                       # it did keep part of the failed sync
    assert said and "partly new weights" in said[0] and "sync again" in said[0], out
    assert any("could not drop" in n and "replica 0" in n for n in out["notes"]), out
