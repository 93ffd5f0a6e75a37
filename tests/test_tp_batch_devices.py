"""`tp_batch.gather` with CUDA batches at infer-TP 2, emulated on a CPU.

An object collective pickles, and torch unpickles a CUDA tensor onto the device index it was saved
from: rank 1's ``cuda:1`` rows come back on ``cuda:1`` in rank 0. Before: every CUDA batch was
refused at infer-TP > 1 (``field 'input_ids' differs in device across the infer-TP ranks (rank 0:
cuda:0, rank 1: cuda:1)``, on both ranks), and a DataProto failed in ``torch.cat``. Here two
threads play the two ranks with the real `gather`; their tensors are CPU tensors that say they live
on ``cuda:<rank>`` and keep saying so through a real pickle round trip (as a CUDA tensor does);
``torch.cat`` refuses a mix of devices as CUDA does, and ``.to("cuda:i")`` is faked (no CUDA here).
"""

from __future__ import annotations

import pickle
import threading
import types

import pytest
import torch

from fsdp_sync import tp_batch


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it lives on ``cuda:index``; ``.cpu()`` / ``.to("cpu")`` give a plain
    CPU tensor, ``torch.cat`` across indices (or with a CPU tensor) fails as on a GPU."""

    index = 0
    device = property(lambda self: torch.device("cuda", self.index))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cpu or (func is torch.Tensor.to and _target(args[1:], kwargs) == "cpu"):
            with torch._C.DisableTorchFunctionSubclass():
                return args[0].clone()
        if func is torch.cat:
            found = {str(t.device) for t in args[0]}
            if len(found) > 1:
                raise RuntimeError(f"Expected all tensors to be on the same device, but found at least "
                                   f"two devices, {' and '.join(sorted(found))}!")
        return super().__torch_function__(func, types, args, kwargs)


class OnCuda0(_OnCuda):
    index = 0


class OnCuda1(_OnCuda):
    index = 1


ON = {0: OnCuda0, 1: OnCuda1}


def _target(args, kwargs):
    dev = kwargs.get("device", args[0] if args else None)
    return torch.device(dev).type if isinstance(dev, (str, torch.device)) else None


def fake_cuda_to(monkeypatch):
    """A plain tensor's ``.to("cuda:i")`` gives one that says ``cuda:i`` (no CUDA here)."""
    real = torch.Tensor.to

    def to(self, *args, **kwargs):
        dev = kwargs.get("device", args[0] if args else None)
        if isinstance(dev, (str, torch.device)) and torch.device(dev).type == "cuda":
            if isinstance(self, _OnCuda):
                assert self.device == torch.device(dev), "moved between GPUs"
                return self
            with torch._C.DisableTorchFunctionSubclass():
                return self.clone().as_subclass(ON[torch.device(dev).index])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)


def run_two_ranks(monkeypatch, batches, unpickle=None):
    """Each rank's `tp_batch.gather` of ``batches[rank]`` in a thread; the object all-gather
    pickles every rank's object and unpickles it in each receiver, as torch's does
    (``unpickle(data, obj)``, where a pickle does not keep the device itself: ``obj`` is what
    was sent)."""
    monkeypatch.setattr(tp_batch, "cpu_group", lambda g: g)
    sent: list = [None, None]
    barrier = threading.Barrier(2, timeout=20)

    def all_gather_object(parts, obj, group=None):
        sent[group.rank] = (pickle.dumps(obj), obj)
        barrier.wait()
        parts[:] = [unpickle(*s) if unpickle else pickle.loads(s[0]) for s in sent]
        barrier.wait()

    monkeypatch.setattr(tp_batch.dist, "all_gather_object", all_gather_object)
    out: list = [None, None]

    def rank(r):
        topo = types.SimpleNamespace(tp_size=2, tp_rank=r, tp_group=types.SimpleNamespace(rank=r),
                                     describe=lambda: f"dp rank 0, infer-TP rank {r} of 2")
        try:
            out[r] = tp_batch.gather(topo, batches[r])
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


@pytest.mark.timeout(60)
def test_cuda_batches_are_gathered_onto_each_ranks_own_device(monkeypatch):
    fake_cuda_to(monkeypatch)
    batches = [{"input_ids": (torch.arange(8 * (1 + r)).view(1 + r, 8) + 100 * r).as_subclass(ON[r]),
                "mask": torch.ones(1 + r, 8, dtype=torch.bool).as_subclass(ON[r]),
                "tags": [f"r{r}"] * (1 + r)} for r in (0, 1)]
    kept = [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in b.items()} for b in batches]
    out = run_two_ranks(monkeypatch, batches)
    for r in (0, 1):
        assert not isinstance(out[r], Exception), out[r]
        full, sizes = out[r]
        assert sizes == [1, 2]
        assert full["input_ids"].device == torch.device("cuda", r), (r, full["input_ids"].device)
        assert full["mask"].device == torch.device("cuda", r)
        assert full["input_ids"].tolist() == [list(range(8))] + (torch.arange(16).view(2, 8) + 100).tolist()
        assert full["mask"].dtype == torch.bool and full["mask"].shape == (3, 8)
        assert full["tags"] == ["r0", "r1", "r1"]
        # the caller's batch is its own still: same device, same values
        assert batches[r]["input_ids"].device == torch.device("cuda", r)
        assert torch.equal(batches[r]["input_ids"].as_subclass(torch.Tensor),
                           kept[r]["input_ids"].as_subclass(torch.Tensor))


@pytest.mark.timeout(60)
def test_a_bad_cuda_batch_is_still_refused_on_both_ranks(monkeypatch):
    """The checks still run on what was gathered: a dtype that differs names both ranks' dtypes."""
    fake_cuda_to(monkeypatch)
    batches = [{"x": torch.ones(2, 3, dtype=torch.float32 if r == 0 else torch.float64).as_subclass(ON[r])}
               for r in (0, 1)]
    out = run_two_ranks(monkeypatch, batches)
    for r in (0, 1):
        assert isinstance(out[r], ValueError), out[r]
        assert "field 'x' differs in dtype" in str(out[r]) and "rank 0: float32, rank 1: float64" in str(out[r])
