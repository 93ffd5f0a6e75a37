"""The two sides of verl's checkpoint-engine sync, for test_verl_checkpoint_engine.py.

- `weights(step)` / `stream(step)`: the named tensors an actor produces (deterministic per step;
  mixed dtypes, a non-contiguous one, one larger than a 1 MiB bucket, odd sizes).
- `RankProcess`: one worker in a process of its own (actor ranks share a gloo world, as FSDP
  ranks do), driven by the test over a pipe with exactly the calls verl's manager makes.
- `ActorWorker` / `RecordingAdapter`: what verl's own `CheckpointEngineManager` drives under Ray:
  a verl `Worker` that builds the engine as verl's `ActorRolloutRefWorker` does and walks the
  stream in lockstep with its peers, and a server adapter for verl's own `CheckpointEngineWorker`
  that checks what it is handed.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import os
import traceback

import torch
import torch.distributed as dist

BUCKET_MB = 1
SPECS = [  # name, dtype, shape
    ("model.embed_tokens.weight", torch.float32, (384, 1024)),   # 1.5 MiB: larger than a bucket
    ("model.layers.0.input_layernorm.weight", torch.bfloat16, (3,)),
    ("model.layers.0.self_attn.q_proj.weight", torch.bfloat16, (512, 512)),
    ("model.layers.0.self_attn.q_proj.bias", torch.float32, (513,)),
    ("model.layers.0.mlp.up_proj.weight", torch.bfloat16, (700, 512)),
    ("model.layers.0.mlp.down_proj.weight", torch.float16, (512, 700)),
    ("model.layers.0.position_ids", torch.int64, (7,)),
    ("model.layers.1.self_attn.o_proj.weight", torch.bfloat16, (512, 512)),  # sent transposed
    ("model.layers.1.mlp.gate_proj.weight", torch.bfloat16, (1024, 512)),   # exactly 1 MiB
    ("model.norm.weight", torch.float32, (512,)),
    ("lm_head.weight", torch.bfloat16, (1100, 512)),   # 1.07 MiB: larger than a bucket, last
]


def weights(step: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for name, dtype, shape in SPECS:
        if dtype.is_floating_point:
            t = torch.randn(shape, generator=g).to(dtype)
        else:
            t = torch.randint(-2**40, 2**40, shape, generator=g, dtype=dtype)
        if name.endswith("o_proj.weight"):
            t = t.t().contiguous().t()      # same values, non-contiguous storage
        out.append((name, t))
    return out


def stream(step: int, *, bad_at: int | None = None):
    """The actor's generator: one collective per tensor (as FSDP's full_tensor), so an actor rank
    that stops walking it stalls the others."""
    for i, (name, t) in enumerate(weights(step)):
        if dist.is_initialized():
            flag = torch.ones(1)
            dist.all_reduce(flag)
        if bad_at is not None and i == bad_at:
            yield "model.bad.weight", torch.zeros(4, dtype=torch.complex64)
        yield name, t


def check(received: list[tuple[str, torch.Tensor]], step: int) -> dict:
    """Compare what a receiver got against what was sent: names in order, dtype, shape, bits."""
    want = weights(step)
    report = {"names": [n for n, _ in received], "bad": [], "digest": hashlib.sha256()}
    for (name, t), (wname, w) in zip(received, want):
        if name != wname or t.dtype != w.dtype or tuple(t.shape) != tuple(w.shape) or not torch.equal(t, w):
            report["bad"].append((name, str(t.dtype), tuple(t.shape)))
        report["digest"].update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    report["digest"] = report["digest"].hexdigest()
    return report


def model_weights(step: int) -> list[tuple[str, torch.Tensor]]:
    """The tiny Qwen2's weights as an actor exports them at ``step`` (deterministic per step)."""
    from fsdp_sync.models import build_model, load_config

    model = build_model(load_config("tiny"), seed=0)
    with torch.no_grad():
        return [(n, (t * (1.0 + 0.125 * step)).contiguous()) for n, t in model.state_dict().items()]


