"""Per-rank buckets write every byte of every buffer: the vocab padding rows SGLang adds (zero in
SGLang's own shards) and the alignment gaps are zeroed, whatever the buffer held before. The
transports hand `reshard.iter_rank_buckets` pooled buffers that held an earlier bucket or sync;
the multi-process tests get fresh shared memory (zeros) or reuse host buffers where no earlier
bucket wrote over the padding rows, so dropping the padding rows' zeroing survived them (H9
mutation pass). In-process: a plain module (the local path), buffers full of 0xFF."""

from __future__ import annotations

import torch

from fsdp_sync.models import build_model, load_config
from fsdp_sync.weights import bucket, reshard
from fsdp_sync.weights.layout import layout_for, shard_state_dict


def _garbage(n: int) -> torch.Tensor:
    return torch.full((n,), 0xFF, dtype=torch.uint8)


def test_padding_rows_and_gaps_are_zero_in_reused_buffers():
    tp = 2
    cfg = load_config("tiny", vocab_size=999, num_hidden_layers=1)     # 999 -> 1024: 25 padding rows
    model = build_model(cfg, seed=5)
    layout = layout_for(cfg, tp)
    assert layout.padding("lm_head.weight", tp - 1) is not None      # the last rank has padding rows
    want = [shard_state_dict(dict(model.state_dict()), layout, r) for r in range(tp)]
    n = 0
    for rb in reshard.iter_rank_buckets(model, layout, 64 << 10, dtype=torch.float32, alloc=_garbage):
        assert sorted(rb.buffers) == list(range(tp))
        for r, flat in rb.buffers.items():
            ref = bucket.flatten(rb.bucket, {e.name: want[r][e.name] for e in rb.bucket.entries})
            assert torch.equal(flat[:rb.bucket.nbytes], ref), (r, rb.bucket.names)
        n += 1
    assert n > 1
