"""What fsdp_sync's verl integration does on a GPU host, checked on CPU (`make test-verl`).

- ``rollout.name=fsdp_sync_ref`` serves on CPU: where verl runs on ``cuda`` (no
  ``VERL_PLATFORM=cpu``) the replica refuses before any Ray actor starts, naming what to use.
- The ``fsdp_sync`` checkpoint engine resolves its GPU once, in the thread that builds it (verl
  sets each worker's GPU there only), and its receive thread and its sender's stream use that GPU,
  not GPU 0 (torch.cuda stood in: a fake that keeps a current device per thread, as CUDA does).
- The adapter under verl's own ``nccl`` receiver (its two reused buffers, `reused_buffers`):
  every strategy syncs bit-exact, though the receiver overwrites what it yielded a bucket ago.
"""

from __future__ import annotations

import asyncio
import json
import threading
import types

import pytest
import torch

pytestmark = [pytest.mark.verl, pytest.mark.timeout(300)]


# ---------------------------------------------------------------- fsdp_sync_ref on a GPU host
def test_fsdp_sync_ref_is_refused_where_verl_runs_on_cuda(monkeypatch):
    from verl.plugin.platform import platform_manager

    from fsdp_sync.integrations.verl import cpu_platform, replica

    started = []
    monkeypatch.setattr(replica.ray, "remote", lambda cls: started.append(cls) or cls)
    # the part of verl's RolloutReplica launch_servers reads; nnodes=2 is refused right after
    # the device check, so a run that passes it ends there, before any actor starts
    fake = types.SimpleNamespace(config=types.SimpleNamespace(custom=None), nnodes=2,
                                 world_size=4, gpus_per_node=2)

    # a GPU host: verl's CUDA platform (what auto-detection picks there without VERL_PLATFORM)
    cuda = platform_manager.PlatformRegistry.get("nvidia")()
    monkeypatch.setattr(platform_manager, "_current_platform", cuda)
    with pytest.raises(ValueError) as err:
        asyncio.run(replica.ServeReplica.launch_servers(fake))
    msg = str(err.value)
    assert msg.startswith("rollout.name=fsdp_sync_ref runs fsdp_sync's reference engine on CPU"), msg
    assert "verl runs on 'cuda' here" in msg, msg
    assert ("use actor_rollout_ref.rollout.name=sglang with "
            "+actor_rollout_ref.rollout.custom.fsdp_sync.enable=true") in msg, msg
    assert started == []                       # refused before any actor was made

    # a CPU run (VERL_PLATFORM=cpu: fsdp_sync's CPU platform): past the check, to the next one
    monkeypatch.setattr(platform_manager, "_current_platform", cpu_platform.CPUPlatform())
    with pytest.raises(ValueError, match="serves one replica from one machine"):
        asyncio.run(replica.ServeReplica.launch_servers(fake))
    assert started == [replica.ServeServer]


# ---------------------------------------------------------------- the checkpoint engine's GPU
class FakeCuda:
    """torch.cuda's device calls as CUDA behaves: the current device is per thread, a new thread
    starts on 0; every call is logged with its thread and that thread's current device."""

    def __init__(self) -> None:
        self.tls = threading.local()
        self.log: list[tuple] = []
        self.real_empty = torch.empty

    def _here(self) -> tuple[str, int]:
        return threading.current_thread().name, self.current_device()

    def current_device(self) -> int:
        return getattr(self.tls, "index", 0)

    def set_device(self, device) -> None:
        self.tls.index = device.index if isinstance(device, torch.device) else int(device)
        self.log.append(("set_device", *self._here()))

    def current_stream(self, device=None):
        self.log.append(("current_stream", *self._here(), device))
        return types.SimpleNamespace(synchronize=lambda: None)

    def empty(self, *size, device=None, **kw):
        if device is not None and torch.device(device).type == "cuda":
            self.log.append(("empty", *self._here(), torch.device(device)))
            device = "cpu"                      # the bytes live on CPU; the device is logged
        return self.real_empty(*size, device=device, **kw)

    def calls(self, what: str, thread: str) -> list[tuple]:
        return [c[2:] for c in self.log if c[0] == what and c[1] == thread]


