"""What the manager gives back at the exit of its block (one process, a plain module, the disk
method, one reference engine):

- each submodule's train/eval mode as it was at entry, a block left in eval by the trainer (a
  frozen part) included: the exit set every submodule to the root's mode (``module.train(flag)``),
  on a clean exit and when the body raised;
- after an exit stage failed (injected with FSDP_SYNC_FAULT), the next block finishes that restore
  instead of adopting the broken state as the trainer's: the modes of the block before, and the
  trainer's RNG stream (the next block overwrote it with the generation stream, for good);
- making a manager leaves the trainer's RNG alone: its CPU state, the CUDA seed torch queued for
  CUDA's lazy initialization and (CUDA initialized) every device's generator.
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


def _queued_cuda_seeds() -> list:
    """The seeds torch queued for CUDA's lazy initialization (``torch.manual_seed`` before CUDA
    starts): what the trainer's CUDA generators will be seeded with."""
    tracker = getattr(torch.cuda, "_lazy_seed_tracker", None)
    return [] if tracker is None else list(tracker.get_calls())


def test_making_a_manager_leaves_the_trainers_rng_alone(engine, tmp_path):
    """The constructor makes the generation stream without seeding torch: the trainer's CPU state
    and the CUDA seed it queued are what they were (before: ``torch.manual_seed(seed + rank)``
    queued 1000 for every CUDA device in place of the trainer's 1234, and put back the CPU state
    alone). Inside the block the stream is still ``SyncConfig.seed + rank``'s, carried over from
    block to block, and the trainer's goes on after it."""
    module = build_model(load_config("tiny"), seed=0)
    torch.manual_seed(1234)                      # the trainer's seed (queued for CUDA too)
    queued, cpu = _queued_cuda_seeds(), torch.get_rng_state()
    assert torch.cuda.is_initialized() or queued, "torch queues no CUDA seed here: nothing to test"
    manager = FSDPShardingManager(module, engine, config=SyncConfig(method="disk", disk_dir=str(tmp_path)))
    try:
        assert torch.equal(torch.get_rng_state(), cpu)
        assert _queued_cuda_seeds() == queued
        trainer = torch.Generator().manual_seed(1234)
        generation = torch.Generator().manual_seed(SyncConfig().seed + 0)
        for _ in range(2):
            with manager:
                assert torch.equal(torch.rand(4), torch.rand(4, generator=generation))
            assert torch.equal(torch.rand(3), torch.rand(3, generator=trainer))
    finally:
        manager.close()


@pytest.mark.gpu
def test_making_a_manager_leaves_every_cuda_generator_alone(engine, tmp_path):
    """CUDA initialized: every device's generator is the trainer's after the constructor (before:
    ``torch.manual_seed`` reseeded them all and the current device's alone was put back); inside
    the block the current device draws ``SyncConfig.seed + rank``'s stream, as before."""
    module = build_model(load_config("tiny"), seed=0)
    torch.cuda.init()
    torch.manual_seed(1234)
    states = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    manager = FSDPShardingManager(module, engine, config=SyncConfig(method="disk", disk_dir=str(tmp_path)))
    try:
        for i, state in enumerate(states):
            assert torch.equal(torch.cuda.get_rng_state(i), state), f"cuda:{i}"
        device = torch.device("cuda", torch.cuda.current_device())
        generation = torch.Generator(device=device).manual_seed(SyncConfig().seed + 0)
        with manager:
            got = torch.rand(4, device=device)
        assert torch.equal(got, torch.rand(4, device=device, generator=generation))
        assert torch.equal(torch.cuda.get_rng_state(), states[torch.cuda.current_device()])
    finally:
        manager.close()


@pytest.mark.parametrize("body_raises", [False, True], ids=["clean-exit", "body-raised"])
@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_ctrl_c_while_the_exit_releases_memory_stays_ctrl_c(engine, tmp_path, monkeypatch, interrupt,
                                                             body_raises):
    """A Ctrl-C (or a SystemExit) while the exit waits for the engine to release its memory came out
    of the block as a SyncError: a RuntimeError, which a loop that catches SyncError (or Exception)
    to retry a step swallowed, training on; over an exception of the body it became a note of that
    exception. The interrupt itself comes out now (noting the body's error), the module's modes
    and the RNG stream still restored, and the next block works. (The exit's release stage is
    interrupted here: the disk method's engine keeps its memory, so there is no engine call to
    interrupt.)"""
    module, manager = _manager(engine, tmp_path)
    real = manager._release
    calls = []

    def interrupted():
        calls.append(1)
        monkeypatch.setattr(manager, "_release", real)    # once
        raise interrupt("pressed during release_memory_occupation")

    try:
        module.train()
        before = _modes(module)
        rng = torch.get_rng_state()
        monkeypatch.setattr(manager, "_release", interrupted)
        with pytest.raises(interrupt, match="pressed during release") as info:
            with manager:
                torch.rand(3)       # the rollout's draws
                if body_raises:
                    raise RuntimeError("a rollout request failed")
        if body_raises:
            assert "while restoring after RuntimeError: a rollout request failed" in info.value.__notes__
        assert calls and _modes(module) == before and torch.equal(torch.get_rng_state(), rng)
        with manager:
            assert engine.weight_version == str(manager.version)
    finally:
        manager.close()
