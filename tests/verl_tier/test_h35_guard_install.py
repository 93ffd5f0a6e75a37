"""`guard.install` run twice (the plug-in loaded again: verl's entry point, then a
``custom_backend_module`` import) keeps the class path that was there first, so building the
rollout still gives verl's own object, never `guard.Unwrapped` again (which would build itself
without end); the opted-in refusal names the rollout, the mode and the option to drop (audit H35,
found by mutating `guard`)."""

from __future__ import annotations

import sys
import types

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.timeout(60)]


def test_install_twice_keeps_the_original_and_builds_it(monkeypatch):
    from fsdp_sync.integrations.verl import guard

    monkeypatch.setattr(guard, "ORIGINAL", {})
    mod = types.ModuleType("h35_stand_in_rollout")

    class ServerAdapter:
        def __init__(self, config, model_config, device_mesh):
            self.args = (config, model_config, device_mesh)

    mod.ServerAdapter = ServerAdapter
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    ours = "fsdp_sync.integrations.verl.adapter.SGLangAdapter"
    registry = {("other", "async"): f"{mod.__name__}.ServerAdapter", ("sglang", "async"): ours,
                ("fsdp_sync_ref", "async"): "somewhere.Else"}
    guard.install(registry, (ours,))
    guard.install(registry, (ours,))
    assert registry == {("other", "async"): guard.PATH, ("sglang", "async"): ours,
                        ("fsdp_sync_ref", "async"): "somewhere.Else"}
    assert guard.ORIGINAL == {("other", "async"): f"{mod.__name__}.ServerAdapter"}
    off = types.SimpleNamespace(name="other", mode="async", custom=None)
    obj = guard.Unwrapped(config=off, model_config="mc", device_mesh=None)
    assert type(obj) is ServerAdapter and obj.args == (off, "mc", None)
    on = types.SimpleNamespace(name="other", mode="async", custom={"fsdp_sync": {"enable": True}})
    with pytest.raises(NotImplementedError) as err:
        guard.Unwrapped(config=on, model_config="mc", device_mesh=None)
    msg = str(err.value)
    assert "rollout.name='other' (mode 'async')" in msg and \
        "drop +actor_rollout_ref.rollout.custom.fsdp_sync.enable" in msg, msg
