"""A disk fleet never serves new weights under the old version label (`transport.disk`).

Replicas that apply a disk load as it arrives (SGLang: its weight-update session stages nothing;
here reference engines with ``transactional_updates=False``, which do the same), with no
``pause_mode`` (the default): before, each replica loaded the new version unnamed and was named
only at the fleet's commit, so while replica 1 loaded, replica 0 served the new weights as the old
version (/tmp/audit/fleet2/sglang_label.out: label '0', weights step_1's). Now the version goes
with each load: an engine that applies it at once is named at once, one that stages it (the
default reference engine) only at its commit, with its weights.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.topology import SyncError

pytestmark = pytest.mark.timeout(120)


def _engine(**kw):
    from fsdp_sync.engines.reference import ReferenceEngine

    return ReferenceEngine("tiny", tp_size=1, kv_cache_tokens=64, call_timeout_s=20,
                           update_recv_timeout_s=10, **kw)


def _fleet(engines, tmp_path):
    from fsdp_sync import FSDPShardingManager, SyncConfig
    from fsdp_sync.models import build_model, load_config

    module = build_model(load_config("tiny"), seed=3)
    return module, FSDPShardingManager(module, engines, config=SyncConfig(method="disk",
                                                                          disk_dir=str(tmp_path)))


def _norm(engine) -> float:
    return float(dict(engine.named_full_tensors())["model.norm.weight"].flatten()[0])


def _spy_on_replica_1(monkeypatch, engines, seen, fail=False):
    """While replica 1 loads: replica 0's (label, norm weight) as a request would see them."""
    real = engines[1].update_weights_from_disk

    def load(*args, **kw):
        seen.append((engines[0].weight_version, _norm(engines[0])))
        if fail:
            raise RuntimeError("injected: replica 1 refuses the load")
        return real(*args, **kw)
    monkeypatch.setattr(engines[1], "update_weights_from_disk", load)


@pytest.mark.parametrize("transactional", [False, True], ids=["applied_at_once", "staged"])
def test_no_replica_serves_new_weights_under_the_old_version(transactional, tmp_path, monkeypatch):
    engines = [_engine(transactional_updates=transactional) for _ in range(2)]
    try:
        module, manager = _fleet(engines, tmp_path)
        with manager:
            pass
        assert [e.weight_version for e in engines] == ["0", "0"]
        old = _norm(engines[0])
        with torch.no_grad():
            module.model.norm.weight.fill_(7.0)
        seen: list = []
        _spy_on_replica_1(monkeypatch, engines, seen)
        with manager:
            pass
        # applied at once: new weights, named '1' with them; staged: the old ones, still '0'
        assert seen == ([("1", 7.0)] if not transactional else [("0", old)]), seen
        assert [e.weight_version for e in engines] == ["1", "1"] and manager.version == "1"
        assert [_norm(e) for e in engines] == [7.0, 7.0]
        manager.close()
    finally:
        for e in engines:
            e.shutdown()


def test_a_replica_that_kept_a_failed_load_is_named_for_what_it_holds(tmp_path, monkeypatch):
    """Replica 1 refuses the load after replica 0 applied it (it cannot drop it): the sync fails,
    the manager's version stays, and replica 0 says '1', the weights it serves, not '0'."""
    engines = [_engine(transactional_updates=False) for _ in range(2)]
    try:
        module, manager = _fleet(engines, tmp_path)
        with manager:
            pass
        with torch.no_grad():
            module.model.norm.weight.fill_(7.0)
        seen: list = []
        _spy_on_replica_1(monkeypatch, engines, seen, fail=True)
        with pytest.raises(SyncError, match="serve its weights now as version '1'"):
            with manager:
                pass
        assert seen == [("1", 7.0)] and manager.version == "0"
        assert (engines[0].weight_version, _norm(engines[0])) == ("1", 7.0)
        manager.close()
    finally:
        for e in engines:
            e.shutdown()


def test_sglang_replicas_get_the_version_with_the_load(tmp_path):
    """Against SGLang 0.5.23's routes (tests/fake_sglang): each replica's
    /update_weights_from_disk body names the version (SGLang takes it with the load:
    ``UpdateWeightFromDiskReqInput.weight_version``), before any replica's commit."""
    import fake_sglang as fake
    from fsdp_sync.engines.sglang import SGLangEngine

    with fake.FakeSGLangServer(tp_size=1, version="0.5.23") as s0, \
            fake.FakeSGLangServer(tp_size=1, version="0.5.23") as s1:
        module, manager = _fleet([SGLangEngine(base_url=s.url) for s in (s0, s1)], tmp_path)
        with manager:
            pass
        for s in (s0, s1):
            loads = [b for _, p, b in s.requests if p == "/update_weights_from_disk"]
            # no session around it: SGLang's end_weight_update would post-process the weights again
            session = [p for _, p, _ in s.requests if p in ("/begin_weight_update", "/end_weight_update")]
            assert [b.get("weight_version") for b in loads] == ["0"] and not session, s.requests
        assert manager.version == "0"
        manager.close()
