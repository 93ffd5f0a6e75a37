"""A disk sync into a fleet of SGLang replicas opens no weight-update session around the loads.

Before, the disk method wrapped each replica's ``update_weights_from_disk`` in
``begin_weight_update`` / ``end_weight_update`` when there was more than one engine. SGLang 0.5.23
applies a disk load at once and post-processes the weights itself, and its session does not count
a disk load (``loaded_weights`` stays False), so its ``end_weight_update`` ran ``post_load_weights``
and ``process_weights_after_loading`` again: twice per layer, scrambling every layer whose method
repacks in place, with no error (/tmp/audit/sglang3/disk_session_double_postprocess.out; SGLang's
own code: tests/sglang_tier/test_disk_session_postprocess.py). Now only engines that stage a disk
load (`transport.sessions.stages_disk_loads`: the reference engine, ``fsdp-sync serve``) get a
session; an SGLangEngine pointed at ``fsdp-sync serve`` keeps it (it reports itself in
``get_server_info``)."""

from __future__ import annotations

import pytest
import torch

import fake_sglang as fake

SESSION = ("/begin_weight_update", "/end_weight_update")


def _sync(engines, tmp_path, steps: int = 1):
    from fsdp_sync import FSDPShardingManager, SyncConfig
    from fsdp_sync.models import build_model, load_config

    module = build_model(load_config("tiny"), seed=0)
    cfg = SyncConfig(dtype=torch.float32, method="disk", disk_dir=str(tmp_path / "v"), memory_probe="off")
    manager = FSDPShardingManager(module, engines, config=cfg)
    for _ in range(steps):
        with manager:
            pass
    return module, manager


def _want(module) -> dict:
    from fsdp_sync.weights.export import iter_params
    return fake.digests(iter_params(module, dtype=torch.float32))


@pytest.mark.timeout(60)
def test_a_disk_fleet_of_sglang_servers_loads_outside_any_session(tmp_path):
    from fsdp_sync.engines import sglang as sg

    with fake.FakeSGLangServer(tp_size=1) as s0, fake.FakeSGLangServer(tp_size=1) as s1:
        engines = [sg.SGLangEngine(base_url=s.url, tp_size=1) for s in (s0, s1)]
        module, manager = _sync(engines, tmp_path, steps=2)
        for srv in (s0, s1):
            assert not any(srv.hits.get(p) for p in SESSION), srv.hits
            loads = [b for _, p, b in srv.requests if p == "/update_weights_from_disk"]
            assert len(loads) == 2
            # the version goes with the load (SGLang takes both at once); the format is named
            assert [b["weight_version"] for b in loads] == ["0", "1"], loads
            assert all(b["load_format"] == "auto" for b in loads), loads
            assert fake.digests(srv.engine.weights.items()) == _want(module)
        assert manager.version == "1"
        assert [e.stages_disk_loads for e in engines] == [False, False]
        manager.close()


@pytest.mark.timeout(60)
def test_a_disk_fleet_of_in_process_sglang_engines_loads_outside_any_session(tmp_path):
    from fsdp_sync.engines import sglang as sg

    fakes = [fake.FakeSGLangEngine(tp_size=1) for _ in range(2)]
    engines = [sg.SGLangEngine(e) for e in fakes]
    module, manager = _sync(engines, tmp_path)
    for e in fakes:
        assert [c for c, _ in e.calls if c != "get_server_info"][:1] == ["update_weights_from_disk"]
        assert not {"begin_weight_update", "end_weight_update"} & set(e.names()), e.names()
        assert fake.digests(e.weights.items()) == _want(module)
    assert [e.stages_disk_loads for e in engines] == [False, False]
    manager.close()


@pytest.mark.timeout(60)
def test_a_refusal_names_the_sglang_replicas_that_serve_the_new_version(tmp_path):
    """No session to abort: the replica before the refusing one applied the load (and its
    version), which the error and its note say, as before."""
    from fsdp_sync.engines import sglang as sg
    from fsdp_sync.topology import SyncError

    with fake.FakeSGLangServer(tp_size=1) as s0, fake.FakeSGLangServer(tp_size=1) as s1:
        s1.script["/update_weights_from_disk"] = [(400, '{"success": false, "message": "refused"}')]
        engines = [sg.SGLangEngine(base_url=s.url, tp_size=1) for s in (s0, s1)]
        with pytest.raises(SyncError) as info:
            _sync(engines, tmp_path)
        said, notes = str(info.value), getattr(info.value, "__notes__", [])
        assert "replica 1" in said and "failed to load it" in said, said
        assert "no replica committed it, but replica 0" in said and "loaded it already" in said, said
        assert any("replica 0" in n and "replica 1" in n and "partly new weights" in n for n in notes), notes
        assert not any(s.hits.get(p) for s in (s0, s1) for p in SESSION)


@pytest.mark.timeout(120)
def test_an_sglang_engine_pointed_at_fsdp_sync_serve_keeps_the_staged_fleet(tmp_path):
    """``fsdp-sync serve`` stages a disk load until its commit: there the fleet stays all or none,
    beside an SGLang replica that gets no session."""
    from fsdp_sync.engines import sglang as sg
    from fsdp_sync.engines.reference import ReferenceEngine
    from fsdp_sync.engines.reference.serve import EngineServer

    (tmp_path / "v").mkdir()
    with ReferenceEngine("tiny", tp_size=1, seed=3) as ref, \
            EngineServer(ref, allowed_disk_dirs=[str(tmp_path / "v")]) as serve, \
            fake.FakeSGLangServer(tp_size=1) as s1:
        engines = [sg.SGLangEngine(base_url=serve.url, tp_size=1), sg.SGLangEngine(base_url=s1.url, tp_size=1)]
        module, manager = _sync(engines, tmp_path)
        hits = serve.hits
        assert hits.get("/begin_weight_update") == 1 and hits.get("/end_weight_update") == 1, hits
        assert not any(s1.hits.get(p) for p in SESSION), s1.hits
        assert ref.weight_version == "0" and manager.version == "0"
        assert {n: fake.digest(ref.get_weights_by_name(n)) for n in ref.hf_names()} == _want(module)
        assert [e.stages_disk_loads for e in engines] == [True, False]
        manager.close()
