"""Adapter-only syncs (`SyncConfig(lora="adapter")`) into a fleet of replicas go where a full sync
goes, take out what it takes out, bring back what it brings back and publish a version
(/tmp/audit/fleet3; before, they went to ``fleet.serving`` as it stood, and nothing else):

- a replica whose server stopped answering is quarantined under ``on_replica_failure="quarantine"``
  and the other serves and verifies the new adapter (before: every later sync failed as a refusal,
  "nothing was loaded: every engine keeps its adapter", the replica still in service);
- under ``"abort"`` a replica whose worker died fails one sync, which says it was quarantined, and
  the next goes to the other (before: every later sync failed the same way);
- a replica out of service that can take updates again rejoins at the next adapter-only sync with
  the base and the adapter the others serve (before: it stayed out for good, and ``recover()``
  outside the ``with`` block promised a rejoin that never came); one recovered between syncs
  serves the adapter and the version at once (before: the base alone until the next sync);
- every adapter sync has a version: ``manager.version``, each replica's, the engines'
  ``weight_version``, ``stats.extra``; a failed one changes none (before: all stayed the base
  sync's while the adapter served changed).

One trainer process, no process group; TP-1 reference engines of "tiny" (over HTTP through
`fsdp-sync serve`'s `EngineServer` where said).
"""

from __future__ import annotations

import time

import pytest
import torch

from fsdp_sync import FSDPShardingManager, SyncConfig
from fsdp_sync.engines import ReferenceEngine
from fsdp_sync.engines.base import WeightUpdateError
from fsdp_sync.topology import SyncError

pytestmark = pytest.mark.timeout(240)

PROMPT = [[11, 27, 93, 5, 7, 8]]


def _engine():
    return ReferenceEngine("tiny", tp_size=1, max_lora_rank=8, call_timeout_s=20, update_recv_timeout_s=10)


@pytest.fixture(scope="module")
def two():
    with _engine() as a, _engine() as b:
        yield a, b


@pytest.fixture
def fresh(two):
    """The shared engines as new: no adapter, in service (a test may leave one quarantined)."""
    for e in two:
        e.set_serving(True)
        for n in list(e.lora_adapters):
            e.unload_lora_adapter(n)
    yield two
    for e in two:
        e.set_serving(True)


from test_lora_fleet import _model, _step   # the same adapter model and training step


def _manager(model, engines, tmp_path, mode="abort", method="disk", **kw):
    extra = {"disk_dir": str(tmp_path)} if method == "disk" else {"dist_timeout_s": 30.0}
    return FSDPShardingManager(model, list(engines), config=SyncConfig(
        method=method, lora="adapter", lora_name="L", verify="full", on_replica_failure=mode, **extra, **kw))


def _sync(m):
    with m:
        pass


def _same(x, y):
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def _status(m):
    return [(r["serving"], r["version"]) for r in m.fleet_status()["replicas"]]


def _kill(engine):
    engine._w.procs[0].kill()
    for _ in range(100):
        if engine.dead_reason():
            return
        time.sleep(0.05)
    raise AssertionError("the killed replica was not seen dead")


def test_a_server_that_stopped_answering_is_quarantined_under_quarantine(fresh, tmp_path):
    from fsdp_sync.engines.reference.serve import EngineServer
    from fsdp_sync.engines.sglang import SGLangEngine

    ea, eb = fresh
    sa = EngineServer(ea, allowed_disk_dirs=[str(tmp_path)], update_wait_s=30).start()
    sb = EngineServer(eb, allowed_disk_dirs=[str(tmp_path)], update_wait_s=30).start()
    a, b = (SGLangEngine(base_url=s.url, retry_backoff_s=0.01) for s in (sa, sb))
    model = _model()
    m = _manager(model, [a, b], tmp_path, mode="quarantine")
    try:
        _sync(m)
        before = ea.lora_tensors("L")
        sb.close()                      # what a SIGKILLed server looks like to its client
        for k in (1, 2):                # the first takes it out; the next goes to replica 0 alone
            _step(model)
            _sync(m)
            assert _status(m) == [(True, str(k)), (False, "0")], m.fleet_status()
            assert m.stats.extra["verify_tensors"] > 0 and m.stats.extra["replicas_serving"] == 1
            assert len(m.stats.extra["replicas_out"]) == 1
            assert m.stats.extra["replicas_out"][0].startswith(f"{m.fleet.replicas[1].name}: SGLangHTTPError")
        assert "get_weight_version" in m.fleet_status()["replicas"][1]["reason"]
        assert not _same(ea.lora_tensors("L"), before) and a.get_weight_version() == "2"
    finally:
        m.close()
        sa.close()
        sb.close()


