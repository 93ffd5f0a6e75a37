"""An adapter-only sync (`SyncConfig(lora="adapter")`) into a fleet brings a replica out of service
back in (`lora_stage.rejoin`): its base, bucket by bucket, then the adapter. Only the replicas in
service were paused, and continued before the rejoin began: a server a client reaches directly (a
real SGLang server: it cannot be told it is out of service, and applies each update call as it
arrives) served a request started between two of those calls on partly new weights. Under a
``pause_mode`` the rejoining replica is now paused before its base is sent and continued once it
holds base and adapter (as `manager_fleet.send` does for `recover` / `add_engine`); after a
failure it is continued if it kept its old weights, kept paused if it took part of the base.

The racing case: a reference engine that applies each call at once (``transactional_updates=
False``) and ignores being taken out of service (``set_serving`` a no-op), a request started right
after the first update call of its rejoin; its greedy tokens must be those of the old weights or
the new, never of a mix (tests/test_h10_bring_in_pause.py's harness). The rest: stub engines,
`lora_stage.rejoin` called directly, the pause bookkeeping per outcome.
"""

from __future__ import annotations

import pytest
import torch

from _pause_engine import PauseEngine
from test_h10_bring_in_pause import _direct, _served, _tokens

pytestmark = pytest.mark.timeout(120)


def test_a_request_racing_an_adapter_syncs_rejoin_sees_one_whole_version(monkeypatch):
    """One replica: synced (base and adapter), taken out of service, restarted on other weights
    (its launch weights, as a supervisor restarts a server), brought back by the next
    adapter-only sync while a request reaches it directly."""
    from fsdp_sync import FSDPShardingManager, SyncConfig
    from fsdp_sync.cli.lora_model import add_lora
    from fsdp_sync.engines.reference import ReferenceEngine
    from fsdp_sync.models import build_model, load_config

    model = add_lora(build_model(load_config("tiny"), seed=3), r=4, alpha=8, seed=1)
    launch = build_model(load_config("tiny"), seed=9)
    with ReferenceEngine("tiny", tp_size=1, kv_cache_tokens=64, max_lora_rank=8, call_timeout_s=20,
                         update_recv_timeout_s=10, transactional_updates=False) as c:
        m = FSDPShardingManager(model, [c], config=SyncConfig(
            method="distributed", bucket_bytes=64 << 10, layout="full", dist_timeout_s=30.0,
            lora="adapter", lora_name="L", pause_mode="abort", verify="off"))
        try:
            with m:                       # base and adapter
                pass
            new, served, before = _tokens(c), _served(c), c.lora_tensors("L")
            seen = _direct(monkeypatch, c)       # reached directly: out of service is not enforced
            m.quarantine(c, "drained")
            c.update_weights_from_tensor(list(launch.state_dict().items()), weight_version="default")
            old = _tokens(c)
            assert m.recover(c) is False      # outside the block: the next sync brings it in
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if ".lora_B." in n:
                        p.add_(0.5)
            with m:                       # the adapter alone; the replica rejoins: base, adapter
                pass
            assert m.fleet_status()["replicas"][0]["serving"], m.fleet_status()
            seen["thread"].join(30)
            assert not seen["thread"].is_alive(), "the racing request never ended"
            assert len(seen["paused"]) > 1, f"one update call: nothing to race ({seen['paused']})"
            assert old != new, "the versions generate the same tokens: the test could not tell a mix"
            assert seen["tokens"] in (old, new), (
                f"a request started during the rejoin generated {seen['tokens']}: neither the old "
                f"weights' {old} nor the new ones' {new} (partly new weights)")
            assert seen["paused"] == ["abort"] * len(seen["paused"]), seen["paused"]
            assert c.generation_paused is None, "generation left paused after the rejoin"
            assert _served(c) == served and _tokens(c) == new
            got = c.lora_tensors("L")     # the new adapter: lora_B moved by 0.5, lora_A as it was
            assert got.keys() == before.keys() and any("lora_B" in k for k in got)
            assert all(torch.equal(got[k], before[k] + 0.5 if "lora_B" in k else before[k]) for k in got)
            assert c.weight_version == m.version == "1"
        finally:
            monkeypatch.undo()
            m.close()


class _Eng(PauseEngine):
    """An engine stub: only the pause bookkeeping and the calls of a rejoin run for real."""

    base_url = "http://127.0.0.1:39997"

    def __init__(self, fail_load=False, fail_pause=False):
        super().__init__()
        self.version = "0"
        self.fail_load, self.fail_pause = fail_load, fail_pause

    def get_weight_version(self):
        return self.version

    def update_weight_version(self, version):
        self.version = version

    def load_lora_adapter_from_tensors(self, name, tensors, cfg):
        if self.fail_load:
            raise RuntimeError("the adapter load failed")
        self.log.append(("load", self.paused))

    def pause_generation(self, mode="abort"):
        if self.fail_pause:
            raise RuntimeError("cannot pause")
        super().pause_generation(mode)


