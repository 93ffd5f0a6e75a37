"""A fleet replica whose commit failed after the others committed (H75, item "abort-mode
commit-failed replica without set_serving keeps serving").

What such a replica holds is no version the fleet agreed on: SGLang applied every bucket as it
came and its commit (post-processing, or naming the weights: `fleet.VersionNotNamed`) failed, so
it holds the new weights under the old name, or weights half post-processed; a reference engine
may have dropped the update (the old version, beside replicas serving the new one). It is
quarantined, but a real SGLang server cannot be told so (``set_serving`` raises): the router
keeps sending it requests. Before, under a ``pause_mode`` the sync's ``continue_generation`` went
to it as to the replicas that committed, so a router's client got answers from it: tokens of the
new weights labelled with the old version next to answers labelled with the new one. Now it is
held as a replica that kept part of a failed update is (`manager_pause.stall`): its requests come
back aborted and its generation stays paused until a sync commits there, which continues it.

The transport is stubbed; the manager's bookkeeping and the engines' pause state run for real."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fsdp_sync import FSDPShardingManager, SyncConfig, fleet
from fsdp_sync.models import build_model, load_config
from fsdp_sync.topology import SyncError

from _pause_engine import PauseEngine

pytestmark = pytest.mark.timeout(60)


class _SGLangLike(PauseEngine):
    """A replica that cannot be taken out of service (a real SGLang server: set_serving raises)."""

    def __init__(self, port: int):
        super().__init__()
        self.base_url = f"http://127.0.0.1:{port}"

    def set_serving(self, serving, reason=""):
        raise RuntimeError("this server has no /fsdp_sync/set_serving (simulated SGLang)")


def _manager(engines, pause_mode, on_replica_failure):
    cfg = SyncConfig(dtype=torch.float32, method="distributed", memory_probe="off",
                     pause_mode=pause_mode, on_replica_failure=on_replica_failure)
    m = FSDPShardingManager(build_model(load_config("tiny"), seed=0), engines, config=cfg)
    m._check_config = lambda engine: None
    m._check_coverage = lambda: None
    calls = []

    def sync(targets, version, step, reload=False):   # the first sync's commit fails on replica 1
        fleet.take_noted()
        calls.append([t.engine for t in targets])
        if len(calls) == 1:
            failed = fleet.VersionNotNamed("its new weights are committed, but naming them failed")
            ctx = SimpleNamespace(commit_failed=fleet.CommitError([0], {1: failed}, version))
            return SyncError("committing the update: engine 1 failed"), ctx
        return None, None

    m._transport_sync = sync
    return m, calls


def _replica(m, i):
    return m.fleet_status()["replicas"][i]


@pytest.mark.parametrize("on_replica_failure", ["abort", "quarantine"])
@pytest.mark.parametrize("pause_mode", ["abort", "in_place"])
def test_a_replica_whose_commit_failed_is_not_continued_until_a_sync_commits_there(pause_mode, on_replica_failure):
    e0, e1 = _SGLangLike(39980), _SGLangLike(39981)
    m, calls = _manager([e0, e1], pause_mode, on_replica_failure)
    if on_replica_failure == "abort":
        with pytest.raises(SyncError, match="committing cannot be undone") as info:
            m._sync_full()
        assert "replica 1 (http://127.0.0.1:39981) holds partly new weights" in "".join(
            getattr(info.value, "__notes__", [])), info.value
    else:
        m._sync_full()                     # the others committed: no error
    assert e0.paused is None and _replica(m, 0)["version"] == "0", e0.log       # committed: continued
    # before: continue_generation reached e1 too (paused None): it answered from weights no
    # version names, beside e0 on '0'
    assert e1.paused == "abort", e1.log
    assert e1.log[-1] == ("pause", "abort") and ("continue",) not in e1.log, e1.log
    rep = _replica(m, 1)
    assert not rep["serving"] and rep["generation_paused"], rep
    m._sync_full()                         # the next sync takes it back and continues it
    assert calls[-1] == [e0, e1], calls
    assert e1.paused is None and e0.paused is None, (e0.log, e1.log)
    assert [(r["serving"], r["version"], r["generation_paused"]) for r in m.fleet_status()["replicas"]] \
        == [(True, "1", False)] * 2
    assert m.version == "1"
    m.close()


def test_without_a_pause_mode_the_error_says_the_replica_still_answers_requests():
    """No ``pause_mode``: nothing is paused, so nothing can hold such a replica's requests. The
    error must not only say "quarantined" (the router still sends to it): it says it could not be
    taken out of service, and to take it out of the router's rotation."""
    e0, e1 = _SGLangLike(39980), _SGLangLike(39981)
    m, _ = _manager([e0, e1], None, "abort")
    with pytest.raises(SyncError) as info:
        m._sync_full()
    text = str(info.value) + "".join(getattr(info.value, "__notes__", []))
    assert "could not be taken out of service" in text and "router" in text, text
    assert e1.log == [] and e0.log == []
    m.close()