def test_a_dead_replica_under_abort_fails_one_sync_and_is_quarantined(fresh, tmp_path):
    a, _ = fresh
    model = _model()
    with _engine() as b:
        m = _manager(model, [a, b], tmp_path)
        try:
            _sync(m)
            before = a.lora_tensors("L")
            _kill(b)
            _step(model)
            with pytest.raises(SyncError, match=r"replica 1 failed to load adapter 'L': WorkerDiedError.*"
                                                r"quarantined \(cannot take updates; the next sync goes to "
                                                r"the others\): replica 1"):
                _sync(m)
            assert _same(a.lora_tensors("L"), before)          # put back, still version 0
            assert m.version == a.weight_version == "0" and _status(m) == [(True, "0"), (False, "0")]
            _sync(m)                                           # to replica 0 alone
            assert m.version == a.weight_version == "1" and _status(m) == [(True, "1"), (False, "0")]
            assert not _same(a.lora_tensors("L"), before)
            assert m.stats.extra["replicas_out"][0].startswith("replica 1: TP rank 0")
        finally:
            m.close()


def _failing(engine, monkeypatch):
    def load(*a, **k):
        raise WeightUpdateError("load_lora_adapter_from_tensors('L'): worker 0 ran out of memory")
    monkeypatch.setattr(engine, "load_lora_adapter_from_tensors", load, raising=False)


@pytest.mark.parametrize("case", ["recover-outside-the-with-block", "failed-once-under-quarantine"])
def test_a_replica_out_of_service_rejoins_at_the_next_adapter_sync(fresh, tmp_path, monkeypatch, case):
    """Distributed: replica 1 drained by hand, then ``recover()`` outside the with block (it
    returns False: "rejoins at the next sync"). Disk under "quarantine": replica 1's adapter load
    failed once. Either way the next adapter-only sync gives it the base and the adapter, verifies
    both, and puts it back in service at the new version, serving what replica 0 serves."""
    a, b = fresh
    model = _model()
    recover = case.startswith("recover")
    m = _manager(model, fresh, tmp_path, method="distributed" if recover else "disk",
                 mode="abort" if recover else "quarantine")
    try:
        _sync(m)
        _step(model)
        if recover:
            m.quarantine(b, "drained by hand")
            _sync(m)
            assert m.recover(b) is False
        else:
            with monkeypatch.context() as mp:
                _failing(b, mp)
                _sync(m)
        assert _status(m) == [(True, "1"), (False, "0")]
        stale = b.lora_tensors("L")
        _step(model)
        _sync(m)
        assert _status(m) == [(True, "2"), (True, "2")], m.fleet_status()
        assert m.version == a.weight_version == b.weight_version == "2"
        assert _same(a.lora_tensors("L"), b.lora_tensors("L")) and not _same(b.lora_tensors("L"), stale)
        assert torch.equal(a.forward_logits(PROMPT, lora_path="L"), b.forward_logits(PROMPT, lora_path="L"))
        assert m.stats.extra["replicas_serving"] == 2 and m.stats.extra["replicas_out"] == []
        assert m.stats.extra["base_verify_tensors"] > 0          # the base verified on both
    finally:
        m.close()


def test_a_replica_recovered_between_adapter_syncs_serves_what_the_others_do(fresh, tmp_path):
    a, b = fresh
    model = _model()
    m = _manager(model, fresh, tmp_path)
    try:
        _sync(m)
        m.quarantine(b, "drained by hand")
        for _ in range(2):
            _step(model)
            _sync(m)
        assert m.recover(b) is True
        assert _status(m) == [(True, "2"), (True, "2")] and b.weight_version == "2"
        assert _same(a.lora_tensors("L"), b.lora_tensors("L"))
        assert torch.equal(a.forward_logits(PROMPT, lora_path="L"), b.forward_logits(PROMPT, lora_path="L"))
        _step(model)
        _sync(m)                        # the base version guard follows the version it was given
        assert m.version == a.weight_version == b.weight_version == "3"
    finally:
        m.close()


def test_every_adapter_sync_has_a_version_and_a_failed_one_changes_none(fresh, tmp_path, monkeypatch):
    a, b = fresh
    model = _model()
    m = _manager(model, fresh, tmp_path)
    try:
        _sync(m)
        assert m.version == a.weight_version == b.weight_version == "0"
        _step(model)
        _sync(m)
        assert m.version == a.weight_version == b.weight_version == "1" and _status(m) == [(True, "1")] * 2
        assert {k: m.stats.extra[k] for k in ("version", "replicas_serving", "replicas_out")} == {
            "version": "1", "replicas_serving": 2, "replicas_out": []}
        _step(model)
        with monkeypatch.context() as mp:
            _failing(b, mp)
            with pytest.raises(SyncError, match="replica 1 failed to load adapter 'L'"):
                _sync(m)
        assert m.version == a.weight_version == b.weight_version == "1" and _status(m) == [(True, "1")] * 2
        m.global_steps = 7
        _sync(m)
        assert m.version == a.weight_version == b.weight_version == "7" and _status(m) == [(True, "7")] * 2
        a.weight_version = "default"        # restarted: the base guard still tells
        with pytest.raises(SyncError, match=r"replica 0: adapter 'L': the engine's base weights are version "
                                            r"'default', not the base version '7'"):
            _sync(m)
    finally:
        m.close()
