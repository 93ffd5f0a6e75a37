"""A failed adapter load on an engine that unloads before it loads (SGLang's way: no staged
``replace``) leaves that replica back on the adapter it served, under ``on_replica_failure=
"abort"``: `lora_sync` puts back the replicas that took the new adapter AND those whose failed
load had already dropped their old one. Only the first kind was covered (the fleet tests use the
reference engine, whose failed load changes nothing); with the second left out, the failing
replica served no adapter at all while the error said every replica was back.

The SGLang-like replica is a reference engine seen without ``lora_adapters`` (so `lora_sync`
treats it as SGLang: ``/v1/models`` says whether it holds the adapter, unload, then load).
"""

from __future__ import annotations

import pytest

from fsdp_sync.engines.base import WeightUpdateError
from fsdp_sync.topology import SyncError
from test_lora_fleet import _fresh, _manager, _model, _same, _step, two  # noqa: F401

pytestmark = pytest.mark.timeout(240)


class SGLangLike:
    """``engine`` without the reference engine's staged swap; its next ``fail`` loads fail."""

    def __init__(self, engine):
        self._engine, self.fail = engine, 0

    def __getattr__(self, name):
        if name in ("lora_adapters", "lora_load_formats"):
            raise AttributeError(name)
        return getattr(self._engine, name)

    def available_models(self):           # SGLang's /v1/models: the adapters it holds, by name
        return {"object": "list", "data": [{"id": n} for n in self._engine.lora_adapters]}

    def load_lora_adapter_from_tensors(self, lora_name, tensors, config_dict, **kw):
        if self.fail:
            self.fail -= 1
            raise WeightUpdateError(f"load_lora_adapter_from_tensors({lora_name!r}): worker 0 ran "
                                    f"out of memory")
        return self._engine.load_lora_adapter_from_tensors(lora_name, tensors, config_dict, **kw)


def test_a_replica_that_unloaded_before_its_failed_load_is_put_back(two, tmp_path):  # noqa: F811
    a, b = two
    _fresh(two)
    like = SGLangLike(b)
    model = _model()
    m = _manager(model, [a, like], tmp_path)
    try:
        with m:
            pass
        before = a.lora_tensors("L")
        assert _same(b.lora_tensors("L"), before)
        _step(model)
        like.fail = 1           # the new adapter's load; putting the old one back works
        with pytest.raises(SyncError, match=r"replica 1 failed to load adapter 'L': .*out of memory; "
                                            r"every replica is back on the adapter it served before"):
            with m:
                pass
        assert "L" in b.lora_adapters                      # unloaded, the load failed, put back
        assert _same(b.lora_tensors("L"), before)
        assert _same(a.lora_tensors("L"), before)
        with m:
            pass
        assert not _same(b.lora_tensors("L"), before) and _same(a.lora_tensors("L"), b.lora_tensors("L"))
    finally:
        m.close()


def test_put_back_restores_the_adapter_of_the_last_good_sync_not_the_first(two, tmp_path):  # noqa: F811
    """The manager's copy of the last adapter loaded (`AdapterCopy.keep`, rewritten in place while
    names and shapes stay) is what a failed sync puts back: after two good syncs, the second's.
    With the in-place copy skipped, the replicas were put back on the first sync's adapter."""
    a, b = two
    _fresh(two)
    like = SGLangLike(b)
    model = _model()
    m = _manager(model, [a, like], tmp_path)
    try:
        with m:
            pass
        first = a.lora_tensors("L")
        _step(model)
        with m:
            pass
        second = a.lora_tensors("L")
        assert not _same(first, second) and _same(b.lora_tensors("L"), second)
        _step(model)
        like.fail = 1
        with pytest.raises(SyncError, match=r"every replica is back on the adapter it served before"):
            with m:
                pass
        assert _same(a.lora_tensors("L"), second) and _same(b.lora_tensors("L"), second)
    finally:
        m.close()