@pytest.mark.parametrize("pause_mode", ["abort", None])
def test_a_replica_that_cannot_be_told_it_serves_again_rejoins_without_failing_the_sync(pause_mode):
    """A real SGLang replica found dead before a sync is quarantined (``set_serving`` raises: only
    logged). Restarted, it rejoins at the next sync, which commits on both; putting it back in
    service (`Fleet.reinstate`) called ``set_serving(True)`` unguarded, so that sync raised after
    the commit: manager.version stayed old, every replica stayed paused under a ``pause_mode``,
    and every later sync failed the same way. Likewise ``recover`` of one quarantined by hand."""
    e0, e1 = _SGLangLike(39980), _SGLangLike(39981)
    m, calls = _manager([e0, e1], pause_mode, "quarantine")
    calls.append("the first sync's commit failure is not wanted here")
    down = {"now": True}

    def version():
        if down["now"]:
            raise ConnectionError("connection refused")
        return "default"

    e1.get_weight_version = version
    m._sync_full()                          # e1 out before anything is sent; e0 commits '0'
    assert calls[-1] == [e0] and not _replica(m, 1)["serving"]
    down["now"] = False                     # restarted
    m._sync_full()                          # before: RuntimeError from set_serving(True)
    assert calls[-1] == [e0, e1] and m.version == "1"
    assert [(r["serving"], r["version"]) for r in m.fleet_status()["replicas"]] == [(True, "1")] * 2
    assert e0.paused is None and e1.paused is None, (e0.log, e1.log)
    m.close()


def test_recover_of_a_replica_that_cannot_be_told_puts_it_back_in_service():
    """Before any commit, ``recover`` of a replica taken out by hand puts it back as it is; one
    that has no service switch (SGLang) made ``recover`` raise and stay out of the fleet's syncs."""
    e0, e1 = _SGLangLike(39980), _SGLangLike(39981)
    m, _ = _manager([e0, e1], "abort", "abort")
    m.quarantine(e1, "drained")
    assert not _replica(m, 1)["serving"]
    assert m.recover(e1) is True and _replica(m, 1)["serving"]      # before: RuntimeError
    m.close()


def test_a_dead_replica_whose_commit_failed_is_not_said_to_answer_requests():
    """The note that a router still sends it requests is for a replica that answers; one found
    dead (its probe fails) is named by the commit's error alone."""
    e0, e1 = _SGLangLike(39980), _SGLangLike(39981)

    def dead():
        raise ConnectionError("connection refused")

    m, _ = _manager([e0, e1], None, "abort")
    e1.get_weight_version = dead
    with pytest.raises(SyncError) as info:
        m._sync_full()
    text = str(info.value) + "".join(getattr(info.value, "__notes__", []))
    assert "committing cannot be undone" in text and "could not be taken out of service" not in text, text
    m.close()