def _stubbed(pause_mode, outcome):
    """A manager at version "0" with one replica in service and one out of service (rejoin set);
    its transport ``outcome`` for the rejoiner: "ok", "refused" (nothing kept), "partial" (it kept
    part), "interrupt", "adapter" (the base went in, the adapter load failed), "pause" (its
    pause_generation fails)."""
    from fsdp_sync import FSDPShardingManager, SyncConfig, fleet
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncError

    cfg = SyncConfig(dtype=torch.float32, method="distributed", memory_probe="off", pause_mode=pause_mode,
                     verify="off", on_replica_failure="quarantine")
    new = _Eng(fail_load=outcome == "adapter", fail_pause=outcome == "pause")
    m = FSDPShardingManager(build_model(load_config("tiny"), seed=0), [_Eng(), new], config=cfg)
    m.version, m.step, m.lora_base = "0", 1, {}
    rep = m.fleet.replicas[1]
    m.fleet.quarantine(rep, "drained")
    rep.rejoin = True

    def fake_sync(targets, version, step, reload=False):
        fleet.take_noted()
        assert reload and [r.engine.paused for r in targets] == [pause_mode] * len(targets), "sent unpaused"
        new.log.append(("base", new.paused))
        if outcome == "partial":
            fleet.note_partial([fleet.describe(targets[0].engine, 0)])
        if outcome == "interrupt":
            raise KeyboardInterrupt
        return (SyncError("update_weights_from_distributed failed")
                if outcome in ("refused", "partial") else None), None

    m._transport_sync = fake_sync
    return m, rep, new


@pytest.mark.parametrize("outcome", ["ok", "refused", "partial", "interrupt", "adapter", "pause"])
@pytest.mark.parametrize("pause_mode", [None, "retract"])
def test_rejoin_pauses_under_pause_mode_and_leaves_paused_only_partly_new(pause_mode, outcome):
    """Under a pause_mode the rejoiner is paused before its base is sent; continued once it holds
    base and adapter (back in service), or after a failure that left it whole; kept paused (its
    requests aborted) when it took part of the base. A failed pause sends nothing and keeps it
    out. Without a pause_mode it is never paused (as a sync's replicas)."""
    from fsdp_sync import lora_stage

    m, rep, new = _stubbed(pause_mode, outcome)
    adapter = {"tensors": {"a": torch.zeros(2)}, "cfg": {"r": 4, "target_modules": ["q_proj", "v_proj"]}, "metas": []}
    try:
        if outcome == "interrupt":
            with pytest.raises(KeyboardInterrupt):
                lora_stage.rejoin(m, [rep], "1", adapter)
        else:
            lora_stage.rejoin(m, [rep], "1", adapter)
        ok = outcome == "ok" or (outcome == "pause" and pause_mode is None)    # (nothing to pause)
        assert rep.serving is ok, rep.reason
        assert (new.version == "1") is ok
        if outcome == "pause" and pause_mode is not None:
            assert "cannot pause" in rep.reason and [e for e in new.log if e[0] == "base"] == [], new.log
            return
        if ok:
            assert ("load", pause_mode) in new.log, new.log
        if pause_mode is None:
            assert [e for e in new.log if e[0] in ("pause", "continue")] == [] and new.paused is None, new.log
        elif outcome in ("partial", "adapter"):
            assert new.log[0] == ("pause", pause_mode) and new.paused == "abort" and rep.stalled, new.log
            assert ("continue",) not in new.log, new.log
        else:
            assert new.log[:2] == [("pause", pause_mode), ("base", pause_mode)], new.log
            assert new.log[-1] == ("continue",) and new.paused is None, new.log
            assert new.log.count(("continue",)) == 1, new.log
    finally:
        m.close()


def test_a_stalled_rejoiner_is_continued_once_it_holds_base_and_adapter():
    """One a failed sync left paused on partly new weights (``stalled``) is continued once, when
    it holds the whole version again."""
    from fsdp_sync import lora_stage

    m, rep, new = _stubbed("retract", "ok")
    rep.stalled, new.paused = True, "abort"
    try:
        lora_stage.rejoin(m, [rep], "1", {"tensors": {}, "cfg": {"r": 4, "target_modules": ["q_proj", "v_proj"]},
                                          "metas": []})
        assert rep.serving and not rep.stalled and new.paused is None
        assert new.log.count(("continue",)) == 1, new.log
    finally:
        m.close()
