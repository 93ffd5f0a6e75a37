"""A sync that fails half-way says when the engine kept part of it.

An engine that applies each call as it arrives (a non-transactional reference engine; one without
``begin_weight_update``/``end_weight_update``, as SGLang before 0.5.21; SGLang itself, which
ignores an abort) cannot drop the buckets it took before the failure. The sync's error said only
which call failed, and the engine served 26 old tensors and 1 new one. Now the error carries a
note naming the engine and saying it holds partly new weights (both methods that send calls:
tensor and distributed), and a warning is logged; a
transactional engine drops the update, keeps its old weights, and no such note is made.

A transactional engine that still holds its random start-up weights has nothing worth a copy, so
its transaction writes each call in place: a failed one cannot be dropped. It used to go on
serving the mix with ``weights_valid`` True while ``end_weight_update`` said "nothing was
committed ... keeps its previous weights" and ``end_weight_update(abort=True)`` returned True
(dropped). Now those weights are not served until every tensor is pushed again (as after a
release without a backup), the error says they were partly overwritten, an abort returns False,
and a sync that failed so carries the "could not drop" note.
"""

from __future__ import annotations

import logging

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env
from fsdp_sync.engines import EngineUnavailableError, ReferenceEngine, WeightUpdateError
from fsdp_sync.models import build_model, load_config


class FlakyEngine:
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
        if variant != "fresh":      # fresh: the failed sync is the engine's first
            first = FSDPShardingManager(model, engine, mesh=mesh, config=conf)
            with first:
                pass
            first.close()
        old = {n: t.clone() for n, t in engine.named_full_tensors()}
        shards = engine.shard_checksums()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        manager = FSDPShardingManager(model, FlakyEngine(engine, variant == "nobracket"), mesh=mesh, config=conf)
        try:
            with manager:
                pass
        except SyncError as exc:
            out["notes"] = list(getattr(exc, "__notes__", []))
        manager.close()
        out["valid"] = [w["weights_valid"] for w in engine.memory_stats()["workers"]]
        out["new"] = (sum(not torch.equal(t, old[n]) for n, t in engine.named_full_tensors())
                      if out["valid"] == [True] else int(engine.shard_checksums() != shards))
        out["valid"] = [w["weights_valid"] for w in engine.memory_stats()["workers"]]
        engine.resume_memory_occupation()
        try:
            engine.generate([[1, 2, 3]], max_new_tokens=2)
            out["served"] = True
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out["served"] = f"{type(exc).__name__}: {exc}"
    out["logged"] = [r.getMessage() for r in records]
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method,variant", [("tensor", "notxn"), ("tensor", "nobracket"),
                                            ("tensor", "txn"), ("distributed", "notxn"),
                                            ("distributed", "txn"), ("tensor", "fresh")])
def test_an_engine_that_kept_part_of_a_failed_sync_is_named(method, variant):
    (out,) = run_ranks(_job, 1, method, variant, timeout_s=110, env=spawn_env())
    said = [m for m in out["logged"] if "could not drop" in m]
    if variant == "txn":
        assert out["new"] == 0 and not said, out
        assert not any("partly new" in n for n in out.get("notes", [])), out
        assert out["valid"] == [True] and out["served"] is True, out
        return
    if variant == "fresh":      # the start-up weights, partly overwritten: not served
        assert out["valid"] == [False], out
        assert "partly overwritten" in out["served"] and "pushed again" in out["served"], out
    assert out["new"] > 0, out                       # it did keep part of the failed sync
    assert said and "partly new weights" in said[0] and "sync again" in said[0], out
    assert any("could not drop" in n and "replica 0" in n for n in out["notes"]), out


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def fresh(request):
    """Starts engines holding their random start-up weights (a test's own: it changes them)."""
    engines = []

    def make():
        e = ReferenceEngine(model_config=load_config("tiny"), tp_size=request.param, kv_cache_tokens=64)
        engines.append(e)
        return e
    yield make
    for e in engines:
        e.shutdown()


def _valid(engine):
    return [w["weights_valid"] for w in engine.memory_stats()["workers"]]


