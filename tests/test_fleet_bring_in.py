"""A replica brought in between syncs (`recover`, `add_engine`) after a FAILED sync holds exactly
what the replicas in service hold under the same version label.

The disk method used to reload whatever was published last (``step_<N>`` of the failed sync,
which no replica committed) or, where the failed sync never published, to write a fresh
``step_<N>`` from the trainer's current weights: either way under the old version label. The
tensor and distributed methods send the trainer's current weights, which the manager does only
inside its ``with`` block (after that block's sync committed the version): after a failed sync
the replica rejoins at the next sync. Single-process trainer, reference engines at TP 1.
"""

from __future__ import annotations

import os
import shutil

import pytest

from _util import digest, perturb_

pytestmark = pytest.mark.timeout(120)


def _engine():
    from fsdp_sync.engines.reference import ReferenceEngine

    return ReferenceEngine("tiny", tp_size=1, kv_cache_tokens=64, call_timeout_s=20,
                           update_recv_timeout_s=10)


def _served(engine) -> dict:
    return {n: digest(t) for n, t in engine.named_full_tensors()}


def _trained(module) -> dict:
    return {n: digest(p) for n, p in module.named_parameters()}


@pytest.fixture
def setup(tmp_path):
    from fsdp_sync import FSDPShardingManager, SyncConfig
    from fsdp_sync.models import build_model, load_config

    def make(method, engines, **kw):
        module = build_model(load_config("tiny"), seed=3)
        extra = {"disk_dir": str(tmp_path / "ckpt")} if method == "disk" else {"dist_timeout_s": 30.0}
        cfg = SyncConfig(method=method, bucket_bytes=1 << 20, layout="full", **extra, **kw)
        made.append(FSDPShardingManager(module, engines, config=cfg))
        return module, made[-1]

    made, engines = [], [_engine(), _engine()]
    yield make, engines
    for m in made:
        m.close()
    for e in engines:
        e.shutdown()


def _sync(manager) -> None:
    with manager:
        pass


def _fail_load(monkeypatch, engine):
    def refuse(*a, **k):
        raise RuntimeError("injected: the engine refuses this load")
    monkeypatch.setattr(engine, "update_weights_from_disk", refuse)


@pytest.mark.parametrize("phase", ["load", "write"])
def test_disk_add_engine_after_a_failed_sync_gets_what_the_fleet_serves(phase, setup, monkeypatch, tmp_path):
    """``load``: the failed sync published step_1, no replica committed it; ``write``: it failed
    writing step_1 (a full disk). Either way the replica added then serves step_0's weights, as
    the one in service does under version "0", and no step_1 is written for it."""
    from fsdp_sync.topology import SyncError
    from fsdp_sync.transport import disk

    make, (a, c) = setup
    module, manager = make("disk", [a])
    _sync(manager)
    served = _served(a)
    perturb_(module.parameters())
    with monkeypatch.context() as mp:
        if phase == "load":
            _fail_load(mp, a)
        else:
            def full(*args, **kw):
                raise OSError(28, "No space left on device (injected)")
            mp.setattr(disk, "_write_shard", full)
        with pytest.raises(SyncError):
            _sync(manager)
    assert manager.version == "0"
    listed = sorted(f for f in os.listdir(tmp_path / "ckpt") if f.startswith("step_"))
    assert manager.add_engine(c) is True
    assert _served(c) == served == _served(a), "the replica added holds other weights than version 0"
    assert sorted(f for f in os.listdir(tmp_path / "ckpt") if f.startswith("step_")) == listed
    assert c.get_weight_version() == a.get_weight_version() == "0"
    # the next sync brings both to the trainer's weights
    _sync(manager)
    assert _served(a) == _served(c) and all(_served(a)[n] == d for n, d in _trained(module).items())


def test_disk_recover_refused_when_the_served_version_is_gone(setup, tmp_path):
    """The files of the version the fleet serves were removed by hand: the replica is refused
    (naming why) rather than given another version's weights; it stays out of service."""
    from fsdp_sync.topology import SyncError

    make, (a, c) = setup
    module, manager = make("disk", [a, c])
    _sync(manager)
    perturb_(module.parameters())
    manager.quarantine(c, "drained")
    shutil.rmtree(tmp_path / "ckpt" / "step_0")
    with pytest.raises(SyncError, match="step_0 are gone"):
        manager.recover(c)
    assert manager.engines == [a]


