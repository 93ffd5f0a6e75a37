"""verl 0.9.1's own ``nccl`` receiver on CPU, for test_verl_gpu_host.py: its two reused buffers.

`verl_nccl_receiver` runs verl's unmodified ``NCCLCheckpointEngine.receive_weights`` (its
``_receive_weight_chunks`` and ``merge_weight_chunks``) with two stand-ins for what needs a GPU:
``BroadcastOperation`` and ``torch.cuda.synchronize``. The stand-in broadcast writes the next
bucket into the buffer verl hands it the moment verl creates it, the earliest a real NCCL broadcast
may write there, so every view verl yields is overwritten exactly when verl's schedule lets a
real one be (``nccl_checkpoint_engine.py`` ~449-508: bucket k+2 is received into bucket k's buffer
once the consumer pulls bucket k+1's first tensor). The buckets are packed by verl's sender rule
(``send_weights``, ~338-378, over verl's ``split_weight_chunks``). cupy, which verl's module
imports and which a CPU venv lacks, is a stand-in module here (only its name is used on the
receiving side).

`reused_buffer_syncs` is one trainer rank (`run_ranks`): fsdp_sync's adapter, built as verl's
worker builds it, takes that stream once per strategy and reads every weight back from the served
engine.
"""

from __future__ import annotations

import asyncio
import sys
import types

import torch


def _nccl_module():
    if "cupy" not in sys.modules:          # this process is the test's rank: nothing else needs it
        cupy = types.ModuleType("cupy")
        cupy.ndarray = type("ndarray", (), {})
        sys.modules["cupy"] = cupy
    import verl.checkpoint_engine.nccl_checkpoint_engine as nccl

    return nccl


async def _wire(weights: list, bucket_size: int) -> list:
    """verl's sender (``send_weights``): chunks of at most a bucket, a bucket closed when the next
    chunk would overflow it; each ``(metadata, bytes)`` as its BroadcastOperation sends it."""
    from verl.checkpoint_engine.base import split_weight_chunks

    out, meta, offset = [], {}, 0
    buf = torch.empty(bucket_size, dtype=torch.uint8)
    async for tm, chunk in split_weight_chunks(iter(weights), bucket_size):
        if offset + tm.chunk_size > bucket_size:
            out.append(({"bucket_meta": meta, "is_last": False, "length": offset}, buf[:offset].clone()))
            meta, offset = {}, 0
        tm.offset = offset
        meta[tm.name] = tm
        buf[offset:offset + tm.chunk_size] = chunk
        offset += tm.chunk_size
    out.append(({"bucket_meta": meta, "is_last": True, "length": offset}, buf[:offset].clone()))
    return out


def verl_nccl_receiver(weights: list, bucket_size: int):
    """verl's ``NCCLCheckpointEngine.receive_weights()`` (rank 1) for ``weights``: an async
    generator of views into its two buffers (see the module docstring)."""
    nccl = _nccl_module()
    wire = asyncio.run(_wire(weights, bucket_size))

    class Broadcast:
        """``BroadcastOperation`` on the receiving side: the next bucket lands in ``bucket`` now."""

        def __init__(self, rank, group_name, bucket, metadata, socket, topic) -> None:
            self.metadata, data = wire.pop(0)
            bucket[:data.numel()].copy_(data)

        async def wait_for_complete(self):
            await asyncio.sleep(0)
            return self.metadata

    nccl.BroadcastOperation = Broadcast
    torch.cuda.synchronize = lambda *a, **k: None       # CPU: every copy is done when it returns
    receiver = object.__new__(nccl.NCCLCheckpointEngine)
    receiver.rank, receiver.bucket_size, receiver.group_name = 1, bucket_size, "reused"
    receiver.socket, receiver.topic = None, "bucket_metadata"
    receiver.send_buf = torch.zeros(bucket_size, dtype=torch.uint8)
    receiver.recv_buf = torch.zeros(bucket_size, dtype=torch.uint8)
    return receiver.receive_weights()


def tiny_weights(step: int) -> list:
    from fsdp_sync.models import build_model, load_config

    model = build_model(load_config("tiny"), seed=0)
    with torch.no_grad():
        return [(n, (t * (1.0 + 0.125 * step)).contiguous()) for n, t in model.state_dict().items()]


def reused_buffer_syncs(rank: int, world: int, rollout_cfg: dict, strategies: list,
                        recv_bucket: int) -> list:
    """One sync per strategy from verl's nccl receiver (``recv_bucket`` bytes per bucket), new
    weights each; per sync the adapter's figures and the names the engine serves differently."""
    import verl  # noqa: F401  (loads the plug-in, as every verl worker does)
    from torch.distributed.device_mesh import init_device_mesh
    from verl.workers.config import RolloutConfig
    from verl.workers.rollout.base import get_rollout_class

    from fsdp_sync.engines.sglang import SGLangEngine

    fs = rollout_cfg["custom"]["fsdp_sync"]
    client = SGLangEngine(base_url=fs["base_url"], tp_size=world)
    mesh = init_device_mesh("cpu", mesh_shape=(1, world, 1), mesh_dim_names=["dp", "infer_tp", "infer_pp"])
    out = []
    for step, strategy in enumerate(strategies, start=1):
        cfg = dict(rollout_cfg, custom={"fsdp_sync": dict(fs, strategy=strategy)})
        config = RolloutConfig(**cfg)
        adapter = get_rollout_class(config.name, config.mode)(config=config, model_config=None,
                                                              device_mesh=mesh)
        want = tiny_weights(step)
        stream = verl_nccl_receiver(want, recv_bucket)
        asyncio.run(adapter.update_weights(stream, global_steps=step))
        stats = adapter.last_stats
        mismatched = [n for n, t in want
                      if not client.get_weights_by_name(n).view(torch.int32).equal(t.view(torch.int32))]
        out.append({"strategy": strategy, "mismatched": mismatched, "tensors": stats["tensors"],
                    "engine_calls": stats["engine_calls"], "n": len(want)})
    return out
