"""A failed sync names the engines that could not drop what they took, also where the engine
cannot be asked to: one without ``end_weight_update`` (as SGLang before 0.5.21), or whose
``end_weight_update`` takes no ``abort`` (it can only close, keeping what it applied). The
error's note and the logged warning name it and say to sync again before generating; a plain
unit check of `fleet.end_all` says the same for each kind of engine.
"""

from __future__ import annotations

import logging

import pytest
import torch

from fsdp_sync import fleet
from fsdp_sync.cli.launch import run_ranks, spawn_env

from test_partial_update import FlakyEngine


class _NoAbort(FlakyEngine):
    """`FlakyEngine` (its second weight-loading call raises, after the first went through), whose
    ``end_weight_update`` takes no ``abort`` (or is absent: ``hide_end``)."""

    def __getattr__(self, name):
        value = super().__getattr__(name)
        if name == "end_weight_update":
            def end(weight_version=None):   # no abort parameter: closing keeps what it applied
                return value(weight_version=weight_version)
            return end
        return value


def _job(rank, world, method, hide_end):
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
    out: dict = {"notes": None}
    with ReferenceEngine(model_config=cfg, tp_size=1, dtype=torch.float32) as engine:
        mesh = make_mesh(1, 1) if method == "tensor" else None
        conf = SyncConfig(method=method, bucket_bytes=32 << 10, dtype=torch.float32, free_cache_engine=False)
        manager = FSDPShardingManager(model, _NoAbort(engine, hide_end), mesh=mesh, config=conf)
        try:
            with manager:
                pass
        except SyncError as exc:
            out["notes"] = list(getattr(exc, "__notes__", []))
        manager.close()
    out["logged"] = [r.getMessage() for r in records]
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method,hide_end", [("tensor", False), ("distributed", False), ("distributed", True)],
                         ids=["tensor-noabort", "distributed-noabort", "distributed-noend"])
def test_a_failed_sync_names_an_engine_that_cannot_abort(method, hide_end):
    (out,) = run_ranks(_job, 1, method, hide_end, timeout_s=110, env=spawn_env())
    assert out["notes"] is not None, out            # the sync failed
    note = [n for n in out["notes"] if "could not drop" in n]
    assert note and "replica 0" in note[0] and "partly new weights" in note[0] and "sync again" in note[0], out
    said = [m for m in out["logged"] if "could not drop" in m]
    assert said and "replica 0" in said[0], out


class _Ended:
    def __init__(self):
        self.calls = []


class _NoEnd(_Ended):
    pass


class _EndNoAbort(_Ended):
    def end_weight_update(self, weight_version=None):
        self.calls.append(("end", weight_version))


class _EndAbort(_Ended):
    def __init__(self, dropped: bool):
        super().__init__()
        self.dropped = dropped

    def end_weight_update(self, weight_version=None, abort=False):
        self.calls.append(("end", abort))
        return self.dropped


def test_end_all_after_a_failure_names_every_engine_that_kept_part():
    engines = [_NoEnd(), _EndNoAbort(), _EndAbort(True), _EndAbort(False)]
    kept = fleet.end_all(engines, commit=False)
    assert kept == ["replica 0", "replica 1", "replica 3"], kept
    assert engines[1].calls == [("end", None)] and engines[2].calls == [("end", True)]
    with pytest.raises(RuntimeError) as info:
        try:
            raise RuntimeError("the sync failed")
        except RuntimeError:
            fleet.note_partial(kept)
            raise
    (note,) = info.value.__notes__
    assert note.startswith("replica 0, replica 1, replica 3 could not drop") and "sync again" in note, note
