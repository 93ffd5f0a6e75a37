"""H84's audit of `fsdp-sync serve`'s payload routes and the fleet's add_engine (stop 78).

- (1) ``/load_lora_adapter_from_tensors`` (and every route through `http_fields.opened_payloads`)
  with untagged payloads (SGLang's format), one that cannot be opened before one that can:
  before, the second was never opened, so the reference its pickling took for this consumer
  stayed and its /dev/shm segment outlived the sender's tensors (one per failed load, until the
  sender's process exited). H83 fixed the tensor route with a copy of its own; now
  `opened_payloads` opens every payload, then refuses, and both routes use it.
- (2) ``add_engine`` refused (its config, or the ranks' stage settings differing): before, trainer
  rank 0 had already told the engine ``set_serving(False, "joining: ...")`` and never told it
  back: `fsdp-sync serve` answered 503 "joining" until restarted. Now the engine is told it is
  joining only once the add is not refused: a refused one is left as it was found.
"""

from __future__ import annotations

import base64

import pytest
import torch

from fsdp_sync import FSDPShardingManager, SyncConfig
from fsdp_sync.topology import SyncError

from test_h83_serve_fleet import _cfg, _segments, _Served, _two_ranks

pytestmark = pytest.mark.timeout(60)


# --------------------------------------------------------------------------- (1)

def test_h84_lora_tensors_behind_one_that_cannot_be_opened_leave_no_segment():
    from fsdp_sync.engines.reference.http_fields import Refused
    from fsdp_sync.engines.reference.serve import EngineServer
    from fsdp_sync.weights import handles

    class TwoRanks:
        tp_size, calls, lora_adapters = 2, [], {}

        def load_lora_adapter_from_tensors(self, name, named, config, load_format=None):
            self.calls.append(name)

    before = _segments()
    srv = EngineServer(TwoRanks())        # the route itself (no HTTP: its answer is the Refused)
    try:
        for _ in range(3):
            s = handles.make_payloads([("a.lora_A.weight", torch.ones(64))], 1, output_str=True,
                                      tagged=False)
            bad = base64.b64encode(b"not a pickle").decode()
            with pytest.raises(Refused, match=r"^serialized_named_tensors\[0\]: ") as info:
                srv._load_lora_from_tensors({"lora_name": "A", "config_dict": {"r": 4},
                                             "serialized_named_tensors": [bad, s.payloads[0]]})
            assert info.value.status == 400, info.value
            s.release(require_ack=False)       # the sender lets go, as SGLang's client does
            del s
    finally:
        srv.close()
    assert TwoRanks.calls == []
    assert _segments() - before == set()       # before: one segment per failed load


# --------------------------------------------------------------------------- (2)

def test_h84_add_engine_refused_for_its_config_leaves_the_engine_serving():
    """Before: the engine answered 503 "joining: waiting for the current weights" for good."""
    cfg = SyncConfig(dtype=torch.float32, method="distributed", memory_probe="off")
    m = FSDPShardingManager(torch.nn.Linear(2, 2), [_Served(39960)], config=cfg)
    new = _Served(39961)

    def check(engine):
        if engine is new:
            raise ValueError("its tp_size 3 does not split this model (simulated)")

    m._check_config = check
    try:
        with pytest.raises(SyncError, match="is refused, before anything was sent.*tp_size 3"):
            m.add_engine(new)
        assert new.state is None, new.state
        assert new not in m.fleet.engines
    finally:
        m.close()


def test_h84_add_engine_refused_for_differing_stage_settings_leaves_the_engine_serving(monkeypatch):
    new = _Served(39962)
    out = _two_ranks(monkeypatch, [_cfg(pause_mode="abort"), _cfg()],
                     [lambda m: m.add_engine(new), lambda m: m.add_engine(None)])
    assert out[0] == out[1] and out[0][0] == "raised", out
    assert "SyncConfig.pause_mode is 'abort' on rank 0, None on rank 1" in out[0][1], out
    assert new.state is None, new.state         # before: "joining: waiting for the current weights"


def test_h84_add_engine_whose_load_failed_is_told_why_it_is_out_not_joining(tmp_path):
    """A replica told it was joining whose load of the current weights failed, keeping none of
    them (a TP-2 server offered per-rank files cut for TP 1): before, it answered 503 "joining:
    waiting for the current weights" until restarted, though nothing would bring it in."""
    cfg = SyncConfig(dtype=torch.float32, method="disk", disk_dir=str(tmp_path), memory_probe="off")
    m = FSDPShardingManager(torch.nn.Linear(2, 2), [_Served(39963)], config=cfg)
    m._check_config = lambda engine: None
    m.version, m.fleet.replicas[0].version = "1", "1"
    m._transport_sync = lambda targets, version, step, reload=False: (
        SyncError("replica 1: load_format refused: 2 TP ranks, the files hold 1 (simulated)"), None)
    new = _Served(39964)
    try:
        with pytest.raises(SyncError, match="files hold 1.*it was not added to the fleet"):
            m.add_engine(new)
        assert new not in m.fleet.engines
        assert new.state.startswith("not added to the fleet: add_engine failed (SyncError: "), new.state
        assert "files hold 1" in new.state and "add_engine it again" in new.state, new.state
    finally:
        m.close()