def test_checkpoint_engine_keeps_the_builders_gpu_in_every_thread(monkeypatch):
    """verl, under RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES, sets the worker's GPU (here 3) in
    the thread that builds the worker, and so the engine; the receive thread (new: GPU 0 unless
    set) and a sender run from another thread (Ray's event loop) must use GPU 3 all the same."""
    import torch.distributed as dist

    from fsdp_sync.integrations.verl.checkpoint_engine import FsdpSyncCheckpointEngine

    cuda = FakeCuda()
    for name in ("current_device", "set_device", "current_stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(cuda, name))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "empty", cuda.empty)
    gpu3 = torch.device("cuda", 3)

    # the wire, as the group would carry it: each receiving broadcast fills the next payload
    sent = torch.arange(6, dtype=torch.float32)
    header = {"entries": [["w", "float32", [6], 0, 24]], "nbytes": 24, "last": True, "step": 1}
    raw = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
    payloads = [torch.tensor([raw.numel()]), raw, sent.view(torch.uint8)]
    broadcasts = []

    def broadcast(tensor, group_src=0, group=None, async_op=False):
        broadcasts.append(threading.current_thread().name)
        if receiving:
            tensor.copy_(payloads.pop(0))
        return types.SimpleNamespace(wait=lambda: None) if async_op else None

    monkeypatch.setattr(dist, "broadcast", broadcast)

    cuda.set_device(3)                          # verl's Worker.__init__, in the building thread
    main = threading.current_thread().name
    receiver = FsdpSyncCheckpointEngine(bucket_size=1 << 20)
    assert receiver.device == gpu3
    assert FsdpSyncCheckpointEngine(bucket_size=1 << 20, device="cuda").device == gpu3
    assert FsdpSyncCheckpointEngine(bucket_size=1 << 20, device="cuda:1").device == torch.device("cuda", 1)

    # a rollout worker receives (the group made: rank 1 of 2)
    receiving = True
    receiver.pg, receiver.rank, receiver.world_size = object(), 1, 2
    got = list(receiver.receive_weights(global_steps=1))
    assert [n for n, _ in got] == ["w"] and got[0][1].equal(sent)
    thread = "fsdp_sync-ckpt-recv"
    assert broadcasts and set(broadcasts) == {thread}
    # the thread set GPU 3 first, then allocated the bucket and synchronized on it
    assert cuda.calls("set_device", thread) == [(3,)], cuda.log
    assert cuda.calls("empty", thread) == [(3, gpu3)], cuda.log
    assert cuda.calls("current_stream", thread) == [(3, gpu3)], cuda.log

    # actor rank 0 sends from a thread of its own (Ray runs async methods on its event loop's)
    receiving = False
    sender = FsdpSyncCheckpointEngine(bucket_size=1 << 20, is_master=True)
    sender.pg, sender.rank, sender.world_size = object(), 0, 2
    result: dict = {}

    def send() -> None:
        try:
            result["metrics"] = asyncio.run(sender.send_weights([("w", sent)], global_steps=1))
        except BaseException as exc:  # noqa: BLE001 - raised below, in the test's thread
            result["error"] = exc

    t = threading.Thread(target=send, name="event-loop")
    t.start()
    t.join(60)
    assert "error" not in result, result.get("error")
    assert result["metrics"]["checkpoint_engine/fsdp_sync/tensors"] == 1.0
    # its staging buffers and its stream name GPU 3, whatever this thread's current device
    assert cuda.calls("empty", "event-loop") == [(0, gpu3), (0, gpu3)], cuda.log
    streams = cuda.calls("current_stream", "event-loop")
    assert streams and set(streams) == {(0, gpu3)}, cuda.log
    assert cuda.calls("set_device", main) == [(3,)]


# ---------------------------------------------------------------- verl's reused receive buffers
def test_every_strategy_is_bit_exact_on_verls_nccl_receiver_which_reuses_its_buffers():
    """verl's nccl receiver yields views into two buffers and receives bucket k+2 into bucket k's
    as the consumer pulls bucket k+1's first tensor. ``bucketed`` keeps a group of tensors, and
    (before) ``per_tensor`` the last tensor, across that pull: both must still send what was
    received. 64 KiB receive buckets (the tiny Qwen2's 128 KiB embedding and lm_head go in chunks,
    merged by verl into memory of their own), 100 KiB adapter buckets: groups span receive
    buckets."""
    from fsdp_sync.cli.launch import run_ranks
    from fsdp_sync.engines.reference import ReferenceEngine
    from fsdp_sync.engines.reference.serve import EngineServer

    import reused_buffers

    strategies = ["flattened", "bucketed", "per_tensor"]
    with ReferenceEngine("tiny", tp_size=1, seed=5) as engine, EngineServer(engine) as server:
        rollout = {"name": "sglang", "tensor_model_parallel_size": 1, "dtype": "float32",
                   "custom": {"fsdp_sync": {"enable": True, "base_url": server.url,
                                            "bucket_mb": 0.1}}}
        (syncs,) = run_ranks(reused_buffers.reused_buffer_syncs, 1, rollout, strategies, 64 << 10,
                             timeout_s=240)
    assert [s["strategy"] for s in syncs] == strategies
    assert all(s["tensors"] == s["n"] for s in syncs), syncs
    # every strategy's sync, read back from the engine, bit for bit
    wrong = {s["strategy"]: f"{len(s['mismatched'])} tensors, first {s['mismatched'][:2]}"
             for s in syncs if s["mismatched"]}
    assert wrong == {}, wrong
    assert syncs[2]["engine_calls"] == syncs[2]["n"]            # per_tensor: one call per tensor
    assert 2 < syncs[1]["engine_calls"] < syncs[1]["n"]        # bucketed: groups of several


def test_streams_that_may_overwrite_what_they_yielded():
    """`stream.reuses_memory`: an async stream is copied from where held (verl's nccl, nixl, ...
    receivers), fsdp_sync's own checkpoint engine's is not (each bucket is a fresh buffer), nor
    verl's colocated export (a plain generator)."""
    from fsdp_sync.integrations.verl.checkpoint_engine import ReceivedWeights
    from fsdp_sync.integrations.verl.stream import reuses_memory

    async def receiver():
        yield "w", torch.zeros(1)

    assert reuses_memory(receiver())
    assert not reuses_memory(ReceivedWeights.__new__(ReceivedWeights))
    assert not reuses_memory(iter([("w", torch.zeros(1))]))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("lag", [False, True])
def test_flattened_buffers_take_turns_where_sglang_may_answer_before_every_rank_read(lag):
    """SGLang at TP > 1 answers once its ranks passed a CPU barrier, their copies out of the
    bucket possibly still queued on their GPUs (`SGLangEngine.reads_may_outlast_answer`): the
    adapter's flattened packing then lets two buffers take turns, so the buffer of bucket k is
    refilled only after bucket k + 1 was answered; otherwise one buffer serves every bucket."""
    import types

    import torch

    from fsdp_sync.config import SyncConfig
    from fsdp_sync.integrations import verl as plugin
    from fsdp_sync.transport import SyncStats

    a = object.__new__(plugin.SGLangAdapter)     # its __new__ reads a verl config
    a.sync, a._buffer_hint, a._pack_s = SyncConfig(bucket_bytes=1024), 0, 0.0
    a._prepare = lambda name, t: t
    weights = [(f"w{i}", torch.full((64,), float(i))) for i in range(8)]   # 256 B each: 4 a bucket
    topo = types.SimpleNamespace(tp_size=1, tp_rank=0)
    used, contents = [], []
    for call in a._flattened_calls(iter(weights), topo, SyncStats(), lag=lag):
        buf = call.on_release.__self__
        used.append((id(buf), buf.buf.data_ptr()))
        contents.append(buf.buf[:1024].view(torch.float32)[::64].tolist())
        for ps in call.sets:
            ps.release(require_ack=False, unopened=[0])   # (no engine opened it)
        call.on_release()
    assert contents == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]
    if lag:
        assert used[0] != used[1]                        # bucket 1 did not refill bucket 0's
    else:
        assert used[0] == used[1]


