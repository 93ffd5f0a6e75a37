"""A distributed update staged inside a transaction keeps what it received: no second copy.

A reference worker receives each ``update_weights_from_distributed`` call into a buffer of its own
(`Worker.receive_broadcast`). Inside ``begin_weight_update`` / ``end_weight_update`` with valid
weights (a staging transaction: nothing applied until the end) the stager used to copy every
received tensor aside at the call's commit, as it must for a sender's shared buffer: one more
shard-sized copy, in fresh memory, per sync. Checked here, with the per-rank format (each worker
receives only its shard): the memory the worker faults in during a sync is about one shard (it was
two), and the weights equal the trainer's bit for bit after each sync. (That a refused call leaves
the old weights serving: tests/test_distributed.py.)
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env


def _minflt(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])     # field 10: minor faults


def _job(rank, world):
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.engines.base import checksum_named_tensors
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import build_model, load_config

    torch.set_num_threads(1)
    cfg = load_config("small")
    module = build_model(cfg, seed=4)
    shard = sum(p.numel() * 4 for p in module.parameters())      # TP 1: the whole model
    out = {"shard": shard, "faults": [], "exact": []}
    with ReferenceEngine(model_config=cfg, tp_size=1, dtype=torch.float32) as engine:
        manager = FSDPShardingManager(module, engine, config=SyncConfig(
            method="distributed", dtype=torch.float32, bucket_bytes=4 << 20, layout="engine",
            memory_probe="off", dist_master_address="127.0.0.1"))
        pid = engine.worker_pids[0]
        try:
            for step in range(3):
                with torch.no_grad():
                    for p in module.parameters():
                        p.mul_(-0.5)
                before = _minflt(pid)
                with manager:
                    pass
                out["faults"].append((_minflt(pid) - before) * 4096)
                out["staging"] = manager.stats.extra.get("layout")
                out["exact"].append(engine.weights_checksum() == checksum_named_tensors(
                    module.state_dict().items()))
        finally:
            manager.close()
    return out


@pytest.mark.timeout(180)
def test_a_staged_distributed_update_keeps_the_received_buffers(tmp_path):
    (res,) = run_ranks(_job, 1, timeout_s=170, env=spawn_env())
    assert res["staging"] == "engine", res
    assert all(res["exact"]), res
    shard = res["shard"]
    # the first sync replaces the random start-up weights in place (nothing to protect); the
    # later ones stage: the received shard, and before this change a copy of it beside
    for faulted in res["faults"][1:]:
        assert faulted < 1.5 * shard, (faulted, shard, res["faults"])


# --------------------------------------------------------------------------- where a copy is kept

def test_a_senders_tensor_is_kept_aside_on_the_weights_device_and_on_the_host_without_room(monkeypatch):
    """Inside a staging transaction a sender's tensor is copied aside until the end: beside the
    weights (a device copy: on a GPU engine it went to host memory before, two trips over PCIe
    for every staged shard, where the plan prices two device copies), and to host memory only
    where the device has no room. ``meta`` stands in for a GPU here."""
    from fsdp_sync.engines.reference.staging import stage_aside

    src = torch.arange(12, dtype=torch.float32).view(3, 4)[:, 1:3]      # a strided view of a buffer
    copy, on_host = stage_aside(src, torch.device("meta"))
    assert copy.device.type == "meta" and copy.shape == src.shape and not on_host
    copy, on_host = stage_aside(src, torch.device("cpu"))                # a CPU engine: its own memory
    assert torch.equal(copy, src) and copy.data_ptr() != src.data_ptr() and not on_host

    real_to = torch.Tensor.to

    def no_room(self, *args, **kw):
        if args and torch.device(args[0]).type == "meta":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 48.00 B")
        return real_to(self, *args, **kw)

    monkeypatch.setattr(torch.Tensor, "to", no_room)
    copy, on_host = stage_aside(src, torch.device("meta"))
    assert on_host and copy.device.type == "cpu" and torch.equal(copy, src)
