"""``SyncConfig.pause_mode="in_place"`` against SGLang: no update flushes the cache.

With requests held in place SGLang refuses a flush ("In 'inplace' mode, flush_cache will fail if
there are any requests in the running_batch", ``PauseGenerationReqInput``): 0.5.23 answers an
update sent with ``flush_cache=True`` with success=False, "Weights were updated, but the cache was
not flushed ..." (``weight_updater.flush_cache_after_weight_update``), 0.5.12's scheduler asserts
and the server dies. The tensor method sent ``flush_cache=True`` with its last bucket and the disk
method left SGLang's default (True), so every such sync failed, claiming partly new weights though
all were loaded. An in-process ``sglang.Engine`` always flushes after a disk load: refused up front.

``pause_mode="retract"`` against SGLang before 0.5.21: the pause re-queues the running requests,
a flush then fails and the update's flush kills the server; refused before the pause.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import types

import pytest
import torch

import fake_sglang as fake
from fsdp_sync.cli.launch import run_ranks, spawn_env

REFUSED = ("Weights were updated, but the cache was not flushed because requests are still "
           "running or queued. Retract or finish them, then call /flush_cache.")


class InPlaceSGLang(fake.PausingFakeSGLangEngine):
    """SGLang 0.5.23 with requests running: ``pause_generation(mode="in_place")`` keeps them, and
    while they are held every flush is refused, an update's own flush failing the update (its
    weights loaded). In process: ``sglang.Engine.update_weights_from_disk`` always flushes."""

    def _flush_ok(self) -> bool:
        return self.paused != "in_place"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        ok, msg = super().update_weights_from_tensor(named_tensors, load_format, flush_cache)
        return (False, REFUSED) if ok and flush_cache and not self._flush_ok() else (ok, msg)

    def update_weights_from_disk(self, model_path, load_format=None):
        return self._disk(model_path, load_format, True)

    def _disk(self, model_path, load_format, flush_cache):
        ok, msg, paused = super().update_weights_from_disk(model_path, load_format)
        return (False, REFUSED, 0) if ok and flush_cache and not self._flush_ok() else (ok, msg, paused)

    def flush_cache(self):
        self._record("flush_cache")
        return types.SimpleNamespace(success=self._flush_ok(),
                                     message="Cache not flushed because there are pending requests.")


class InPlaceServer(InPlaceSGLang):
    """The same behind SGLang's HTTP routes: ``/update_weights_from_disk`` takes ``flush_cache``
    (``UpdateWeightFromDiskReqInput``; the fake server passes it to an engine that takes it)."""

    def update_weights_from_disk(self, model_path, load_format=None, flush_cache=True):
        return self._disk(model_path, load_format, flush_cache)


def _job(rank, world, cases):
    from fsdp_sync.cli.trainer import wrap_fsdp
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import sglang as sg
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import make_mesh
    from fsdp_sync.weights.export import iter_params

    torch.set_num_threads(1)
    module = wrap_fsdp(build_model(load_config("tiny"), seed=0), world)
    want = dict(iter_params(module, dtype=torch.float32))
    out = {}
    for method, where in cases:
        d = tempfile.mkdtemp()
        cfg = SyncConfig(dtype=torch.float32, bucket_bytes=64 << 10, method=method, memory_probe="off",
                         pause_mode="in_place", **({"disk_dir": d} if method == "disk" else {}))
        srv = fake.FakeSGLangServer(tp_size=1) if where == "http" else None
        eng = InPlaceServer(tp_size=1) if srv is not None else InPlaceSGLang(tp_size=1)
        if srv is not None:
            srv.engine = eng
            srv.__enter__()
        err, manager = None, None
        try:
            adapter = sg.SGLangEngine(srv.url, timeout_s=10) if srv else sg.SGLangEngine(eng)
            manager = FSDPShardingManager(module, adapter, mesh=make_mesh(1, world), config=cfg)
            with manager:
                pass
        except Exception as exc:  # noqa: BLE001 - the test reads it
            err = f"{type(exc).__name__}: {exc}"
        finally:
            if manager is not None:
                manager.close()
            if srv is not None:
                srv.close()
        # what SGLang was sent: the request bodies over HTTP, the call's arguments in process
        updates = ([b for _, p, b in srv.requests if p.startswith("/update_weights_from")] if srv
                   else [kw for c, kw in eng.calls if c.startswith("update_weights_from")])
        out[f"{method}-{where}"] = {
            "error": err, "version": None if err else manager.version,
            "calls": [c for c, _ in eng.calls if c != "get_server_info"],
            "flushes": [kw.get("flush_cache", "unsaid") for kw in updates],
            "loaded": bool(eng.weights) and all(torch.equal(eng.weights[n], t)
                                                for n, t in want.items() if n in eng.weights),
            "published": sorted(os.listdir(d))}
        shutil.rmtree(d)
    return out


@pytest.mark.timeout(150)
def test_in_place_pause_sends_no_flush_and_the_sync_succeeds():
    cases = [("tensor", "http"), ("disk", "http"), ("disk", "local")]
    (out,) = run_ranks(_job, 1, cases, timeout_s=140, env=spawn_env())
    for case in ("tensor-http", "disk-http"):
        got = out[case]
        assert got["error"] is None and got["version"] == "0", (case, got)
        assert got["flushes"] and True not in got["flushes"], (case, got)   # no flush_cache=True
        assert "flush_cache" not in got["calls"] and got["loaded"], (case, got)
        assert got["calls"][0] == "pause_generation" and "continue_generation" in got["calls"], got
    # the disk call reached SGLang's request with flush_cache=False (the server's route passes it)
    assert out["disk-http"]["flushes"] == [False], out["disk-http"]
    # an in-process sglang.Engine always flushes after a disk load: refused before anything is written
    local = out["disk-local"]
    assert local["error"] and "pause_mode='in_place' with method='disk'" in local["error"], local
    assert "takes no flush_cache" in local["error"], local
    assert local["published"] == [] and "update_weights_from_disk" not in local["calls"], local
    assert local["calls"][-1] == "continue_generation", local


class _BusyFlush:
    """A reference engine behind SGLang's flush rule with requests running and no pause: its own
    ``/flush_cache`` is refused (SGLang answers HTTP 400 "Cache not flushed ..." unless the
    scheduler is idle), while an update's ``flush_cache`` runs under SGLang's writer lock, which
    waits for the running requests, and succeeds. Records each update's ``flush_cache``."""

    def __init__(self, engine) -> None:
        self._e, self.flushes, self.flush_calls = engine, [], 0

    def __getattr__(self, name):
        return getattr(self._e, name)

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                        flush_cache=True, load_format=None):
        self.flushes.append(flush_cache)
        return self._e.update_weights_from_distributed(names, dtypes, shapes, group_name=group_name,
                                                       flush_cache=flush_cache, load_format=load_format)

    def flush_cache(self):
        from fsdp_sync.engines.base import EngineStateError

        self.flush_calls += 1
        raise EngineStateError("Cache not flushed because there are pending requests. #queue-req: 0, "
                               "#running-req: 2")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pause_mode", [None, "in_place"])