def model_stream(step: int):
    """`model_weights` with one collective per tensor over the actor ranks, as `stream`."""
    for name, t in model_weights(step):
        if dist.is_initialized():
            dist.all_reduce(torch.ones(1))
        yield name, t


async def consume(gen) -> list[tuple[str, torch.Tensor]]:
    """Hold every tensor to the end (no copy): buckets must not be reused under a consumer."""
    return [(n, t) async for n, t in gen]


# ---------------------------------------------------------------- one process per worker
def rank_main(conn, role: str, index: int, world_port: int | None) -> None:
    from fsdp_sync.integrations.verl.checkpoint_engine import BACKEND
    from verl.checkpoint_engine import CheckpointEngineRegistry

    if world_port is not None:     # the actor ranks' own world (FSDP's), as in verl
        from fsdp_sync.wire import join_store

        # the test's process hosts the store (`Workers`)
        dist.init_process_group("gloo", store=join_store("127.0.0.1", world_port, 2, 60), rank=index,
                                world_size=2, timeout=datetime.timedelta(seconds=60))
    engine = None
    try:
        while True:
            cmd, kw = conn.recv()
            if cmd == "exit":
                return
            try:
                if cmd == "new":
                    engine, out = CheckpointEngineRegistry.new(BACKEND, **kw), None
                elif cmd == "call":
                    out = getattr(engine, kw.pop("method"))(**kw)
                elif cmd == "send":
                    weights = (model_stream(kw["step"]) if kw.get("model")
                               else stream(kw["step"], bad_at=kw.get("bad_at")))
                    out = asyncio.run(engine.send_weights(weights, global_steps=kw["step"]))
                elif cmd == "rollout_worker":   # verl's own CheckpointEngineWorker, built as verl does
                    engine, out = rollout_worker(**kw), None
                elif cmd == "wire_format":      # what CheckpointEngineWorker hands the adapter
                    # (a backend of verl's delta wire sets it: the adapter refuses that wire)
                    engine.checkpoint_engine.wire_format, out = kw["value"], None
                elif cmd == "worker_call":      # a CheckpointEngineManager call on the worker
                    out = engine.execute_checkpoint_engine(kw.pop("method"), **kw)
                elif cmd == "update":           # the manager's rollout.update_weights(global_steps)
                    asyncio.run(engine.update_weights(global_steps=kw["step"]))
                    out = engine.server_adapter.last_stats
                elif cmd == "recv":
                    received = engine.receive_weights(global_steps=kw["step"])
                    # rollout worker 0 takes it as verl's adapters do (async for), 1 with a plain for
                    got = asyncio.run(consume(received)) if index == 0 else list(received)
                    out = check(got, kw["step"])
                conn.send(("ok", out))
            except Exception as exc:  # noqa: BLE001 - reported to the test
                conn.send(("err", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def rollout_worker(index: int, world_port: int, checkpoint_engine: dict, **rollout):
    """verl's ``CheckpointEngineWorker`` for rollout rank ``index`` of 2, outside Ray: its env is
    what Ray's worker group sets; it builds the rollout adapter itself
    (``get_rollout_class(rollout.name, rollout.mode)``, device_mesh None) and the checkpoint
    engine named by ``checkpoint_engine["backend"]`` (imported from ``custom_backend_module``)."""
    from verl.checkpoint_engine.base import CheckpointEngineWorker
    from verl.workers.config import CheckpointEngineConfig, RolloutConfig

    os.environ.update({"RANK": str(index), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(world_port), "LOCAL_RANK": "0",
                       "TORCHELASTIC_USE_AGENT_STORE": "True"})   # the test hosts the store
    config = RolloutConfig(checkpoint_engine=CheckpointEngineConfig(**checkpoint_engine), **rollout)
    return CheckpointEngineWorker(config, None)


# ---------------------------------------------------------------- an async-generator backend
from verl.checkpoint_engine.base import CheckpointEngineRegistry  # noqa: E402

from fsdp_sync.integrations.verl.checkpoint_engine import FsdpSyncCheckpointEngine  # noqa: E402

ASYNC_BACKEND = "fsdp_sync_async_generator"


@CheckpointEngineRegistry.register(ASYNC_BACKEND)
class AsyncGeneratorEngine(FsdpSyncCheckpointEngine):
    """fsdp_sync's checkpoint engine whose ``receive_weights`` is an async generator, as verl's
    ``nccl``, ``nixl``, ``mooncake``, ``hccl`` and ``kimi`` engines' are
    (``nccl_checkpoint_engine.py`` ~437): nothing to ``iter()``; each bucket is awaited on the
    event loop (a thread receives it), so a consumer that blocks the loop never gets the next."""

    async def receive_weights(self, global_steps=None):
        async for name, tensor in super().receive_weights(global_steps):
            yield name, tensor


# ---------------------------------------------------------------- under verl's manager (Ray)
from verl.single_controller.base import Worker                      # noqa: E402
from verl.single_controller.base.decorator import Dispatch, register  # noqa: E402


class ActorWorker(Worker):
    """The actor side as verl's ActorRolloutRefWorker builds it (engine_workers.py ~679-688) and
    calls it (~755-766): `CheckpointEngineRegistry.new(backend, is_master=rank == 0, ...)`, then
    per sync `send_weights(per_tensor_param, global_steps)`."""

    def __init__(self, ce_config, bad_at: int | None = None) -> None:
        super().__init__()
        from verl.checkpoint_engine import CheckpointEngineRegistry
        from verl.utils.import_utils import import_external_libs

        dist.init_process_group("gloo", rank=self.rank, world_size=self.world_size,
                                timeout=datetime.timedelta(seconds=60))
        self.bad_at = bad_at
        import_external_libs(ce_config.custom_backend_module or None)
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            ce_config.backend, is_master=(dist.get_rank() == 0),
            bucket_size=ce_config.update_weights_bucket_megabytes << 20,
            **ce_config.engine_kwargs.get(ce_config.backend, {}))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int = None, mode: str = "auto"):
        metrics = await self.checkpoint_engine.send_weights(stream(global_steps, bad_at=self.bad_at),
                                                            global_steps=global_steps)
        return metrics or {}

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args, **kwargs):
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)


