"""`quantize.StreamQuantizer`'s output buffers, in one process: ``alloc``'s buffer is checked
(a wrong tensor refused naming the size, never written through), cut to the quantized bucket's
size, and `rank_bucket` quantizes only the engine ranks it is asked for.

Whether a rank's failure here reaches its peers is the caller's (the transports catch it and
agree it per bucket: tests/test_fp8_sync.py's NaN cases go through the same ``try``).
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.config import SyncConfig
from fsdp_sync.models import build_model, load_config
from fsdp_sync.weights import quantize, reshard
from fsdp_sync.weights.layout import layout_for


@pytest.fixture(scope="module")
def first():
    model = build_model(load_config("tiny-fp8"), seed=1)
    quant = quantize.for_sync(model, SyncConfig(quantization="fp8"), 2)
    it = reshard.iter_rank_buckets(model, layout_for(model.config, 2), 200 << 10,
                                   alloc=lambda n: torch.zeros(n, dtype=torch.uint8))
    rb = next(b for b in it if any(e.name in quant.engine for e in b.bucket.entries))  # one quantized
    it.close()
    return quant, rb


def test_a_wrong_output_buffer_is_refused_naming_its_size(first):
    quant, rb = first
    n = quant.plan(rb.bucket, engine=True).nbytes
    for bad in (lambda k: torch.empty(k, dtype=torch.float32), lambda k: torch.empty(k - 1, dtype=torch.uint8)):
        with pytest.raises(ValueError, match=rf"alloc\({n}\) must return a 1-D uint8 tensor"):
            quant.rank_bucket(rb, bad)


def test_a_larger_output_buffer_is_cut_and_only_the_asked_ranks_are_quantized(first):
    quant, rb = first
    exact = quant.rank_bucket(rb, lambda k: torch.zeros(k, dtype=torch.uint8), ranks=[1])
    big = quant.rank_bucket(rb, lambda k: torch.full((k + 64,), 0xAB, dtype=torch.uint8), ranks=[1])
    assert sorted(exact.buffers) == sorted(big.buffers) == [1]
    assert big.buffers[1].numel() == big.bucket.nbytes == exact.bucket.nbytes
    assert torch.equal(big.buffers[1], exact.buffers[1])
