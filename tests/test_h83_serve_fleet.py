"""H83's audit of the fleet and `fsdp-sync serve` under production use (stop 78).

- (a) A replica brought back into service whose ``set_serving(True)`` failed (a connection reset
  on its way to `fsdp-sync serve`): before, it was only logged; the server kept answering 503
  with the quarantine's reason while ``fleet_status()`` said it served with no reason, and no later
  sync told it again: a replica lost to the router for good, silently. Now each sync that commits
  there tells it again until it takes it, and ``fleet_status()`` gives why meanwhile.
- (b) ``method="tensor"`` with a pause_mode: an engine whose commit failed after every call went
  through (SGLang applied each call as it came; its post-processing or the version's naming
  failed) holds weights no version names. Before, the failed sync's ``continue_generation``
  reached it: it answered from those weights under the old version. Now it is held as a fleet
  replica whose commit failed is (`manager_pause.stall`): its requests aborted, generation
  paused until a sync commits there.
- (d) ``/update_weights_from_tensor`` with untagged payloads (SGLang's format), one that cannot be
  opened before one that can: before, the second was never opened, so the reference its pickling
  took for this consumer stayed and its /dev/shm segment outlived the sender's tensors (one per
  failed update, until the sender's process exited). Now every payload is opened, then acked.
"""

from __future__ import annotations

import base64
import os
from types import SimpleNamespace

import pytest
import torch

from fsdp_sync import FSDPShardingManager, SyncConfig, fleet

from _pause_engine import PauseEngine

pytestmark = pytest.mark.timeout(60)


# --------------------------------------------------------------------------- (a)

class _Served(PauseEngine):
    """`fsdp-sync serve` as the fleet sees it: out of service with a reason, or serving; its
    first ``set_serving(True)`` fails as a reset connection does."""

    def __init__(self, port: int, fail_back: int = 0):
        super().__init__()
        self.base_url, self.state, self.fail_back = f"http://127.0.0.1:{port}", None, fail_back

    def set_serving(self, serving, reason=""):
        if serving and self.fail_back:
            self.fail_back -= 1
            raise ConnectionResetError("connection reset by peer (simulated)")
        self.state = None if serving else reason


def _fleet_manager(engines, **kw):
    cfg = SyncConfig(dtype=torch.float32, method="distributed", memory_probe="off", **kw)
    m = FSDPShardingManager(torch.nn.Linear(2, 2), engines, config=cfg)    # (the sync is stubbed)
    m._check_config = lambda engine: None
    m._check_coverage = lambda: None

    def sync(targets, version, step, reload=False):
        fleet.take_noted()
        return None, SimpleNamespace(commit_failed=None)

    m._transport_sync = sync
    return m


def test_a_replica_that_could_not_be_told_it_serves_again_is_told_at_the_next_sync():
    e0, e1 = _Served(39970), _Served(39971, fail_back=1)
    m = _fleet_manager([e0, e1], on_replica_failure="quarantine")
    m._sync_full()
    m.quarantine(e1, "drained by hand")
    assert e1.state == "drained by hand"
    assert m.recover(e1) is False          # outside the with block: the next sync brings it in
    m._sync_full()                         # its set_serving(True) is reset on the way
    rep = m.fleet_status()["replicas"][1]
    assert rep["serving"] and rep["version"] == "1", rep
    assert e1.state == "drained by hand"   # the server still refuses requests (503) ...
    assert "ConnectionResetError" in (rep["reason"] or "") and "next sync" in rep["reason"], rep
    m._sync_full()                         # ... until a sync tells it again (before: never)
    assert e1.state is None, e1.state
    rep = m.fleet_status()["replicas"][1]
    assert rep["serving"] and rep["reason"] is None and rep["version"] == "2", rep
    m.close()


# --------------------------------------------------------------------------- (b)

@pytest.mark.parametrize("threaded", [False, True], ids=["alone", "in-a-thread"])
def test_a_tensor_engine_whose_commit_failed_is_held_not_continued(one_rank, monkeypatch, threaded):
    """``in-a-thread``: the commit runs in a thread of its own, as it does wherever the group has
    peers (`topology.agree_after_each`: the others hear each second that it still runs); the
    replica it names must reach the manager's thread (before: noted in the worker thread's own
    store, lost, the engine continued)."""
    import fake_sglang as fake
    from fsdp_sync import topology
    from fsdp_sync.engines import sglang as sg
    from fsdp_sync.topology import SyncError, make_mesh

    if threaded:    # a one-rank world works alone; take the path a world with peers takes
        monkeypatch.setattr(topology, "_agree_alone", lambda work, group, what: topology._wait_for_work(
            work, group, what, 1.0, lambda flag, flags: None))

    class Failing(fake.PausingFakeSGLangEngine):
        def end_weight_update(self):
            ok, msg = super().end_weight_update()     # applied as it came: nothing to drop
            if self.fail_commit:
                self.fail_commit -= 1
                return False, "process_weights_after_loading failed (simulated)"
            return ok, msg

    eng = Failing(tp_size=1)
    eng.fail_commit = 1
    cfg = SyncConfig(dtype=torch.float32, method="tensor", memory_probe="off", pause_mode="abort",
                     free_cache_engine=False)
    torch.manual_seed(0)
    m = FSDPShardingManager(torch.nn.Linear(4, 4), sg.SGLangEngine(eng), mesh=make_mesh(1, 1), config=cfg)
    try:
        with pytest.raises(SyncError, match="simulated") as info:
            with m:
                pass
        notes = "".join(getattr(info.value, "__notes__", []))
        # before: continue_generation went to it after the failed commit (paused None)
        assert eng.paused == "abort" and "continue_generation" not in eng.names(), eng.names()
        assert "holds partly new weights" in notes and "paused" in notes, notes
        assert m.fleet_status()["replicas"][0]["generation_paused"], m.fleet_status()
        assert m.version is None
        with m:                            # the next sync commits there and continues it
            pass
        assert eng.paused is None and m.version == "1", (eng.names(), m.version)
    finally:
        m.close()


