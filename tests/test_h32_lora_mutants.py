"""Checks of `lora_sync` that no test held (H32's mutation pass: each test below fails with the
check taken out), in process, fake engines, cheap."""

from __future__ import annotations

import pytest
import torch

from fsdp_sync import lora_sync

pytestmark = pytest.mark.timeout(60)


class Fake:
    """An SGLang-like engine (no staged swap): ``/v1/models``, unload, load; ``fail``: its loads raise."""

    def __init__(self, held=(), fail=False):
        self.held, self.fail, self.calls = set(held), fail, []

    def available_models(self):
        return {"object": "list", "data": [{"id": n} for n in sorted(self.held)]}

    def unload_lora_adapter(self, name):
        self.calls.append(("unload", name))
        self.held.discard(name)

    def load_lora_adapter_from_tensors(self, name, tensors, cfg):
        self.calls.append(("load", name))
        if self.fail:
            raise RuntimeError("worker 0 ran out of memory")
        assert name not in self.held, "two adapters live under one name"
        self.held.add(name)


def test_under_abort_the_load_stops_at_the_first_failure_and_touches_no_other_replica():
    """``on_replica_failure="abort"`` (``keep_going=False``): a failed load ends the loads; the
    replicas after it keep their adapter untouched (no unload, no load that would have to be put
    back: each put back is one more chance of a replica left on another adapter)."""
    t = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 4)}
    engines = [Fake({"L"}), Fake({"L"}, fail=True), Fake({"L"})]
    loaded, failed, had = lora_sync.load_all(engines, "L", t, {"r": 2}, None, keep_going=False)
    assert loaded == [0] and list(failed) == [1] and "out of memory" in failed[1]
    assert had == [True, True, None]
    assert engines[0].calls == [("unload", "L"), ("load", "L")]
    assert engines[2].calls == [] and engines[2].held == {"L"}
    # under quarantine (keep_going) the others still take it
    engines = [Fake({"L"}), Fake({"L"}, fail=True), Fake()]
    loaded, failed, had = lora_sync.load_all(engines, "L", t, {"r": 2}, None, keep_going=True)
    assert loaded == [0, 2] and list(failed) == [1] and had == [True, True, False]
    assert engines[2].calls == [("load", "L")]          # held none: nothing to unload
