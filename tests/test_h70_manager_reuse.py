"""Reusing the sharding manager after an interrupt cut its entry short (H70's audit). One process,
no process group; the weight sync is stood in for (the stages around it are under test)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from fsdp_sync import FSDPShardingManager, SyncConfig

pytestmark = pytest.mark.timeout(60)


class _Engine:
    base_url = "http://127.0.0.1:39991"

    def __init__(self):
        self.calls = []

    def dead_reason(self):
        return None

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume", tags))

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release", tags))


def test_a_ctrl_c_between_a_failed_stage_and_its_agree_leaves_nothing_for_the_next_block(tmp_path, monkeypatch):
    """offload_params failed (its failure waits for the next settled stage's agree), then a
    Ctrl-C landed before that agree (here: in resume_kv_cache's stage watcher; a real one lands
    in a memory probe as well). The KeyboardInterrupt comes out and everything is given back.
    Before: the unsettled failure stayed on the manager, so the next block ran no stage (prepare,
    resume, the sync all skipped) and failed on every rank with the old block's error ("stage
    'offload_params' failed: ... (injected)"); now the next block runs and syncs."""
    engine = _Engine()
    module = torch.nn.Linear(2, 2)
    m = FSDPShardingManager(module, engine, config=SyncConfig(method="disk", disk_dir=str(tmp_path),
                                                               memory_probe="off"))
    m.transport.colocated = True
    m._sync_weights = lambda: engine.calls.append(("sync",))
    real_offload = m._offload_params

    def offload_fails():
        m._offload_params = real_offload
        raise MemoryError("offloading failed (injected)")

    @contextlib.contextmanager
    def ctrl_c():
        m.watch.clear()
        raise KeyboardInterrupt("pressed")
        yield  # pragma: no cover

    m._offload_params = offload_fails
    m.watch["resume_kv_cache"] = ctrl_c
    try:
        module.train()
        with pytest.raises(KeyboardInterrupt):
            with m:
                pytest.fail("the block ran after an interrupted entry")
        assert engine.calls[-1] == ("release", ["kv_cache", "weights"]) and module.training
        engine.calls.clear()
        with m:
            assert not module.training
        assert engine.calls == [("resume", ["weights"]), ("sync",), ("resume", ["kv_cache"]),
                                ("release", ["kv_cache", "weights"])], engine.calls
    finally:
        m.close()


def test_interpreter_exit_closes_a_manager_left_inside_its_block(tmp_path, caplog, monkeypatch):
    """``wake_up()`` without its ``sleep()`` (an exception between them, the program ending):
    close() refused at interpreter exit ("close() inside the with block"), logged a warning and
    left the transport open (the distributed method's update group not destroyed on the engine).
    Now the exit's close runs."""
    import asyncio
    import weakref

    from fsdp_sync import manager as manager_mod

    engine = _Engine()
    m = FSDPShardingManager(torch.nn.Linear(2, 2), engine, config=SyncConfig(
        method="disk", disk_dir=str(tmp_path), memory_probe="off"))
    m._sync_weights = lambda: None
    closed = []
    real_close = m.transport.close
    m.transport.close = lambda: (closed.append(1), real_close())[1]
    asyncio.run(m.wake_up())
    monkeypatch.setattr(manager_mod, "_open", weakref.WeakSet([m]))    # not other tests' managers
    with caplog.at_level("WARNING", logger="fsdp_sync"):
        manager_mod._close_open_managers()
    assert closed == [1] and m.transport is None, caplog.text
    assert "closing a sharding manager at exit" not in caplog.text, caplog.text
