"""SGLang's own receive code takes our ``update_weights_from_distributed`` broadcast bit-exact (CPU, gloo).

The trainer side is fsdp_sync's `DistributedTransport`, run by a one-rank `FSDPShardingManager`
on a module with bf16 / fp16 / fp32 parameters of odd sizes and an int64 buffer (so a plain
packing would misalign). Its engine handle forwards each call to a process of its own that does
what a TP worker of the installed SGLang (0.5.23, or 0.5.12 in `make test-sglang`'s second run)
does, with SGLang's code: ``init_custom_process_group`` (the store prefix, group name and rank
mapping), for ``load_format="flattened_bucket"`` 0.5.23's ``FlattenedTensorBucket.empty`` (which
itself refuses misaligned offsets) or 0.5.12's ``FlattenedTensorBucket(named_tensors=[empty
tensors])`` (``ModelRunner._update_bucketed_weights_from_distributed``: the same tight packing by
``torch.cat``, no alignment check before the broadcast) and, for
``load_format=None``, ``torch.empty`` + ``broadcast(src=0, async_op=True)`` per tensor in names
order (``WeightUpdater.receive_weights_from_distributed``, which does not import on CPU).
Every received tensor must equal the trainer's bit for bit.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

pytestmark = pytest.mark.sglang


def _sglang_worker(conn) -> None:
    """An SGLang TP worker's receive path, answering requests from the pipe."""
    import torch.distributed as dist
    from sglang.srt.utils.common import init_custom_process_group
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    groups, received = {}, {}
    while True:
        cmd, kw = conn.recv()
        try:
            if cmd == "stop":
                for pg in groups.values():
                    dist.destroy_process_group(pg)
                conn.send((True, received))
                conn.recv()   # the tensors travel as fds this process serves: exit once they arrived
                return
            if cmd == "init_weights_update_group":
                groups[kw["group_name"]] = init_custom_process_group(
                    backend=kw["backend"], init_method=f"tcp://{kw['master_address']}:{kw['master_port']}",
                    world_size=kw["world_size"], rank=kw["rank_offset"] + 0, group_name=kw["group_name"])
            elif cmd == "destroy_weights_update_group":
                dist.destroy_process_group(groups.pop(kw["group_name"]))
            elif cmd == "update_weights_from_distributed":
                pg = groups[kw["group_name"]]
                if kw["load_format"] == "flattened_bucket":
                    if hasattr(FlattenedTensorBucket, "empty"):
                        bucket = FlattenedTensorBucket.empty(kw["names"], kw["dtypes"], kw["shapes"],
                                                             "cpu")
                    else:      # 0.5.12 has no .empty: its model runner packs empty tensors
                        bucket = FlattenedTensorBucket(named_tensors=[
                            (name, torch.empty(shape, dtype=getattr(torch, dt)))
                            for name, dt, shape in zip(kw["names"], kw["dtypes"], kw["shapes"])])
                    dist.broadcast(bucket.get_flattened_tensor(), src=0, group=pg)
                    named = bucket.reconstruct_tensors()
                else:
                    named, works = [], []
                    for name, dt, shape in zip(kw["names"], kw["dtypes"], kw["shapes"]):
                        t = torch.empty(shape, dtype=getattr(torch, dt))
                        works.append(dist.broadcast(t, src=0, group=pg, async_op=True))
                        named.append((name, t))
                    for w in works:
                        w.wait()
                for name, t in named:
                    received[name] = t.clone()
            conn.send((True, "ok"))
        except Exception as exc:  # noqa: BLE001 - SGLang answers success=False
            conn.send((False, f"{type(exc).__name__}: {exc}"))


class _PipeEngine:
    """The trainer's handle: SGLang's in-process Engine answers ``(success, message)``."""

    tp_size = 1

    def __init__(self, conn) -> None:
        self.conn = conn

    def _ask(self, cmd, **kw):
        self.conn.send((cmd, kw))
        return self.conn.recv()

    def init_weights_update_group(self, **kw):
        return self._ask("init_weights_update_group", **kw)

    def update_weights_from_distributed(self, **kw):
        return self._ask("update_weights_from_distributed", **kw)

    def destroy_weights_update_group(self, group_name):
        return self._ask("destroy_weights_update_group", group_name=group_name)

    def flush_cache(self):
        return True, "ok"


class _Mixed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(3, generator=g).to(torch.bfloat16))
        self.b = torch.nn.Parameter(torch.randn(5, 7, generator=g))
        self.c = torch.nn.Parameter(torch.randn(1, generator=g).to(torch.float16))
        self.d = torch.nn.Parameter(torch.randn(33, 3, generator=g).to(torch.bfloat16))
        self.register_buffer("steps", torch.tensor([7, -1, 2**40], dtype=torch.int64))
        with torch.no_grad():
            self.b[0, 0] = float("nan")
            self.b[0, 1] = -0.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["flattened_bucket", "per_tensor"])
def test_sglang_receives_our_broadcast_bit_exact(fmt):
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.manager import FSDPShardingManager

    # the suite's forkserver (tests/conftest.py: torch and transformers imported once): the
    # worker, a fresh process, then imports only SGLang's own modules (0.4 s instead of ~7 s)
    ctx = mp.get_context("forkserver")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_sglang_worker, args=(theirs,), daemon=True)
    proc.start()
    module = _Mixed()
    try:
        manager = FSDPShardingManager(module, _PipeEngine(ours), config=SyncConfig(
            method="distributed", dist_format=fmt, bucket_bytes=128, dist_master_address="127.0.0.1",
            dist_timeout_s=60))
        with manager:
            pass
        assert manager.stats.buckets >= 3          # small budget: several broadcasts
        manager.close()
        ours.send(("stop", {}))
        ok, received = ours.recv()
        ours.send(("bye", {}))
        assert ok
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    expected = dict(module.state_dict())
    assert sorted(received) == sorted(expected)
    for name, t in expected.items():
        got = received[name]
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(got.view(-1).view(torch.uint8), t.detach().contiguous().view(-1).view(torch.uint8)), name
