"""A replica of a LoRA fleet (`SyncConfig(lora="adapter")`, several replicas) whose base weights
changed since the manager synced them (a server restarted by its supervisor: its launch weights
under its launch version, 'default') needs the base again; it no longer blocks the fleet
(/tmp/audit/review4/lora_restart.py; before, every later adapter-only sync failed as a refusal,
"the engine's base weights are version 'default', not the base version '1' this manager synced",
replica 0 never got another adapter and fleet_status() listed replica 1 serving version '1'):

- under ``on_replica_failure="quarantine"`` it rejoins in the same sync: the base (the disk
  method's reload of what the others loaded), then the adapter, both verified, at the new version,
  while replica 0 takes the adapter;
- under ``"abort"`` that sync fails before anything is loaded and replica 1 is out of service with
  the mismatch as its reason; the next sync brings it in at the new version.

One engine alone keeps the refusal (tests/test_lora_fleet.py). One trainer process, TP-1
reference engines of "tiny", the disk method.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.topology import SyncError
from test_lora_fleet_failures import _engine, _manager, _model, _same, _status, _step, _sync

pytestmark = pytest.mark.timeout(240)

NAME = "model.norm.weight"


def _restart(engine):
    """What a restarted server serves: other weights (one tensor here), version 'default'."""
    w = engine.get_weights_by_name(NAME)
    engine.update_weights_from_tensor([(NAME, torch.full_like(w, 3.0))], weight_version="default")
    assert not torch.equal(engine.get_weights_by_name(NAME), w)


def _trainer_adapter(model):
    return {n: p.detach() for n, p in model.named_parameters() if ".lora_" in n}


def _serves_the_trainers(engine, other, model):
    got, want = engine.lora_tensors("L"), _trainer_adapter(model)
    assert len(got) == len(want) > 0
    assert _same(got, other.lora_tensors("L"))
    assert torch.equal(engine.get_weights_by_name(NAME), other.get_weights_by_name(NAME))
    assert engine.weights_checksum() == other.weights_checksum()


@pytest.mark.parametrize("mode", ["quarantine", "abort"])
def test_a_replica_whose_base_changed_rejoins_and_blocks_no_one(tmp_path, mode):
    with _engine() as a, _engine() as b:
        model = _model()
        m = _manager(model, [a, b], tmp_path, mode=mode)
        try:
            _sync(m)
            _step(model)
            _sync(m)
            assert _status(m) == [(True, "1"), (True, "1")]
            before = a.lora_tensors("L")
            _restart(b)
            _step(model)
            if mode == "quarantine":
                _sync(m)                     # replica 0 takes the adapter; replica 1 rejoins in it
                assert not _same(a.lora_tensors("L"), before)
                assert m.stats.extra["replicas_serving"] == 2 and m.stats.extra["replicas_out"] == []
            else:
                with pytest.raises(SyncError, match=r"replica 1: adapter 'L': the engine's base weights "
                                                    r"are version 'default', not the base version '1'.*"
                                                    r"quarantined: the next sync gives it the base"):
                    _sync(m)
                assert _same(a.lora_tensors("L"), before) and m.version == a.weight_version == "1"
                st = m.fleet_status()["replicas"][1]
                assert (st["serving"], st["version"]) == (False, None)   # serves no version of ours
                assert "base weights are version 'default'" in st["reason"]
                _sync(m)                     # the next brings it in
            assert _status(m) == [(True, "2"), (True, "2")], m.fleet_status()
            assert m.version == a.weight_version == b.weight_version == "2"
            assert m.stats.extra["base_verify_tensors"] > 0          # the base verified on both
            _serves_the_trainers(b, a, model)
            _step(model)
            _sync(m)                         # and the fleet goes on
            assert _status(m) == [(True, "3"), (True, "3")]
            _serves_the_trainers(b, a, model)
        finally:
            m.close()