@pytest.mark.timeout(60)
def test_cpu_tensors_from_verl_go_to_the_gpu_before_packing_on_a_gpu_host(monkeypatch):
    """verl hands a LoRA run's base over on the CPU (``collect_lora_params``: ``.cpu()``): on a GPU
    host the adapter moves each tensor to this rank's GPU before packing, as verl's own adapter
    does, so buckets go by CUDA IPC and not through /dev/shm (64 MiB in a default container, a
    bucket up to 2 GiB). The GPU is `_ipc_device`'s: None on a CPU host. Here the meta device
    stands in for the GPU (it takes a copy without a GPU)."""
    import torch

    from fsdp_sync.config import SyncConfig
    from fsdp_sync.integrations import verl as plugin
    from fsdp_sync.integrations.verl import adapter as adapter_mod

    assert adapter_mod._ipc_device() is None                     # this CPU host
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    assert adapter_mod._ipc_device() == torch.device("cuda", 5)
    a = object.__new__(plugin.SGLangAdapter)     # its __new__ reads a verl config
    a.sync, a._pack_s, a._sent = SyncConfig(dtype=torch.bfloat16), 0.0, None
    a._ipc_device = torch.device("meta")
    out = a._prepare("w", torch.ones(3, 4))
    assert out.device.type == "meta" and out.dtype == torch.bfloat16 and out.shape == (3, 4)
    a._ipc_device = None
    assert a._prepare("w", torch.ones(2)).device.type == "cpu"
