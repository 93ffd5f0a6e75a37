"""The tensor method never shares a module's own CUDA storage by CUDA IPC (checked on a CPU).

Sharing a CUDA storage (``storage._share_cuda_()``, inside torch's ``reduce_tensor``) wraps it in a
new ``CudaIPCSentData``: a ref-counter slot in a /dev/shm ``torch_*`` file and, for the first 1,000
live ones, an interprocess CUDA event, both given back only when the storage is freed: never, for
a parameter. Before: with a plain (or one-rank) module, no cast, and strategy ``per_tensor`` or
``bucketed`` on CUDA, `export.iter_params` yielded each parameter's own storage and it was shared
as is, so every sync kept one more slot and event per tensor (after about 3 syncs of 338 tensors
the events were spent and every later share synchronized its stream). The CPU path never showed
it: a CPU tensor is always copied into a segment `handles` owns. Here the parameters say they live
on ``cuda:0`` (CPU tensors underneath), `handles`' reducer records the storage it is given, and the
sync's CUDA buffers are CPU buffers that say ``cuda:0``.
"""

from __future__ import annotations

import types

import pytest
import torch

from fsdp_sync import SyncConfig
from fsdp_sync.transport import SyncStats
from fsdp_sync.transport.tensor import TensorTransport
from fsdp_sync.weights import handles


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it lives on ``cuda:0``."""

    device = property(lambda self: torch.device("cuda", 0))


def _cuda_module() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4, bias=False))
    for mod in m:
        for name, p in list(mod.named_parameters(recurse=False)):
            setattr(mod, name, torch.nn.Parameter(p.detach().clone().as_subclass(_OnCuda)))
    m.register_buffer("scale", torch.full((8,), 0.5).as_subclass(_OnCuda))
    return m


@pytest.fixture
def shared(monkeypatch):
    """The storages `handles` hands torch's reducer, by data pointer."""
    seen: list[int] = []

    def reduce_tensor(t):
        seen.append(t.untyped_storage().data_ptr())
        return int, (0,)                  # a stand-in for torch's CUDA handle tuple

    monkeypatch.setattr(handles, "torch_reduce_tensor", lambda: reduce_tensor)
    setup = handles._Reductions._setup

    def setup_too(self, *args, **kwargs):   # the pickler's table is by exact type: add the stand-in's
        setup(self, *args, **kwargs)
        self.dispatch_table[_OnCuda] = self._reduce_tensor

    monkeypatch.setattr(handles._Reductions, "_setup", setup_too)
    real = handles.empty_shared

    def empty_shared(nbytes, device="cpu"):
        if torch.device(device).type == "cuda":
            return torch.empty(nbytes, dtype=torch.uint8).as_subclass(_OnCuda)
        return real(nbytes, device)

    monkeypatch.setattr(handles, "empty_shared", empty_shared)
    return seen


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", ["per_tensor", "bucketed"])
def test_a_modules_own_cuda_storage_is_shared_only_as_a_copy(shared, strategy):
    module = _cuda_module()
    own = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}
    sd = {k: v.detach().clone().as_subclass(torch.Tensor) for k, v in module.state_dict().items()}
    tr = TensorTransport()
    tr.module, tr.config, tr._quant = module, SyncConfig(method="tensor", strategy=strategy, bucket_bytes=256), None
    tr.topo = types.SimpleNamespace(tp_size=1, tp_rank=0)
    tr.stats = SyncStats()
    steps = tr._steps_per_tensor if strategy == "per_tensor" else tr._steps_bucketed
    sent: dict = {}
    calls = 0
    for call in steps(tagged=False):
        calls += 1
        for ps in call.sets:
            assert ps.obj.device.type == "cuda"            # still a CUDA tensor, in a buffer of the sync
            sent[len(sent)] = ps.obj.detach().clone().as_subclass(torch.Tensor)
            ps.release(require_ack=False)
    assert len(shared) == len(sd) == 6 and calls == (6 if strategy == "per_tensor" else 3)
    assert not own & set(shared), "a parameter's own CUDA storage was shared by IPC"
    assert [v.tolist() for v in sent.values()] == [v.tolist() for v in sd.values()]
    assert tr.stats.tensors == 6 and tr.stats.bytes == sum(v.numel() * v.element_size() for v in sd.values())


@pytest.mark.timeout(60)
def test_a_gathered_or_cast_cuda_tensor_is_shared_as_is(shared):
    """Only the module's own storage is copied: a cast (a fresh tensor, freed with its call) goes
    as it is, no second copy."""
    module = _cuda_module()
    tr = TensorTransport()
    tr.module, tr._quant = module, None
    tr.config = SyncConfig(method="tensor", strategy="per_tensor", dtype="float16")
    tr.topo = types.SimpleNamespace(tp_size=1, tp_rank=0)
    tr.stats = SyncStats()
    objs = []
    for call in tr._steps_per_tensor(tagged=False):
        for ps in call.sets:
            objs.append(ps.obj.untyped_storage().data_ptr())
            ps.release(require_ack=False)
    assert shared == objs and len(objs) == 6
