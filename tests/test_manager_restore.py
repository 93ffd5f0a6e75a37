"""What the manager gives back at the exit of its block (one process, a plain module, the disk
method, one reference engine):

- each submodule's train/eval mode as it was at entry, a block left in eval by the trainer (a
  frozen part) included: the exit set every submodule to the root's mode (``module.train(flag)``),
  on a clean exit and when the body raised;
- after an exit stage failed (injected with FSDP_SYNC_FAULT), the next block finishes that restore
  instead of adopting the broken state as the trainer's: the modes of the block before, and the
  trainer's RNG stream (the next block overwrote it with the generation stream, for good).
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync import FSDPShardingManager, SyncConfig
from fsdp_sync.engines import ReferenceEngine
from fsdp_sync.faultpoint import FAULT_ENV
from fsdp_sync.models import build_model, load_config

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def engine():
    with ReferenceEngine("tiny", tp_size=1, kv_cache_tokens=64) as e:
        yield e


def _manager(engine, tmp_path):
    module = build_model(load_config("tiny"), seed=0)
    return module, FSDPShardingManager(module, engine, config=SyncConfig(method="disk",
                                                                          disk_dir=str(tmp_path)))


def _modes(module):
    return {n: m.training for n, m in module.named_modules()}


def test_every_submodule_gets_its_own_mode_back(engine, tmp_path):
    module, manager = _manager(engine, tmp_path)
    try:
        module.train()
        module.model.layers[0].eval()                   # frozen by the trainer
        before = _modes(module)
        assert not before["model.layers.0.self_attn.q_proj"] and before["model.layers.1.mlp"]
        with manager:
            assert not any(m.training for m in module.modules())     # eval inside
        assert _modes(module) == before
        with pytest.raises(KeyError):
            with manager:
                raise KeyError("the rollout failed")
        assert _modes(module) == before
    finally:
        manager.close()


@pytest.mark.parametrize("stage", ["restore_module", "restore_rng"])
def test_the_next_block_finishes_a_restore_that_failed(stage, engine, tmp_path, monkeypatch):
    from fsdp_sync import faultpoint
    from fsdp_sync.topology import SyncError

    module, manager = _manager(engine, tmp_path)
    try:
        module.train()
        module.model.layers[0].eval()
        modes = _modes(module)
        torch.manual_seed(1)
        trainer_rng = torch.get_rng_state()
        monkeypatch.setattr(faultpoint, "_fired", set())
        monkeypatch.setenv(FAULT_ENV, f"trainer:0:{stage}:raise")
        with pytest.raises(SyncError):
            with manager:
                pass
        monkeypatch.delenv(FAULT_ENV)
        if stage == "restore_module":
            assert not module.training                 # left in eval by the failed stage
        else:
            assert not torch.equal(torch.get_rng_state(), trainer_rng)   # the generation stream
        with manager:                                  # a clean block finishes it
            pass
        assert _modes(module) == modes
        assert torch.equal(torch.get_rng_state(), trainer_rng)
    finally:
        manager.close()
