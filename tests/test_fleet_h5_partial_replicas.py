"""A replica that a failed transfer left holding partly new weights (`manager_pause.stall`), then
brought in or taken out between syncs (review H5):

- `recover` before any version was committed reinstated it (serving, /health 200) with its
  generation still paused: its requests hung; without a ``pause_mode`` it served the mixed
  weights. Now it stays out and rejoins at the first sync that commits, which continues it.
- `remove_engine` of it, and an `add_engine` that failed partway, left it paused with nothing to
  ever continue it: requests held there waited forever. Now they come back aborted, generation
  stays paused there (no answer from mixed weights) and the engine is told it is out of service
  for a reason that says so.
- `recover` / `add_engine` did not pause a replica before sending it the current weights: under a
  ``pause_mode`` a request running on an engine that cannot be taken out of service (SGLang) kept
  generating while the weights changed under it. Now it is paused as a sync's targets are.

The transport is stubbed (it applies a real tensor to a real reference engine where one is
used): only the manager's bookkeeping and the engines' generation state run for real."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from fsdp_sync import FSDPShardingManager, SyncConfig, fleet
from fsdp_sync.models import build_model, load_config
from fsdp_sync.topology import SyncError

from _pause_engine import PauseEngine

P = [11, 27, 93, 5]


class _Eng(PauseEngine):
    """An engine's generation and service state, as the manager drives it."""

    def __init__(self, port: int):
        super().__init__()
        self.base_url = f"http://127.0.0.1:{port}"
        self.serving = True

    def set_serving(self, serving, reason=""):
        self.serving = serving
        self.log.append(("serving", serving, reason))


def _manager(engines, pause_mode="abort", **kw):
    cfg = SyncConfig(dtype=torch.float32, method="distributed", memory_probe="off",
                     pause_mode=pause_mode, **kw)
    m = FSDPShardingManager(build_model(load_config("tiny"), seed=0), engines, config=cfg)
    m._check_config = lambda engine: None
    m._check_coverage = lambda: None
    return m


def _transport(m, fail_on=None, apply=None):
    """Stub the transfer: it fails with ``fail_on`` (an engine) keeping part of the update
    while ``fail_on`` is set in ``state``; ``apply(engine)`` runs first on each target."""
    state = {"fail_on": fail_on, "calls": []}

    def sync(targets, version, step, reload=False):
        fleet.take_noted()
        state["calls"].append((version, [t.engine for t in targets], reload))
        for i, t in enumerate(targets):
            if apply is not None:
                apply(t.engine)
            if t.engine is state["fail_on"]:
                fleet.note_partial([fleet.describe(t.engine, i)])
                return SyncError(f"update failed on {t.name} after some buckets"), SimpleNamespace(commit_failed=None)
        for t in targets:
            t.version = version
        return None, None

    m._transport_sync = sync
    return state


def _replica(m, engine):
    return next(r for r in m.fleet_status()["replicas"] if r["name"] == m.fleet.find(engine).name)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pause_mode", ["abort", None])
def test_recover_before_any_commit_keeps_a_partly_new_replica_out_until_a_sync_commits(pause_mode):
    e0, e1 = _Eng(39990), _Eng(39991)
    m = _manager([e0, e1], pause_mode)
    state = _transport(m, fail_on=e1)
    with pytest.raises(SyncError, match="holds partly new weights"):
        m._sync_full()                     # the first sync: nothing committed anywhere
    assert m.version is None
    assert not _replica(m, e1)["serving"]
    served = m.recover(e1)
    rep = _replica(m, e1)
    # before: True, and e1 in service (/health 200) while its generation was paused (pause_mode)
    # or serving the mixed weights (no pause_mode)
    assert served is False and not rep["serving"] and e1.serving is False, (rep, e1.log)
    assert rep["generation_paused"] is (pause_mode is not None), rep
    if pause_mode is not None:
        assert e1.paused == "abort", e1.log
    state["fail_on"] = None                # the next sync commits everywhere and continues it
    m._sync_full()
    rep = _replica(m, e1)
    assert rep["serving"] and rep["version"] == m.version == "1" and not rep["generation_paused"], rep
    assert e1.serving is True and e1.paused is None, e1.log
    m.close()


@pytest.mark.timeout(60)
def test_recover_before_any_commit_still_reinstates_a_replica_holding_its_launch_weights():
    """What the change must not take away: a replica out of service for another reason (by hand)
    holds the weights it started with, as the others do: it serves again at once."""
    e0, e1 = _Eng(39990), _Eng(39991)
    m = _manager([e0, e1])
    m.quarantine(e1, "drained")
    assert m.recover(e1) is True and _replica(m, e1)["serving"] and e1.serving is True
    m.close()


