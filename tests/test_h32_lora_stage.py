"""`lora_stage` rules no test held (H32's mutation pass; each test fails with its check taken out):

- a failed adapter-only sync that already named its version on the engines (the verify failed
  after `publish`) counts that version as used: the next sync names another, never two adapters
  under one version;
- one replica alone whose base changed keeps `check_engine`'s refusal (`restarted` takes a
  replica out only in a fleet of several);
- a replica brought in before any adapter was loaded (`bring_adapter`, nothing to copy) drops an
  adapter of that name it still holds, as the replicas in service hold none.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from test_h32_lora_mutants import Fake
from test_lora_sync import _peft_adapters

pytestmark = pytest.mark.timeout(120)


def test_a_version_named_before_a_failed_verify_is_not_named_again(tmp_path, monkeypatch):
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.topology import SyncError

    torch.set_num_threads(1)
    pm = _peft_adapters({"default": (4, 8)}, ["default"])
    with ReferenceEngine("tiny", tp_size=1, max_lora_rank=8, dtype=torch.float32) as eng:
        m = FSDPShardingManager(pm, eng, config=SyncConfig(
            method="disk", disk_dir=str(tmp_path), lora="adapter", lora_name="L", verify="full",
            dtype=torch.float32))
        try:
            with m:
                pass
            seen = [eng.weight_version]
            for bad in (True, False):
                with torch.no_grad():
                    for n, p in pm.named_parameters():
                        if ".lora_B." in n:
                            p.add_(0.01)
                with monkeypatch.context() as mp:
                    if bad:      # the engine reads back another adapter than it was sent
                        read = eng.lora_tensors
                        mp.setattr(eng, "lora_tensors", lambda name: {k: v + 1 for k, v in read(name).items()},
                                   raising=False)
                        with pytest.raises(SyncError, match=r"verify='full' of adapter 'L'.*differs"):
                            with m:
                                pass
                    else:
                        with m:
                            pass
                seen.append(eng.weight_version)
            assert len(set(seen)) == 3 and seen[-1] == m.version, seen
            # one replica alone whose base changed keeps check_engine's refusal: in service, the
            # base to be sent again by hand (a fleet of several takes it out to rejoin)
            eng.update_weight_version("someone-else")
            with pytest.raises(SyncError, match=r"the engine's base weights are version 'someone-else'.*"
                                                r"set manager\.base_sync_done=False"):
                with m:
                    pass
            assert [r["serving"] for r in m.fleet_status()["replicas"]] == [True]
        finally:
            m.close()


def test_a_replica_brought_in_before_any_adapter_drops_the_one_it_holds():
    from fsdp_sync import lora_stage

    engine = Fake({"L", "other"})
    manager = SimpleNamespace(config=SimpleNamespace(lora="adapter", lora_name="L"), lora_prev=None,
                              lora_base={})
    assert lora_stage.bring_adapter(manager, SimpleNamespace(engine=engine, name="replica 1"), "3") is None
    assert engine.held == {"other"} and engine.calls == [("unload", "L")]
    assert id(engine) in manager.lora_base


@pytest.mark.parametrize("mode", ["abort", "quarantine"])
def test_a_rejoiner_that_refuses_is_held_and_a_dead_one_is_tried_again(mode):
    """`rejoin`: a replica out of service whose check refuses the adapter (it answers: here its
    max_lora_rank is below r) is held, as a full sync holds it (only `recover` brings it back); one
    that cannot take updates (dead workers) is not held and, under ``"abort"``, rejoins once it
    answers."""
    from fsdp_sync import lora_stage
    from test_h32_lora_mutants import Dead

    small = Fake()
    small.max_lora_rank = 2
    reps = [SimpleNamespace(engine=small, name="replica 0", quarantined_at=None, held=False, rejoin=False),
            SimpleNamespace(engine=Dead(), name="replica 1", quarantined_at=None, held=False, rejoin=False)]
    out = []
    manager = SimpleNamespace(
        config=SimpleNamespace(lora_name="L", on_replica_failure=mode),
        fleet=SimpleNamespace(quarantine=lambda rep, why: out.append((rep.name, why))),
        _from_rank0=lambda n: n)
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    lora_stage.rejoin(manager, reps, "5", {"cfg": cfg, "metas": [], "tensors": {}, "shared": None})
    assert [(r.held, r.rejoin) for r in reps] == [(True, False), (False, mode == "abort")]
    assert "r=4 exceeds the engine's max_lora_rank 2" in out[0][1] and "recover() it" in out[0][1]
    assert out[1][0] == "replica 1" and "recover() it" not in out[1][1]