@pytest.mark.timeout(120)
def test_a_failed_transaction_over_the_start_up_weights_is_not_served(fresh):
    trained = list(build_model(load_config("tiny"), seed=1).state_dict().items())
    engine = fresh()
    start = engine.shard_checksums()
    # a failure in the first call: nothing was written, the start-up weights stay and serve
    engine.begin_weight_update()
    with pytest.raises(WeightUpdateError, match="unknown parameter"):
        engine.update_weights_from_tensor([("model.bogus.weight", torch.zeros(1))])
    with pytest.raises(WeightUpdateError, match="keeps its previous weights"):
        engine.end_weight_update()
    assert engine.shard_checksums() == start and _valid(engine) == [True] * engine.tp_size
    engine.begin_weight_update()
    assert engine.end_weight_update(abort=True) is True      # nothing was written
    # the second call fails after the first was written in place
    engine.begin_weight_update()
    engine.update_weights_from_tensor(trained[:10])
    with pytest.raises(WeightUpdateError, match="unknown parameter"):
        engine.update_weights_from_tensor(trained[10:] + [("model.bogus.weight", torch.zeros(1))])
    with pytest.raises(WeightUpdateError, match="start-up weights were partly overwritten: every tensor must "
                                                "be pushed again; the engine serves nothing until then"):
        engine.end_weight_update(weight_version="step-1")
    assert engine.shard_checksums() != start                 # it says so because it is so
    assert _valid(engine) == [False] * engine.tp_size and engine.get_weight_version() == "default"
    with pytest.raises(EngineUnavailableError, match="partly overwritten .* 27 of 27 tensors missing"):
        engine.generate([[1, 2, 3]], max_new_tokens=2)
    with pytest.raises(EngineUnavailableError, match="pushed again"):
        engine.forward_logits([[1, 2, 3]])
    # a part pushed again is not enough; all of it is
    engine.update_weights_from_tensor(trained[:10])
    assert _valid(engine) == [False] * engine.tp_size
    engine.update_weights_from_tensor(trained[10:])
    assert _valid(engine) == [True] * engine.tp_size
    assert len(engine.generate([[1, 2, 3]], max_new_tokens=2)[0]) == 2


@pytest.mark.timeout(120)
def test_an_abort_over_the_start_up_weights_says_they_changed(fresh):
    trained = list(build_model(load_config("tiny"), seed=1).state_dict().items())
    engine = fresh()
    start = engine.shard_checksums()
    engine.begin_weight_update()
    engine.update_weights_from_tensor(trained[:5])
    assert engine.end_weight_update(abort=True) is False     # not dropped: written in place
    assert engine.shard_checksums() != start and _valid(engine) == [False] * engine.tp_size
    # a transaction that pushes everything makes them valid again, and is staged from then on
    engine.begin_weight_update()
    engine.update_weights_from_tensor(trained)
    assert engine.end_weight_update() is True
    assert _valid(engine) == [True] * engine.tp_size
    served = engine.shard_checksums()
    engine.begin_weight_update()
    engine.update_weights_from_tensor(trained[:5])
    assert engine.end_weight_update(abort=True) is True      # loaded weights: copied aside, dropped
    assert engine.shard_checksums() == served


@pytest.mark.timeout(120)
def test_an_abort_after_a_release_without_backup_says_what_it_wrote_over(fresh):
    """Released without a backup, the weights resume as zeros and are pushed again in place: an
    aborted transaction that wrote over tensors pushed since says so (False); one that wrote only
    tensors still missing changed nothing the engine counts (True)."""
    trained = list(build_model(load_config("tiny"), seed=1).state_dict().items())
    engine = fresh()
    engine.update_weights_from_tensor(trained)
    engine.release_memory_occupation(["weights"])
    engine.resume_memory_occupation(["weights"])
    engine.update_weights_from_tensor(trained[:5])          # pushed again, outside a transaction
    engine.begin_weight_update()
    engine.update_weights_from_tensor(trained[5:10])        # still missing: nothing is lost
    assert engine.end_weight_update(abort=True) is True
    engine.begin_weight_update()
    engine.update_weights_from_tensor(trained[3:8])         # over two pushed since the release
    with pytest.raises(WeightUpdateError, match="unknown parameter"):
        engine.update_weights_from_tensor([("model.bogus.weight", torch.zeros(1))])
    with pytest.raises(WeightUpdateError, match=r"2 tensors pushed since the weights were released .* were "
                                                r"written over: they must be pushed again"):
        engine.end_weight_update()
    engine.begin_weight_update()
    engine.update_weights_from_tensor(trained[2:4])         # over one still counted (2), one not (3)
    assert engine.end_weight_update(abort=True) is False
    with pytest.raises(EngineUnavailableError, match="released without a CPU backup .* 25 of 27 tensors missing"):
        engine.generate([[1, 2, 3]], max_new_tokens=2)
    engine.update_weights_from_tensor(trained[2:])
    assert _valid(engine) == [True] * engine.tp_size
