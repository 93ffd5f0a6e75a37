"""`recover` and `add_engine` send the current version into a replica bucket by bucket. A server
a client reaches directly (a real SGLang server: it cannot be told it is out of service, and
applies each update call as it arrives) could start a request between two of those calls and
serve it on partly new weights. Under a ``pause_mode`` the replica's generation is paused as a
sync pauses its targets, and continued only once it holds the whole version.

The replica here is a reference engine that applies each call at once
(``transactional_updates=False``) and ignores being taken out of service (``set_serving`` a
no-op, as for a server outside the fleet's router); a request is started right after the first
update call of the bring-in. Its greedy tokens must be those of the old weights or of the new,
never of a mix; the replica ends bit-exact with the one in service. Single-process trainer,
reference engines at TP 1, shared by the tests of this file.
"""

from __future__ import annotations

import threading

import pytest
import torch

from _pause_engine import PauseEngine
from _util import digest

pytestmark = pytest.mark.timeout(120)

PROMPT = [[3, 17, 42, 5, 9, 11]]


@pytest.fixture(scope="module")
def engines():
    from fsdp_sync.engines.reference import ReferenceEngine

    def make(**kw):
        return ReferenceEngine("tiny", tp_size=1, kv_cache_tokens=64, call_timeout_s=20,
                               update_recv_timeout_s=10, **kw)

    a, c = make(), make(transactional_updates=False)
    try:
        yield a, c
    finally:
        a.shutdown()
        c.shutdown()


def _served(engine) -> dict:
    return {n: digest(t) for n, t in engine.named_full_tensors()}


def _tokens(engine) -> list:
    return engine.generate(PROMPT, max_new_tokens=8)


def _direct(monkeypatch, engine) -> dict:
    """``engine`` as a server a client reaches directly: out of service is not enforced; after
    its first update call a request starts (run to its end there and then unless generation is
    paused: then it waits for the continue). Records whether each update call ran paused."""
    seen = {"paused": [], "thread": None, "tokens": None}
    monkeypatch.setattr(engine, "set_serving", lambda serving, reason="": None)
    update = engine.update_weights_from_distributed

    def racing():
        seen["tokens"] = _tokens(engine)

    def spy(*args, **kw):
        seen["paused"].append(engine.generation_paused)
        out = update(*args, **kw)
        if seen["thread"] is None:
            seen["thread"] = threading.Thread(target=racing, daemon=True)
            seen["thread"].start()
            if engine.generation_paused is None:     # it runs now, between two update calls
                seen["thread"].join(30)
        return out

    monkeypatch.setattr(engine, "update_weights_from_distributed", spy)
    return seen


def _manager(engines_list, seed):
    from fsdp_sync import FSDPShardingManager, SyncConfig
    from fsdp_sync.models import build_model, load_config

    module = build_model(load_config("tiny"), seed=seed)
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(1.5).add_(0.25)
    cfg = SyncConfig(method="distributed", bucket_bytes=64 << 10, layout="full", dist_timeout_s=30.0,
                     pause_mode="abort")
    return FSDPShardingManager(module, engines_list, config=cfg)


def _check(seen, old, new, a, c) -> None:
    seen["thread"].join(30)
    assert not seen["thread"].is_alive(), "the racing request never ended"
    assert len(seen["paused"]) > 1, f"one update call: nothing to race ({seen['paused']})"
    assert old != new, "the versions generate the same tokens: the test could not tell a mix"
    assert seen["tokens"] in (old, new), (
        f"a request started during the bring-in generated {seen['tokens']}: neither the old "
        f"version's {old} nor the new one's {new} (partly new weights)")
    assert seen["paused"] == ["abort"] * len(seen["paused"]), seen["paused"]
    assert c.generation_paused is None, "generation left paused after the bring-in"
    assert _served(c) == _served(a)


@pytest.mark.parametrize("what", ["add_engine", "recover"])
def test_a_request_racing_the_bring_in_sees_one_whole_version(what, engines, monkeypatch):
    a, c = engines
    manager = _manager([a] if what == "add_engine" else [a, c], seed={"add_engine": 1, "recover": 2}[what])
    try:
        old = _tokens(c)
        seen = _direct(monkeypatch, c)
        if what == "recover":
            manager.quarantine(c, "drained")      # held: the sync below does not go to it
        with manager:
            new = _tokens(a)
            assert seen["paused"] == []
            assert getattr(manager, what)(c) is True
            assert manager.fleet.find(c).serving and c.get_weight_version() == a.get_weight_version()
            _check(seen, old, new, a, c)
            assert _tokens(c) == new
    finally:
        monkeypatch.undo()
        manager.close()


class _Eng(PauseEngine):
    """An engine stub: only the pause bookkeeping of a bring-in runs for real."""

    base_url = "http://127.0.0.1:39998"


def _stubbed(pause_mode, outcome):
    """A manager inside its block at version "0" with one replica; its transport ``outcome``:
    "ok", "refused" (nothing kept), "partial" (the replica kept part) or "interrupt"."""
    from fsdp_sync import FSDPShardingManager, SyncConfig, fleet
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncError

    cfg = SyncConfig(dtype=torch.float32, method="distributed", memory_probe="off", pause_mode=pause_mode)
    m = FSDPShardingManager(build_model(load_config("tiny"), seed=0), [_Eng()], config=cfg)
    m._check_config = lambda engine: None
    m.version, m._inside, m.step = "0", True, 1
    m.fleet.replicas[0].version = "0"

    def fake_sync(targets, version, step, reload=False):
        fleet.take_noted()
        assert [r.engine.paused for r in targets] == [pause_mode] * len(targets), "sent unpaused"
        if outcome == "partial":
            fleet.note_partial([fleet.describe(targets[0].engine, 0)])
        if outcome == "interrupt":
            raise KeyboardInterrupt
        return (None if outcome == "ok" else SyncError("update_weights_from_distributed failed")), None

    m._transport_sync = fake_sync
    return m


@pytest.mark.parametrize("outcome", ["ok", "refused", "partial", "interrupt"])
@pytest.mark.parametrize("pause_mode", [None, "retract"])
def test_bring_in_pauses_under_pause_mode_and_leaves_paused_only_partly_new(pause_mode, outcome):
    """Under a pause_mode the replica is paused before anything is sent; continued after a whole
    version, or after a failure that left it its old weights; kept paused (its requests aborted)
    when it took part of the version. Without one it is never paused (as a sync's replicas)."""
    m = _stubbed(pause_mode, outcome)
    new = _Eng()
    try:
        if outcome == "ok":
            assert m.add_engine(new) is True
        else:
            with pytest.raises(BaseException) as info:
                m.add_engine(new)
            assert isinstance(info.value, KeyboardInterrupt if outcome == "interrupt" else Exception)
            assert not any(r.engine is new for r in m.fleet.replicas)
        if pause_mode is None:
            assert new.log == [] and new.paused is None, new.log
        elif outcome == "partial":
            assert new.log[0] == ("pause", pause_mode) and new.paused == "abort", new.log
            assert ("continue",) not in new.log, new.log
        else:
            assert new.log == [("pause", pause_mode), ("continue",)], new.log
    finally:
        m._inside = False
        m.close()