def test_distributed_flushes_with_its_last_update_not_after_the_commit(pause_mode):
    """Before: the distributed method committed every replica, then called flush_cache() on each,
    outside SGLang's writer lock: with requests running SGLang refused it, so the sync failed
    though every replica had committed (manager.version and fleet_status one behind what the
    replicas served, the radix cache still holding the old weights' KV). Now the last bucket's
    update_weights_from_distributed carries flush_cache=True (none under pause_mode="in_place")."""
    from fsdp_sync import FSDPShardingManager, SyncConfig
    from fsdp_sync.engines.reference import ReferenceEngine
    from fsdp_sync.models import build_model, load_config

    module = build_model(load_config("tiny"), seed=0)
    with ReferenceEngine("tiny", tp_size=1, kv_cache_tokens=64, call_timeout_s=30) as ref:
        eng = _BusyFlush(ref)
        cfg = SyncConfig(method="distributed", bucket_bytes=64 << 10, dist_timeout_s=30.0,
                         pause_mode=pause_mode)
        manager = FSDPShardingManager(module, [eng], config=cfg)
        try:
            with manager:
                pass
            assert manager.version == "0" and manager.fleet_status()["replicas"][0]["version"] == "0"
            assert eng.flush_calls == 0 and len(eng.flushes) > 1, eng.flushes
            assert eng.flushes == [False] * (len(eng.flushes) - 1) + [pause_mode is None], eng.flushes
        finally:
            manager.close()