@pytest.mark.timeout(60)
def test_remove_engine_of_a_partly_new_replica_ends_what_it_holds_and_keeps_it_off():
    e0, e1 = _Eng(39990), _Eng(39991)
    m = _manager([e0, e1])
    _transport(m, fail_on=e1)
    with pytest.raises(SyncError):
        m._sync_full()
    n = len(e1.log)
    m.remove_engine(e1)
    after = e1.log[n:]
    # before: nothing told it anything; the requests it held since waited for a continue that
    # no sync would ever send
    assert ("pause", "abort") in after and ("continue",) not in after, after
    said = [x for x in after if x[0] == "serving"]
    assert said and said[-1][1] is False and "removed from the fleet" in said[-1][2], after
    assert "partly new weights" in said[-1][2], after
    assert e1.paused == "abort"
    assert [r["name"] for r in m.fleet_status()["replicas"]] == [m.fleet.find(e0).name]
    m.close()


@pytest.mark.timeout(60)
def test_remove_engine_of_a_whole_replica_tells_it_nothing():
    e0, e1 = _Eng(39990), _Eng(39991)
    m = _manager([e0, e1])
    _transport(m)
    m._sync_full()
    n = len(e1.log)
    m.remove_engine(e1)
    assert e1.log[n:] == [] and e1.paused is None
    m.close()


