"""An ``add_engine`` whose transfer failed partway left the engine's generation paused (the manager
stalls a replica holding partly new weights under a ``pause_mode``, then removed it from the fleet);
adding it again succeeded and reported it serving while its requests hung (review5). A replica
brought in now has its generation continued whatever a failed attempt left. The transport is
stubbed: only the manager's pause bookkeeping runs for real."""

from __future__ import annotations

import pytest
import torch

from fsdp_sync import FSDPShardingManager, SyncConfig, fleet
from fsdp_sync.models import build_model, load_config
from fsdp_sync.topology import SyncError

from _pause_engine import PauseEngine


class _Eng(PauseEngine):
    base_url = "http://127.0.0.1:39999"


@pytest.mark.timeout(60)
def test_a_replica_added_after_a_failed_attempt_generates_again():
    module = build_model(load_config("tiny"), seed=0)
    e0, new = _Eng(), _Eng()
    cfg = SyncConfig(dtype=torch.float32, method="distributed", memory_probe="off", pause_mode="abort")
    m = FSDPShardingManager(module, [e0], config=cfg)
    m._check_config = lambda engine: None
    m.version, m._inside, m.step = "0", True, 1
    calls = []

    def fake_sync(targets, version, step, reload=False):
        fleet.take_noted()
        calls.append(version)
        if len(calls) == 1:              # the first transfer fails partway: the engine kept part
            err = SyncError("update_weights_from_distributed failed on replica 1")
            fleet.note_partial([fleet.describe(targets[0].engine, 0)])
            return err, None
        return None, None

    m._transport_sync = fake_sync
    with pytest.raises(SyncError, match="not added to the fleet"):
        m.add_engine(new)
    assert new.paused == "abort" and not any(r.engine is new for r in m.fleet.replicas)
    assert m.add_engine(new) is True
    rep = m.fleet.find(new)
    assert rep.serving and not rep.stalled
    assert new.paused is None and new.log[-1] == ("continue",), new.log     # before: still 'abort'
    m._inside = False                    # the stubbed block ends: closed as a user's would be
    m.close()


@pytest.mark.timeout(60)
def test_an_interrupt_inside_the_transport_still_keeps_generation_off_partly_new_weights():
    """A Ctrl-C (any raise) out of the transport after a replica took part of the update: the
    manager read which replicas kept part only when the transport returned, so it continued
    generation on them (review5). Now they are stalled as after a returned failure."""
    module = build_model(load_config("tiny"), seed=0)
    e0 = _Eng()
    cfg = SyncConfig(dtype=torch.float32, method="distributed", memory_probe="off", pause_mode="abort")
    m = FSDPShardingManager(module, [e0], config=cfg)
    m._check_coverage = lambda: None

    def interrupted(targets, version, step, reload=False):
        fleet.take_noted()
        fleet.note_partial([fleet.describe(targets[0].engine, 0)])
        raise KeyboardInterrupt

    m._transport_sync = interrupted
    with pytest.raises(KeyboardInterrupt):
        m._sync_full()
    (rep,) = m.fleet_status()["replicas"]
    assert rep["generation_paused"] and not rep["serving"], rep
    assert e0.paused == "abort" and ("continue",) not in e0.log, e0.log   # before: continued
    m.close()
