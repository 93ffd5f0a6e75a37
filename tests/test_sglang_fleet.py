"""A fleet of SGLang replicas (in-process fakes with 0.5.23's semantics) through the disk method.

SGLang applies a disk load at once, inside a weight-update session or not (begin/end only bracket
it), so when replica i refuses, replicas 0..i-1 already serve the new weights and no abort takes
them back. The sync's error said "no replica committed it" and nothing else: the list of replicas
that could not drop what they took (`fleet.end_all`'s answer) was thrown away, where the tensor and
distributed methods attach it (`fleet.note_partial`).
"""

from __future__ import annotations

import pytest
import torch

import fake_sglang as fake


class _Named(fake.FakeSGLangEngine):
    """``get_server_info`` carries ``weight_version`` as a real 0.5.23 ``sglang.Engine``'s does
    (its server args), so the fleet's probe (`fleet.problem`) finds the replica healthy."""

    def get_server_info(self):
        return {**super().get_server_info(), "weight_version": "default"}


class _Refusing(_Named):
    """Refuses the disk load before reading anything, as SGLang does for a missing file."""

    def update_weights_from_disk(self, model_path, load_format=None):
        self._record("update_weights_from_disk", model_path=model_path)
        return False, "Failed to get weights iterator: (scripted refusal before loading)", 0


def _failed_disk_sync(tmp_path, refusing):
    """A disk sync into replica 0 (healthy) and replica 1 (``refusing``): what it raised."""
    from fsdp_sync import FSDPShardingManager, SyncConfig
    from fsdp_sync.engines import sglang as sg
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncError

    module = build_model(load_config("tiny"), seed=0)
    e0, e1 = _Named(tp_size=1), refusing(tp_size=1)
    cfg = SyncConfig(dtype=torch.float32, method="disk", disk_dir=str(tmp_path), memory_probe="off")
    manager = FSDPShardingManager(module, [sg.SGLangEngine(e0), sg.SGLangEngine(e1)], config=cfg)
    with pytest.raises(SyncError) as info:
        with manager:
            pass
    return module, e0, manager, str(info.value), getattr(info.value, "__notes__", [])


@pytest.mark.timeout(60)
def test_a_disk_load_refused_by_one_replica_names_the_replicas_that_kept_it(tmp_path):
    from fsdp_sync.weights.export import iter_params

    module, e0, manager, said, notes = _failed_disk_sync(tmp_path, _Refusing)
    # replica 0 loaded the version and serves it: the error says so, on every rank (the message)
    want = dict(iter_params(module, dtype=torch.float32))
    assert all(torch.equal(e0.weights[n], t) for n, t in want.items() if n in e0.weights) and e0.weights
    # no session around it (SGLang's end_weight_update would post-process the weights again)
    assert [c for c, _ in e0.calls if c != "get_server_info"] == ["update_weights_from_disk"]
    assert "replica 1 of 2 failed to load it" in said and "scripted refusal" in said, said
    assert "no replica committed it, but replica 0 loaded it already" in said, said
    # and trainer rank 0's error carries the fleet's note, as the tensor and distributed methods do
    assert any("could not drop" in n and "replica 0" in n and "partly new weights" in n
               for n in notes), notes
    # no replica is said to hold a version it never committed; replica 0 holds the new one whole
    # and serves on; replica 1's load failed (SGLang's "rollback" of a load that failed partway
    # re-reads the new directory: its weights are not one known version) and it is out until the
    # next sync brings it back. Before: both out of service (106ad46), no replica served
    status = manager.fleet_status()
    assert status["version"] is None and manager.version is None
    assert [(r["name"], r["serving"], r["version"]) for r in status["replicas"]] == [
        ("replica 0", True, None), ("replica 1", False, None)], status
    assert "partly new weights" in status["replicas"][1]["reason"], status
    manager.close()


class _RefusingUnnamed(fake.FakeSGLangEngine):
    """Refuses the disk load, and answers no ``weight_version``: the fleet's probe blames it."""

    def update_weights_from_disk(self, model_path, load_format=None):
        self._record("update_weights_from_disk", model_path=model_path)
        return False, "Failed to get weights iterator: (scripted refusal before loading)", 0


@pytest.mark.timeout(60)
def test_the_note_of_what_replicas_kept_survives_blaming_a_replica(tmp_path):
    """When the fleet's probe blames the failing replica, the manager raised a new SyncError
    ('... replicas that cannot take updates: ...') from None, dropping the transport error's
    notes: the one saying replica 0 serves the new weights and could not drop them was lost."""
    _, _, manager, said, notes = _failed_disk_sync(tmp_path, _RefusingUnnamed)
    assert "replicas that cannot take updates (quarantined): replica 1" in said, said
    assert any("could not drop" in n and "replica 0" in n for n in notes), (said, notes)
    manager.close()


@pytest.mark.timeout(60)
def test_one_sglang_replica_whose_disk_load_failed_is_out_as_a_fleets_would_be(tmp_path):
    """The disk method's one-replica case says what the fleet case says (review5): before, a
    failed load of a lone SGLang replica left it in service with no note, and a pause_mode
    continued its generation on whatever the failed load left."""
    from fsdp_sync import FSDPShardingManager, SyncConfig
    from fsdp_sync.engines import sglang as sg
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncError

    module = build_model(load_config("tiny"), seed=0)
    cfg = SyncConfig(dtype=torch.float32, method="disk", disk_dir=str(tmp_path), memory_probe="off")
    manager = FSDPShardingManager(module, [sg.SGLangEngine(_Refusing(tp_size=1))], config=cfg)
    with pytest.raises(SyncError) as info:
        with manager:
            pass
    notes = getattr(info.value, "__notes__", [])
    assert any("replica 0" in n and "partly new weights" in n for n in notes), notes
    (rep,) = manager.fleet_status()["replicas"]
    assert not rep["serving"] and "partly new weights" in rep["reason"], rep
    manager.close()