def test_distributed_add_engine_after_a_failed_sync_joins_at_the_next(setup, monkeypatch):
    """Distributed: after a failed sync (outside the with block) the trainer's weights are not
    version "0" any more, so nothing is sent: the replica joins at the next sync."""
    from fsdp_sync.topology import SyncError

    make, (a, c) = setup
    module, manager = make("distributed", [a])
    _sync(manager)
    served = _served(a)
    perturb_(module.parameters())
    with monkeypatch.context() as mp:
        def refuse(*args, **kw):
            raise RuntimeError("injected: the engine refuses this update")
        mp.setattr(a, "update_weights_from_distributed", refuse)
        with pytest.raises(SyncError):
            _sync(manager)
    assert manager.version == "0" and _served(a) == served
    before = _served(c)
    assert manager.add_engine(c) is False and c not in manager.engines and _served(c) == before
    _sync(manager)
    assert manager.engines == [a, c] and _served(a) == _served(c)
    assert all(_served(c)[n] == d for n, d in _trained(module).items())


@pytest.mark.parametrize("how", ["recover", "add_engine"])
@pytest.mark.parametrize("mode", ["quarantine", "abort"])
def test_disk_replica_brought_in_after_a_failed_commit_gets_what_the_fleet_serves(mode, how, setup, monkeypatch):
    """Replica b's commit of step_1 fails (the request lost; b aborted it) after a committed it:
    a serves step_1 as version "1" ("quarantine": no error; "abort": the sync raises, the
    manager's version stays "0"). A replica brought in then must hold a's tensors bit for bit
    under a's version. Before, the transport's ``loaded`` stayed step_0 and the label was the
    manager's: it served step_0's weights as "1" (quarantine) or as "0" beside a's "1" (abort)."""
    from fsdp_sync.topology import SyncError

    make, (a, b) = setup
    c = _engine() if how == "add_engine" else None
    try:
        module, manager = make("disk", [a, b], on_replica_failure=mode)
        _sync(manager)
        perturb_(module.parameters())
        real_end, lost = b.end_weight_update, []

        def end(*, abort=False, weight_version=None):
            if not abort and not lost:
                lost.append(real_end(abort=True))    # the commit did not happen
                raise ConnectionError("injected: the commit request was lost")
            return real_end(abort=abort, weight_version=weight_version)
        monkeypatch.setattr(b, "end_weight_update", end)
        if mode == "abort":
            with pytest.raises(SyncError, match="committing"):
                _sync(manager)
        else:
            _sync(manager)
        assert manager.version == ("1" if mode == "quarantine" else "0")
        assert _served(a) == _trained(module) and a.get_weight_version() == "1"
        assert _served(b) != _served(a) and b.get_weight_version() == "0"
        new = b if how == "recover" else c
        assert getattr(manager, how)(new) is True
        assert _served(new) == _served(a), f"{how}: the replica holds other weights than the fleet serves"
        assert new.get_weight_version() == a.get_weight_version() == "1"
        status = {r["name"]: r for r in manager.fleet_status()["replicas"]}
        assert [r["version"] for r in status.values() if r["serving"]] == ["1", "1"]
        _sync(manager)      # the next sync brings them to the trainer's weights
        assert _served(a) == _served(new) == _trained(module)
    finally:
        if c is not None:
            c.shutdown()


@pytest.mark.parametrize("how", ["add_engine", "recover"])
def test_a_closed_manager_refuses_to_bring_a_replica_in(how, setup):
    """After ``close()``, `add_engine` and `recover` raise what the ``with`` block does ("closed
    ... make a new one") before touching the fleet: its status is as it was, an engine offered
    to add_engine still serves, a drained one stays drained (before: AttributeError 'NoneType'
    object has no attribute 'sync', after add_engine had put the engine in the fleet and told it
    "joining: waiting for the current weights")."""
    make, (a, c) = setup
    module, manager = make("disk", [a, c] if how == "recover" else [a])
    _sync(manager)
    if how == "recover":
        manager.quarantine(c, "drained")
    manager.close()
    before = manager.fleet_status()
    with pytest.raises(RuntimeError, match=r"closed .*make a new one"):
        getattr(manager, how)(c)
    assert manager.fleet_status() == before
    assert c.serving_state == ("drained" if how == "recover" else None)
    assert a.serving_state is None


