"""A replica that took the whole new base but not the adapter (its load failed) holds its old
adapter, or none, on the new base: a pair no sync produced. Under a ``pause_mode`` it stays paused
with its requests aborted (``manager_pause.stall``), as one holding part of the base does, both
where an adapter-only sync rejoins it (``lora_stage.rejoin``) and where ``recover`` /
``add_engine`` bring it in (``manager_fleet.send``). Without a pause_mode nothing is paused; one
that failed before any byte of the base arrived is continued. The stubs are those of
tests/test_h10_bring_in_pause.py and tests/test_h16_rejoin_pause.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from test_h16_rejoin_pause import _stubbed as _rejoin_stubbed
from test_h10_bring_in_pause import _Eng as _BringEng, _stubbed as _bring_stubbed

pytestmark = pytest.mark.timeout(120)

ADAPTER = {"tensors": {"a": torch.zeros(2)}, "cfg": {"r": 4, "target_modules": ["q_proj", "v_proj"]}, "metas": []}


@pytest.mark.parametrize("pause_mode", [None, "retract"])
def test_a_rejoiner_whose_adapter_fails_after_the_base_stays_paused(pause_mode):
    from fsdp_sync import lora_stage

    m, rep, new = _rejoin_stubbed(pause_mode, "adapter")
    try:
        lora_stage.rejoin(m, [rep], "1", ADAPTER)
        assert not rep.serving and "the adapter load failed" in rep.reason, rep.reason
        if pause_mode is None:
            assert [e for e in new.log if e[0] in ("pause", "continue")] == [] and new.paused is None, new.log
            assert not rep.stalled
        else:      # paused, base sent, then its requests aborted and generation left paused
            assert new.log == [("pause", pause_mode), ("base", pause_mode), ("pause", "abort")], new.log
            assert new.paused == "abort" and rep.stalled
    finally:
        m.close()


@pytest.mark.parametrize("outcome", ["refused", "ok"])
def test_a_rejoiner_without_the_base_or_with_both_is_continued(outcome):
    """The neighbours of the row above: nothing of the base kept, or base and adapter: continued."""
    from fsdp_sync import lora_stage

    m, rep, new = _rejoin_stubbed("retract", outcome)
    try:
        lora_stage.rejoin(m, [rep], "1", ADAPTER)
        assert rep.serving is (outcome == "ok") and not rep.stalled
        assert new.log[-1] == ("continue",) and new.paused is None, new.log
    finally:
        m.close()


class _AdapterEng(_BringEng):
    """A replica brought in whose adapter load fails after its base arrived."""

    def __init__(self, fail_load=True):
        super().__init__()
        self.fail_load = fail_load

    def load_lora_adapter_from_tensors(self, name, tensors, cfg):
        if self.fail_load:
            raise RuntimeError("the adapter load failed")
        self.log.append(("load", self.paused))

    def update_weight_version(self, version):
        pass


@pytest.mark.parametrize("what", ["add_engine", "recover"])
@pytest.mark.parametrize("pause_mode", [None, "retract"])
def test_a_replica_brought_in_whose_adapter_fails_after_the_base_stays_paused(pause_mode, what, monkeypatch):
    from fsdp_sync import lora_stage

    m = _bring_stubbed(pause_mode, "ok")
    m.config = dataclasses.replace(m.config, lora="adapter", verify="off")
    monkeypatch.setattr(lora_stage, "check_engine", lambda *a, **k: None)
    m.lora_base = {}
    m.lora_prev = type("Prev", (), {"tensors": ADAPTER["tensors"], "cfg": ADAPTER["cfg"]})()
    new = _AdapterEng()
    try:
        if what == "recover":
            rep = m.fleet.add(new, serving=False)
            rep.held = True
            with pytest.raises(Exception, match="the adapter load failed"):
                m.recover(new)
            assert not rep.serving
        else:
            with pytest.raises(Exception, match="the adapter load failed"):
                m.add_engine(new)
            assert not any(r.engine is new for r in m.fleet.replicas)
        if pause_mode is None:
            assert [e for e in new.log if e[0] in ("pause", "continue")] == [] and new.paused is None, new.log
        else:
            assert new.log[0] == ("pause", pause_mode) and new.paused == "abort", new.log
            assert ("continue",) not in new.log, new.log
    finally:
        m._inside = False
        m.close()