# --------------------------------------------------------------------------- (d)

def _segments() -> set[str]:
    """This process's torch segments (other test processes make their own meanwhile)."""
    return {f for f in os.listdir("/dev/shm") if f.startswith(f"torch_{os.getpid()}_")}


def test_untagged_payloads_behind_one_that_cannot_be_opened_leave_no_segment():
    from fsdp_sync.engines.reference.http_fields import Refused
    from fsdp_sync.engines.reference.serve import EngineServer
    from fsdp_sync.weights import handles

    class TwoRanks:
        tp_size, calls = 2, []

        def update_weights_from_tensor(self, named, load_format=None, flush_cache=True):
            self.calls.append("update")

    before = _segments()
    srv = EngineServer(TwoRanks())        # the route itself (no HTTP: its answer is the Refused)
    try:
        for _ in range(2):
            s = handles.make_payloads([("a", torch.ones(64))], 1, output_str=True, tagged=False)
            bad = base64.b64encode(b"not a pickle").decode()
            with pytest.raises(Refused, match="^payload 0: ") as info:
                srv._update_from_tensor({"serialized_named_tensors": [bad, s.payloads[0]],
                                         "load_format": "direct"})
            assert info.value.status == 400, info.value
            s.release(require_ack=False)       # the sender lets go, as SGLang's client does
            del s, info
    finally:
        srv.close()
    assert TwoRanks.calls == []
    assert _segments() - before == set()       # before: one segment per failed update


# --------------------------------------------------------------------------- (c)

def _two_ranks(monkeypatch, configs, calls):
    """``calls[r](manager)`` on two threads as trainer ranks 0 and 1 (rank 1 holds no replica),
    the process group's object collectives answered as a two-rank group's: what each returned or
    raised."""
    import threading

    import torch.distributed as dist

    from fsdp_sync import manager as manager_mod
    from fsdp_sync.fleet import Fleet

    barrier = threading.Barrier(2, timeout=20)      # (a rank left alone in one: a hang, cut short)
    me, boxes = threading.local(), [None, None]

    def exchange(obj):
        boxes[me.rank] = obj
        barrier.wait()
        got = list(boxes)
        barrier.wait()
        return got

    def all_gather_object(out, obj, group=None):
        out[:] = exchange(obj)

    def broadcast_object_list(box, src=0, group=None):
        box[0] = exchange(box[0])[src]

    managers = []
    for r, cfg in enumerate(configs):
        m = FSDPShardingManager(torch.nn.Linear(2, 2), _Served(39960), config=cfg)
        if r == 1:
            m.rank, m.fleet = 1, Fleet([])
        m._check_config = lambda engine: None
        managers.append(m)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(dist, "broadcast_object_list", broadcast_object_list)
    monkeypatch.setattr(manager_mod, "cpu_group", lambda group=None: None)
    out = [None, None]

    def run(r, m):
        me.rank = r
        try:
            out[r] = ("returned", calls[r](m))
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            out[r] = ("raised", f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run, args=(r, m)) for r, m in enumerate(managers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _cfg(**kw):
    return SyncConfig(dtype=torch.float32, method="distributed", memory_probe="off", **kw)


def test_recover_before_any_with_block_compares_the_ranks_stage_settings(monkeypatch):
    """Before: nothing compared them; each rank went on with its own pause_mode (both returned)."""
    out = _two_ranks(monkeypatch, [_cfg(pause_mode="abort"), _cfg()],
                     [lambda m: m.recover(m.fleet.engines[0]), lambda m: m.recover(None)])
    assert out[0] == out[1] and out[0][0] == "raised", out
    assert "SyncConfig.pause_mode is 'abort' on rank 0, None on rank 1" in out[0][1], out


def test_add_engine_refused_on_rank_0_is_refused_on_every_rank(monkeypatch):
    """Before: rank 0 raised its ValueError alone; rank 1 waited in the decision's broadcast
    until the process group's timeout (here the stand-in's barrier, cut short)."""
    out = _two_ranks(monkeypatch, [_cfg(), _cfg()], [lambda m: m.add_engine(None)] * 2)
    for kind, text in out:
        assert kind == "raised" and "trainer rank 0 passes the engine" in text, out


def test_an_abort_on_an_engine_that_applies_calls_as_they_come_says_what_it_holds():
    """Before: the abort's answer said the engine "serves nothing until every tensor is pushed
    again" (the words for weights written over in place), of a ReferenceEngine with
    transactional_updates=False, which goes on serving its partly new weights under the old
    version (seen in H83's audit of a failed fleet sync over HTTP)."""
    from fsdp_sync.engines.reference.serve import EngineServer

    class Applies:
        tp_size, transactional_updates = 1, False

        def end_weight_update(self, *, abort=False, weight_version=None):
            return False         # closed; what it had applied stays

    srv = EngineServer(Applies())
    try:
        status, out = srv._end_weight_update({"abort": True})
    finally:
        srv.close()
    assert status == 200 and out["aborted"] is False, out
    assert "partly new weights" in out["message"] and "serves nothing" not in out["message"], out
