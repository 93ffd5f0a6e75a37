"""The trainer's CUDA cache is emptied after the sync and before the engine's KV cache is resumed,
whether or not parameters are offloaded.

Before: after sync_weights the only ``empty_cache`` was inside the offload stage, which runs with
``offload_params=True`` only (default False); the next one came at exit. The sync's freed blocks (a
512 MiB bucket by default, two when pipelined or at SGLang TP > 1, FP8 buffers, gather scratch)
stayed reserved in the trainer's caching allocator through ``resume_memory_occupation(["kv_cache"])``
and the whole rollout, where a colocated SGLang re-maps its KV cache (torch_memory_saver: OOM).
verl empties it after every update_weights (synchronize, then empty_cache) before it resumes the KV
cache; a direct `FSDPShardingManager` user was not covered. Here the stages are recorded in order,
``empty_cache``, the sync and the engine stood in for.
"""

from __future__ import annotations

import types

import pytest
import torch

import fsdp_sync.manager as mgr
from fsdp_sync import FSDPShardingManager, SyncConfig, memory


@pytest.mark.timeout(60)
@pytest.mark.parametrize("multi_stage", [True, False])
@pytest.mark.parametrize("offload", [False, True])
def test_empty_cache_between_sync_and_kv_resume(monkeypatch, tmp_path, offload, multi_stage):
    order: list[str] = []
    monkeypatch.setattr(mgr, "empty_cache", lambda: order.append("empty_cache"))
    monkeypatch.setattr(mgr, "move_params", lambda module, dev: order.append(f"move {dev}"))
    m = FSDPShardingManager(torch.nn.Linear(4, 4), types.SimpleNamespace(),
                            config=SyncConfig(method="disk", disk_dir=str(tmp_path), offload_params=offload,
                                              multi_stage_wake_up=multi_stage))
    monkeypatch.setattr(m, "_sync_weights", lambda: order.append("sync_weights"))
    monkeypatch.setattr(m, "_resume", lambda tags: order.append(f"resume {tags}"))
    monkeypatch.setattr(m, "_release", lambda: order.append("release"))
    with m:
        inside = list(order)
    i = inside.index("sync_weights")
    assert "empty_cache" in inside[i:], inside           # before the block's rollout, in any case
    if multi_stage:
        j = inside.index("resume ['kv_cache']")
        assert "empty_cache" in inside[i:j], inside       # and before the KV cache comes back
    assert ("move cpu" in inside) is False                 # a CPU module: nothing to offload
    assert order[-1] == "empty_cache"                      # and at exit, as before


def test_empty_cache_synchronizes_the_device_first(monkeypatch):
    """As verl does after an update: the device's queued work is done before the blocks go back."""
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    memory.empty_cache()
    assert calls == ["synchronize", "empty_cache"]