def _sp(n: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


def _generate(engine, out: dict, n: int, steps: list | None = None) -> threading.Thread:
    on_step = None if steps is None else (lambda changes: steps.append(time.monotonic()))
    th = threading.Thread(target=lambda: out.setdefault("r", engine.generate_requests(
        [P], _sp(n), on_step=on_step)[0]), daemon=True)
    th.start()
    return th


def _no_switch(eng):
    """An engine that cannot be taken out of service (a real SGLang server: set_serving raises)."""
    def set_serving(serving, reason=""):
        raise RuntimeError("this server has no /fsdp_sync/set_serving (simulated SGLang)")
    eng.set_serving = set_serving


@pytest.mark.timeout(120)
def test_requests_held_by_a_removed_partly_new_replica_come_back_aborted():
    """A real reference engine that cannot be taken out of service (as SGLang): the failed sync
    paused it (abort); a request sent to it afterwards waits. remove_engine used to leave it
    waiting forever; now it comes back aborted and generation stays paused there."""
    from fsdp_sync.engines import ReferenceEngine

    cfg = load_config("tiny")
    with ReferenceEngine(cfg, tp_size=1, kv_cache_tokens=256, call_timeout_s=30) as eng:
        _no_switch(eng)
        e0 = _Eng(39990)
        m = _manager([e0, eng])
        _transport(m, fail_on=eng)
        with pytest.raises(SyncError):
            m._sync_full()
        assert eng.generation_paused == "abort"
        out: dict = {}
        th = _generate(eng, out, 3)
        time.sleep(1.0)
        assert "r" not in out                   # held: generation is paused there
        m.remove_engine(eng)
        th.join(10)
        try:
            assert "r" in out, "the held request still waits after remove_engine"   # before
            assert out["r"]["finish_reason"]["type"] == "abort", out["r"]
            assert eng.generation_paused == "abort"     # still off the partly new weights
        finally:
            eng.continue_generation()           # let a waiting thread end before the engine closes
            th.join(10)
        m.close()


@pytest.mark.timeout(60)
def test_a_failed_add_engine_says_the_replica_is_let_go_not_brought_back():
    """add_engine's transfer failed partway: the replica was stalled (requests aborted, paused)
    and dropped from the fleet, but the error said "the next sync brings it back" (no sync ever
    would: nothing was to continue it) and the engine kept the reason "joining". Now the error and
    the engine's out-of-service reason say it was let go holding partly new weights and what to
    do; adding it again still brings it to the current version and continues it."""
    e0, new = _Eng(39990), _Eng(39991)
    m = _manager([e0])
    m.version, m._inside, m.step = "0", True, 1     # inside the block: add_engine sends now
    state = _transport(m, fail_on=new)
    with pytest.raises(SyncError, match="not added to the fleet") as info:
        m.add_engine(new)
    text = f"{info.value} {getattr(info.value, '__notes__', '')}"
    assert "next sync brings it back" not in text, text                 # before: said so
    assert "removed from the fleet (add_engine) holding partly new weights" in text, text
    assert "add_engine it again" in text and "requests were aborted" in text, text
    said = [x for x in new.log if x[0] == "serving"]
    assert said[-1][1] is False and "removed from the fleet" in said[-1][2], new.log   # before: 'joining'
    assert new.paused == "abort" and not any(r.engine is new for r in m.fleet.replicas)
    state["fail_on"] = None
    assert m.add_engine(new) is True
    assert new.paused is None and new.serving is True, new.log
    m._inside = False
    m.close()


@pytest.mark.timeout(60)
def test_an_adapter_rejoin_whose_base_failed_partway_keeps_generation_off_it(monkeypatch):
    """lora="adapter": an adapter-only sync brings a replica out of service back with the base
    first (`lora_stage.rejoin`, the transport's reload). That reload failing after the replica
    took part of it only kept it out of service: under a pause_mode its generation ran on (an
    engine that cannot be taken out of service, SGLang, answered from the mixed base) and
    fleet_status() did not say it was paused. Now it is stalled as after any failed transfer."""
    from fsdp_sync import lora_stage
    from fsdp_sync.cli.lora_model import ALL_LINEAR, add_lora

    e0, e1 = _Eng(39990), _Eng(39991)
    cfg = SyncConfig(dtype=torch.float32, method="distributed", memory_probe="off",
                     pause_mode="abort", lora="adapter")
    module = add_lora(build_model(load_config("tiny"), seed=0), 4, 8, ALL_LINEAR, seed=1)
    m = FSDPShardingManager(module, [e0, e1], config=cfg)
    rep = m.fleet.find(e1)
    m.fleet.quarantine(rep, "restarted")
    rep.rejoin = True
    monkeypatch.setattr(lora_stage, "check_engine", lambda *a, **k: None)
    _transport(m, fail_on=e1)
    lora_stage.rejoin(m, [rep], "3", {"cfg": {}, "metas": [], "tensors": {}, "shared": None})
    got = _replica(m, e1)
    assert not got["serving"], got
    assert got["generation_paused"] and e1.paused == "abort", (got, e1.log)   # before: None
    assert rep.partial
    m.close()


@pytest.mark.timeout(60)
def test_recover_after_a_first_commit_that_failed_on_one_replica_does_not_serve_launch_weights():
    """Under "abort" the first sync's commit failed on e1 after e0 committed version '0': e0
    serves '0', the manager's version stays None (`fleet.Fleet.held`). recover(e1) took "nothing
    committed yet" from the manager's None and put e1 back in service on its launch weights beside
    e0 on '0': two weight sets in service. Now it sees what the replicas in service hold and
    brings e1 in at the next sync (outside the block, the distributed method)."""
    from fsdp_sync.fleet import CommitError

    e0, e1 = _Eng(39990), _Eng(39991)
    m = _manager([e0, e1])
    calls = []

    def commit_fails_on_e1(targets, version, step, reload=False):
        fleet.take_noted()
        calls.append(version)
        if len(calls) == 1:
            ctx = SimpleNamespace(commit_failed=CommitError([0], {1: RuntimeError("reset")}, version))
            return SyncError("commit failed on replica 1"), ctx
        return None, None

    m._transport_sync = commit_fails_on_e1
    with pytest.raises(SyncError, match="committing cannot be undone"):
        m._sync_full()
    assert m.version is None and _replica(m, e0)["version"] == "0" and not _replica(m, e1)["serving"]
    assert m.recover(e1) is False                      # before: True, serving next to e0 on '0'
    assert not _replica(m, e1)["serving"] and e1.serving is False, e1.log
    m._sync_full()
    assert [(r["serving"], r["version"]) for r in m.fleet_status()["replicas"]] == [(True, "1")] * 2
    m.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pause_mode", ["abort", None])
def test_a_let_go_replica_added_again_before_any_commit_waits_for_a_sync_that_commits(pause_mode):
    """`remove_engine` lets a partly new replica go and says "add_engine it again"; before any
    commit there is no version to load it with. Before (R6 review), ``add_engine`` made a fresh
    replica record (not partial) and put it in service at once: /health 200 on the mixed weights,
    with its generation still paused (every request hung) under a ``pause_mode``. Now it stays
    out until the next sync commits, which sends it that version and continues its generation."""
    e0, e1 = _Eng(39990), _Eng(39991)
    m = _manager([e0, e1], pause_mode)
    state = _transport(m, fail_on=e1)
    with pytest.raises(SyncError):
        m._sync_full()                     # the first sync: e1 keeps part of it, nothing committed
    m.remove_engine(e1)
    assert e1.serving is False and e1.paused == ("abort" if pause_mode else None), e1.log
    state["fail_on"] = None
    assert m.add_engine(e1) is False       # before: True, nothing sent
    rep = _replica(m, e1)
    assert not rep["serving"] and e1.serving is False, (rep, e1.log)
    assert rep["generation_paused"] is (pause_mode is not None), rep
    assert len(state["calls"]) == 1        # nothing sent to it yet
    m._sync_full()                         # commits everywhere: e1 gets the version and continues
    assert e1 in state["calls"][-1][1]
    rep = _replica(m, e1)
    assert rep["serving"] and rep["version"] == m.version and not rep["generation_paused"], rep
    assert e1.serving is True and e1.paused is None, e1.log
    m.close()