class RecordingAdapter:
    """A server adapter for verl's CheckpointEngineWorker: takes the stream as verl's SGLang
    adapter does (`update_weights(weights, global_steps=..., wire_format=...)`), holds every
    tensor, checks them and writes the report where the test reads it."""

    def __init__(self, out_dir: str, replica_rank: int, rank: int) -> None:
        self.out_dir, self.replica_rank, self.rank = out_dir, replica_rank, rank
        self.is_leader_rank = rank == 0

    async def update_weights(self, weights, global_steps=None, wire_format="named_tensors", **kw):
        assert wire_format == "named_tensors", wire_format
        got = await consume(weights)
        report = check(got, global_steps)
        report["pid"] = os.getpid()
        import json
        path = os.path.join(self.out_dir, f"r{self.replica_rank}_{self.rank}_step{global_steps}.json")
        with open(path, "w") as f:
            json.dump(report, f)


class Replica:
    """The part of verl's RolloutReplica the manager uses: its workers and the server calls."""

    def __init__(self, workers) -> None:
        self.workers = workers
        self.calls: list[str] = []

    async def abort_all_requests(self, reject_request: bool = False):
        self.calls.append("abort_all_requests")

    async def release_kv_cache(self):
        self.calls.append("release_kv_cache")

    async def resume_kv_cache(self):
        self.calls.append("resume_kv_cache")

    async def resume_generation(self):
        self.calls.append("resume_generation")
