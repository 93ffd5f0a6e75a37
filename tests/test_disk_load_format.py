"""The disk method names the load format of every ``update_weights_from_disk``.

Before, it sent ``"load_format": null``; SGLang (0.5.12 and 0.5.23) replaces None with its launch
``--load-format`` (tokenizer_manager.py), and a rollout server launched with ``--load-format
dummy`` (verl's default) then refused every disk sync: "Failed to get model loader:
DummyModelLoader" (/tmp/audit/sglang3/disk_dummy_load_format.out). Now Hugging Face versions go
with ``"auto"`` (SGLang's DefaultModelLoader in both releases; the reference engine takes it) and
per-rank versions with ``"sharded_state"`` (what the reference engine takes for them)."""

from __future__ import annotations

import functools

import pytest
import torch

import fake_sglang as fake


class _DummyLaunched(fake.FakeSGLangEngine):
    """SGLang launched with ``--load-format dummy``: a load without a format gets the launch one,
    whose loader is no DefaultModelLoader, and is refused before anything is read."""

    def update_weights_from_disk(self, model_path, load_format=None):
        if load_format is None:
            self._record("update_weights_from_disk", model_path=model_path, load_format=None)
            return False, "Failed to get model loader: <DummyModelLoader object>.", 0
        return super().update_weights_from_disk(model_path, load_format)


def _sync(engines, tmp_path, **kw):
    from fsdp_sync import FSDPShardingManager, SyncConfig
    from fsdp_sync.models import build_model, load_config

    module = build_model(load_config("tiny"), seed=0)
    cfg = SyncConfig(dtype=torch.float32, method="disk", disk_dir=str(tmp_path / "v"),
                     memory_probe="off", **kw)
    manager = FSDPShardingManager(module, engines, config=cfg)
    with manager:
        pass
    manager.close()
    return module


@pytest.mark.timeout(60)
def test_a_disk_sync_names_the_load_format_to_a_server_launched_with_dummy(tmp_path):
    from fsdp_sync.engines import sglang as sg
    from fsdp_sync.weights.export import iter_params

    with fake.FakeSGLangServer(tp_size=1) as srv:
        srv.engine = _DummyLaunched(tp_size=1)
        module = _sync(sg.SGLangEngine(base_url=srv.url, tp_size=1), tmp_path)
        bodies = [b for _, p, b in srv.requests if p == "/update_weights_from_disk"]
        assert len(bodies) == 1 and bodies[0]["load_format"] == "auto", bodies
        want = fake.digests(iter_params(module, dtype=torch.float32))
        assert fake.digests(srv.engine.weights.items()) == want


@pytest.mark.timeout(120)
def test_per_rank_versions_go_as_sharded_state_and_the_reference_engine_loads_them(tmp_path):
    from fsdp_sync.engines.reference import ReferenceEngine
    from fsdp_sync.weights.export import iter_params

    with ReferenceEngine("tiny", tp_size=2, seed=3) as ref:
        formats = []
        orig = ref.update_weights_from_disk

        @functools.wraps(orig)
        def recording(*args, **kw):
            formats.append(kw.get("load_format"))
            return orig(*args, **kw)

        ref.update_weights_from_disk = recording
        module = _sync(ref, tmp_path, layout="engine")
        assert formats == ["sharded_state"]
        assert all(torch.equal(ref.get_weights_by_name(n), t)
                   for n, t in iter_params(module, dtype=torch.float32))
