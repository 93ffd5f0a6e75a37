"""The FP8 stream quantizer's per-rank buckets keep their own wire layout, and its byte counts
are the bytes it made.

A quantizer made for SGLang's broadcast (``tight=True``: full-tensor buckets with no padding) also
quantizes per-rank buckets (``layout="engine"``). Those go out as fsdp_sync's own per-rank format,
whose receiver lays the call's entries out by `wire.per_rank_bucket_plan` (16-byte aligned) without
being sent the offsets: a per-rank bucket planned tight would be read at other offsets. And the
figures the sync reports (``quantize_bytes_in`` / ``quantize_bytes_out``) count each quantized
weight as its bf16 bytes in and its fp8 bytes plus its float32 scales (4 bytes each) out.
"""

from __future__ import annotations

import torch
import transformers

from fsdp_sync import wire
from fsdp_sync.config import SyncConfig
from fsdp_sync.weights import bucket, export, fp8, quantize, reshard
from fsdp_sync.weights.layout import layout_for


def _model():      # hidden 320: 3 scale blocks a row, 12-byte scale rows, so layouts differ
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=320, hidden_size=320, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=128, intermediate_size=512,
                                   num_hidden_layers=1, tie_word_embeddings=False)
    return transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)


def _alloc(n: int) -> torch.Tensor:
    return torch.full((n,), 0xAB, dtype=torch.uint8)


def test_a_tight_quantizers_rank_buckets_are_laid_out_as_the_receiver_plans_them():
    model = _model()
    quant = quantize.for_sync(model, SyncConfig(quantization="fp8"), 2, tight=True)
    seen = 0
    for rb in reshard.iter_rank_buckets(model, layout_for(model.config, 2), 200 << 10, alloc=_alloc):
        out = quant.rank_bucket(rb, _alloc)
        metas = [bucket.TensorMeta(e.name, e.dtype, e.shape) for e in out.bucket.entries]
        want = wire.per_rank_bucket_plan(metas)
        assert [(e.name, e.start, e.end) for e in out.bucket.entries] == \
            [(e.name, e.start, e.end) for e in want.entries]
        assert all(e.start % bucket.ALIGNMENT == 0 for e in out.bucket.entries)
        # the receiver, reading each buffer by its own plan, gets the quantizer's bytes
        for r, flat in out.buffers.items():
            got = dict(bucket.unflatten(flat, want.entries))
            for name, t in bucket.unflatten(flat, out.bucket.entries):
                assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), (r, name)
        seen += sum(e.dtype == torch.float8_e4m3fn for e in out.bucket.entries)
    assert seen > 0


def test_the_named_streams_byte_figures_are_the_bytes_it_made():
    model = _model()
    quant = quantize.for_sync(model, SyncConfig(quantization="fp8"), 1)
    bf16_in = fp8_out = 0
    for name, t in quant.named(export.iter_params(model)):
        if t.dtype == torch.float8_e4m3fn:
            fp8_out += t.numel()
        elif name.endswith("weight_scale_inv"):
            assert t.dtype == torch.float32
            fp8_out += t.numel() * 4
            bf16_in += dict(model.named_parameters())[name.removesuffix("_scale_inv")].numel() * 2
    fig = quant.figures()
    assert fig["quantized_tensors"] == len(quant.hf) > 0
    assert fig["quantize_bytes_in"] == bf16_in
    assert fig["quantize_bytes_out"] == fp8_out
    # and the metas a sync announces hold exactly those bytes
    metas = {m.name: m for m in quantize.sync_metas(model, SyncConfig(quantization="fp8"))}
    assert sum(metas[n].nbytes + metas[fp8.scale_name(n)].nbytes for n in quant.hf) == fp8_out