def test_a_sync_after_every_replica_was_removed_is_refused(setup):
    """``remove_engine`` took out the last replica: the next sync raises naming add_engine, as
    one with every replica out of service does, and publishes no version (before: it "succeeded"
    with engine_calls 0 and published version "1", which no replica holds). Adding one back,
    the sync after goes through."""
    from fsdp_sync.topology import SyncError

    make, (a, _) = setup
    module, manager = make("disk", [a])
    _sync(manager)
    manager.remove_engine(a)
    perturb_(module.parameters())
    with pytest.raises(SyncError, match=r"no replica can take version '1': the fleet is empty.*add_engine"):
        _sync(manager)
    assert manager.fleet_status() == {"version": "0", "replicas": []}
    assert manager.add_engine(a) is True and a.get_weight_version() == "0"
    _sync(manager)
    assert manager.version == a.get_weight_version() == "2" and _served(a) == _trained(module)


@pytest.mark.parametrize("mode", ["abort", "quarantine"])
@pytest.mark.parametrize("method", ["disk", "distributed"])
def test_a_replica_out_of_service_that_refuses_to_rejoin_fails_no_sync(mode, method, setup, monkeypatch):
    """Replica 1 was taken out of service by the fleet (not by hand) and refuses updates while it
    answers the probe: the next sync takes it back in, and its begin_weight_update refuses (disk:
    a weight-update session of its own left open, as a failed commit can leave it; the
    distributed method aborts such a session, so there the refusal is injected). Before, that
    refusal was blamed on no one and failed the sync on every replica, at every sync, in both
    modes (/tmp/audit/fleet2/rejoin_refusal_inproc.out): replica 0 never got a new version. Now it
    stays out (held: only recover brings it back; the failure is its reason) and the sync runs
    again for replica 0, which commits; the next sync does not try replica 1 at all."""
    make, (a, b) = setup
    module, manager = make(method, [a, b], on_replica_failure=mode)
    _sync(manager)
    rep = manager.fleet.replicas[1]
    manager.fleet.quarantine(rep, "failed while committing (simulated)")
    rep.rejoin = mode == "abort"          # as a failure under "abort" leaves it: probed at the next sync
    def refuse(*args, **kw):      # a session left open is no refusal: both methods take it over
        raise RuntimeError("injected: begin_weight_update refused")
    monkeypatch.setattr(b, "begin_weight_update", refuse)
    perturb_(module.parameters())
    _sync(manager)
    assert manager.version == a.get_weight_version() == "1" and _served(a) == _trained(module)
    state = manager.fleet_status()["replicas"][1]
    assert not state["serving"] and state["version"] == "0", state
    assert "rejoining at version '1' failed" in state["reason"] and "recover()" in state["reason"], state
    assert "begin_weight_update" in state["reason"], state
    perturb_(module.parameters())
    _sync(manager)                        # held: not tried again
    assert manager.version == a.get_weight_version() == "2" and _served(a) == _trained(module)
    assert b.get_weight_version() == "0" and not manager.fleet_status()["replicas"][1]["serving"]
    monkeypatch.undo()
    manager.recover(b)                    # it can take updates again: brought to what replica 0 serves
    if method == "disk":
        assert b.get_weight_version() == "2" and _served(b) == _served(a)
    perturb_(module.parameters())
    _sync(manager)
    assert [e.get_weight_version() for e in (a, b)] == ["3", "3"] and _served(b) == _trained(module)


def test_a_refusal_in_service_still_fails_the_sync_with_a_replica_rejoining(setup, monkeypatch):
    """Replica 0 (in service) refuses the load while replica 1 rejoins: replica 1 is kept out, the
    sync runs again for replica 0 alone and fails there too: it raises, and no version is
    published."""
    from fsdp_sync.topology import SyncError

    make, (a, b) = setup
    module, manager = make("disk", [a, b], on_replica_failure="quarantine")
    _sync(manager)
    manager.fleet.quarantine(manager.fleet.replicas[1], "failed while committing (simulated)")
    _fail_load(monkeypatch, a)
    perturb_(module.parameters())
    with pytest.raises(SyncError, match="injected: the engine refuses this load"):
        _sync(manager)
    assert manager.version == a.get_weight_version() == "0"
    assert [r["serving"] for r in manager.fleet_status()["replicas"]] == [True, False]
