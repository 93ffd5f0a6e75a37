"""`rank_alloc` in one process: a per-rank bucket's buffers where no group agrees them (a plain
module, the local path), and the group a bucket's ``full_tensor()`` is agreed over.

Where no peer waits, the allocator's own error is raised (never swallowed: the bucket would come
out without its buffers), and no buffer of the failed bucket is kept, not even by the error's
traceback while a caller holds it; a larger buffer than asked for is cut to the bucket's size.
The two-rank agreement itself: tests/test_h24_rank_alloc_agree.py.
"""

from __future__ import annotations

import gc
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from fsdp_sync.models import build_model, load_config
from fsdp_sync.weights import handles, rank_alloc, reshard
from fsdp_sync.weights.layout import layout_for


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config("tiny")
    return build_model(cfg, seed=3), layout_for(cfg, 2)


def _segments() -> int:
    mine = f"torch_{os.getpid()}_"
    return sum(n.startswith(mine) for n in os.listdir("/dev/shm"))


def test_a_failing_allocation_without_a_group_raises_its_own_error_and_keeps_no_buffer(tiny):
    model, layout = tiny
    calls = [0]

    def alloc(n: int):
        calls[0] += 1
        if calls[0] == 2:      # bucket 0's engine rank 1, after engine rank 0's buffer was made
            raise MemoryError(f"cannot allocate {n} bytes")
        return handles.empty_shared(n)

    gc.collect()
    before = _segments()
    with pytest.raises(MemoryError, match="cannot allocate") as info:
        next(reshard.iter_rank_buckets(model, layout, 24 << 10, dtype=torch.float32, alloc=alloc))
    gc.collect()
    assert info.value is not None and _segments() == before    # the error held, no segment kept
    del info

    with pytest.raises(ValueError, match=r"must return a 1-D uint8 tensor of at least \d+ bytes, "
                                         r"got torch.float32"):
        next(reshard.iter_rank_buckets(model, layout, 24 << 10, dtype=torch.float32,
                                       alloc=lambda n: torch.empty(n, dtype=torch.float32)))


def test_a_larger_buffer_is_cut_to_the_bucket(tiny):
    model, layout = tiny
    rb = next(reshard.iter_rank_buckets(model, layout, 24 << 10, dtype=torch.float32,
                                        alloc=lambda n: torch.zeros(n + 64, dtype=torch.uint8)))
    assert sorted(rb.buffers) == [0, 1]
    assert all(b.numel() == rb.bucket.nbytes for b in rb.buffers.values())


def test_the_full_tensor_group_is_the_first_dtensors_mesh(monkeypatch):
    def item(ndim=None, size=0, group=None):
        if ndim is None:
            return SimpleNamespace(dtensor=None)
        mesh = SimpleNamespace(ndim=ndim, size=lambda: size, get_group=lambda: group)
        return SimpleNamespace(dtensor=SimpleNamespace(device_mesh=mesh))

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    g, h = object(), object()
    assert rank_alloc.full_tensor_group([item(), item()]) is None
    assert rank_alloc.full_tensor_group([item(), item(1, 2, g), item(1, 2, h)]) is g
    assert rank_alloc.full_tensor_group([item(2, 4), item(1, 2, g)]) is dist.group.WORLD
    assert rank_alloc.full_tensor_group([item(2, 2), item(1, 2, g)]) is None   # not every rank runs it