class _Retract:
    """SGLang's ``pause_generation(mode="retract")`` with one request decoding: it moves to the
    scheduler's waiting queue (0.5.12 ``scheduler.py`` ``pause_generation``). Before 0.5.21 a flush
    needs that queue empty (``is_fully_idle``), and an update's failed flush is an ``assert`` in
    the scheduler: the server dies, every later call fails. 0.5.21 on ignore the queue while paused."""

    paused, waiting, dead = None, 0, None
    FLUSH_IGNORES_WAITING = False

    def pause_generation(self, mode="abort"):
        self._record("pause_generation", mode=mode)
        self.paused, self.waiting = mode, int(mode == "retract")

    def continue_generation(self):
        self._record("continue_generation")
        self.paused, self.waiting = None, 0

    def update_weights_from_disk(self, model_path, load_format=None, flush_cache=True):
        if self.dead:
            raise RuntimeError(self.dead)
        out = super().update_weights_from_disk(model_path, load_format)
        if flush_cache and self.waiting and not (self.paused and self.FLUSH_IGNORES_WAITING):
            self.dead = "AssertionError('Cache flush failed after updating weights'): the server quit"
            raise RuntimeError(self.dead)
        return out


class Retract0512(_Retract, fake.Fake0512Engine):
    pass


class Retract0520(_Retract, fake.OldFakeSGLangEngine):
    pass


class Retract0523(_Retract, fake.FakeSGLangEngine):
    FLUSH_IGNORES_WAITING = True


@pytest.mark.timeout(90)
@pytest.mark.parametrize("version", ["0.5.12", "0.5.20", "0.5.23"])
def test_retract_pause_refused_before_anything_where_the_flush_kills_sglang(version, tmp_path):
    """Before: ``pause_mode="retract"`` against SGLang 0.5.12 (and 0.5.20) paused the server, the
    sync's last update asked for a flush, which failed on the retracted requests waiting, and the
    scheduler asserted: the server died (tensor, disk and distributed alike). Now the first sync is
    refused before the pause and before any file is written or update sent, naming the release and
    what to do; 0.5.23, whose flush ignores the waiting queue while paused, syncs as before."""
    from fsdp_sync import FSDPShardingManager, SyncConfig
    from fsdp_sync.engines.sglang import SGLangEngine
    from fsdp_sync.models import build_model, load_config

    module = build_model(load_config("tiny"), seed=0)
    srv = (fake.FakeSGLangServer(tp_size=1, version="0.5.12") if version == "0.5.12" else
           fake.FakeSGLangServer(tp_size=1, session_routes=version != "0.5.20"))
    engine_cls = {"0.5.12": Retract0512, "0.5.20": Retract0520, "0.5.23": Retract0523}[version]
    srv.engine = engine_cls(tp_size=1)
    cfg = SyncConfig(method="disk", disk_dir=str(tmp_path), pause_mode="retract", verify="off",
                     memory_probe="off")
    err, eng = None, srv.engine
    with srv:
        manager = FSDPShardingManager(module, SGLangEngine(srv.url, timeout_s=10), config=cfg)
        try:
            with manager:
                pass
        except Exception as exc:  # noqa: BLE001 - the test reads it
            err = f"{type(exc).__name__}: {exc}"
        finally:
            manager.close()
        hits = dict(srv.hits)
    assert eng.dead is None, (version, eng.dead)
    if version == "0.5.23":
        assert err is None and manager.version == "0", err
        calls = [c for c, _ in eng.calls if c != "get_server_info"]
        assert calls[0] == "pause_generation" and calls[-1] == "continue_generation", calls
        (update,) = [b for _, p, b in srv.requests if p == "/update_weights_from_disk"]
        assert update["flush_cache"] is True, update
        return
    assert err and f"pause_mode='retract' against SGLang {version}" in err, err
    assert "use pause_mode='abort' or None" in err and "upgrade SGLang to >=0.5.21" in err, err
    assert f"SGLang at {srv.url}" in err, err
    assert "/pause_generation" not in hits and "/update_weights_from_disk" not in hits, hits
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("step_")], list(tmp_path.iterdir())
