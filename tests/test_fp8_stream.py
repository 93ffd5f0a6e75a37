"""The trainer side of an FP8 sync (`weights.quantize`), single process: a quantized bucket holds,
bit for bit, `fp8.quantize_block` of each quantized weight and the other tensors' bytes as they
were, in one bucket of either wire layout; each engine rank's slice quantized on its own equals that
rank's cut (`fp8.FP8Layout` placements) of the full quantization, for dense and MoE models under TP
and EP; what cannot be quantized exactly is refused by name."""

from __future__ import annotations

import pytest
import torch
import transformers

from fsdp_sync.config import SyncConfig
from fsdp_sync.weights import bucket, export, fp8, quantize, reshard
from fsdp_sync.weights.layout import layout_for, shard_state_dict

pytestmark = pytest.mark.timeout(180)

F8 = torch.float8_e4m3fn
DENSE = dict(vocab_size=320, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
             intermediate_size=512, num_hidden_layers=2, tie_word_embeddings=False)


def _model(kind: str = "qwen2", seed: int = 0, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**DENSE)
    elif kind == "qwen2-odd":        # hidden 320: a partial 64-column edge block in every weight
        cfg = transformers.Qwen2Config(**{**DENSE, "hidden_size": 320})
    else:
        cfg = transformers.Qwen3MoeConfig(**DENSE, moe_intermediate_size=256, num_experts=4,
                                          num_experts_per_tok=2, mlp_only_layers=[1])
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
    with torch.no_grad():            # tiny and huge values, zeros: every block scale kind
        for n, p in model.named_parameters():
            if n.endswith("layers.0.self_attn.o_proj.weight"):
                p[:128, :128] = 0
                p[128:, :64] *= 1e-6
                p[128:, 64:] *= 1e4
    return model


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _alloc(n: int) -> torch.Tensor:
    return torch.full((n,), 0xAB, dtype=torch.uint8)      # garbage: padding must be zeroed


@pytest.mark.parametrize("tight", [False, True])
def test_a_quantized_bucket_is_the_quantizer_bit_for_bit_in_one_bucket(tight):
    model = _model("qwen2-odd")
    quant = quantize.for_sync(model, SyncConfig(quantization="fp8"), 1, tight=tight)
    seen = []
    for bkt, flat in export.iter_buckets(model, 300 << 10, alloc=_alloc):
        out, q = quant.bucket(bkt, flat, _alloc)
        (bucket.check_tight if tight else lambda b: None)(out)
        got = dict(bucket.unflatten(q, out.entries))
        assert len(got) == len(bkt.entries) + sum(e.name in quant.hf for e in bkt.entries)
        sizes = [e.dtype.itemsize for e in out.entries]
        assert sizes == sorted(sizes, reverse=True)        # 4-byte scales, 2-byte bf16, then fp8
        for name, t in bucket.unflatten(flat, bkt.entries):
            if name in quant.hf:
                qw, s = fp8.quantize_block(name, t)
                assert got[name].dtype == F8 and torch.equal(_u8(got[name]), _u8(qw)), name
                assert torch.equal(_u8(got[fp8.scale_name(name)]), _u8(s)), name
            else:
                assert got[name].dtype == t.dtype and torch.equal(_u8(got[name]), _u8(t)), name
            seen.append(name)
        used = torch.zeros(out.nbytes, dtype=torch.bool)
        for e in out.entries:
            used[e.start:e.end] = True
        assert int(q[~used].count_nonzero()) == 0           # padding zeroed (files are hashed)
    names = [m.name for m in export.param_metas(model)]
    assert seen == names
    assert quant.hf == {n for n in names if n.endswith(("proj.weight",)) and "embed" not in n}
    metas = quantize.sync_metas(model, SyncConfig(quantization="fp8"))
    assert sum(m.nbytes for m in metas) < 0.55 * sum(m.nbytes for m in export.param_metas(model))


@pytest.mark.parametrize("kind,tp,ep", [("qwen2", 1, 1), ("qwen2", 2, 1), ("qwen2", 4, 1),
                                        ("qwen2-odd", 2, 1), ("moe", 2, 1), ("moe", 2, 2)])
def test_each_engine_rank_slice_quantized_alone_is_its_cut_of_the_full_quantization(kind, tp, ep):
    """The per-rank path quantizes what reaches each engine rank (engine names, its slice); the
    full path quantizes whole tensors that the engine cuts. Both must give every rank the same
    bytes, because no TP/EP cut splits a 128 block (`fp8.check_block_shapes`)."""
    model = _model(kind, seed=tp + ep)
    base = layout_for(model.config, tp, ep)
    quant = quantize.for_sync(model, SyncConfig(quantization="fp8"), tp, ep)
    full = dict(quant.named(export.iter_params(model)))
    want = {r: shard_state_dict(full, quant.layout, r) for r in range(tp)}
    got: dict[int, dict] = {r: {} for r in range(tp)}
    for rb in reshard.iter_rank_buckets(model, base, 200 << 10, alloc=_alloc):
        rb = quant.rank_bucket(rb, _alloc)
        for r, flat in rb.buffers.items():
            got[r].update(bucket.unflatten(flat, rb.bucket.entries))
    for r in range(tp):
        assert set(got[r]) == set(want[r]) == set(quant.layout.engine_shapes())
        for name, t in want[r].items():
            assert got[r][name].dtype == t.dtype == quant.layout.dtype_of(name, torch.bfloat16), name
            assert torch.equal(_u8(got[r][name]), _u8(t)), (r, name)
    assert any(n.endswith("experts.w13_weight_scale_inv") for n in got[0]) == (kind == "moe")


def test_what_cannot_be_quantized_exactly_is_refused_by_name():
    cfg = SyncConfig(quantization="fp8")
    narrow = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(**{**DENSE, "head_dim": 64}))
    assert quantize.for_sync(narrow, cfg, 1) is not None
    # head_dim 64 at TP 2: each rank's one KV head is half a block
    with pytest.raises(ValueError, match=r"block FP8 \[128, 128\] at tp 2.*k_proj/v_proj rows per rank = 64"):
        quantize.for_sync(narrow, cfg, 2)
    model = _model("qwen2")
    plain = torch.nn.Linear(128, 128)
    with pytest.raises(ValueError, match="needs the module's Hugging Face .config"):
        quantize.for_sync(plain, cfg, 1)
    with pytest.raises(ValueError, match=r"quantization must be one of \[None, 'fp8'\].*'int4'"):
        SyncConfig(quantization="int4")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 7] = float("nan")
    with pytest.raises(ValueError, match=r"cannot quantize 'model.layers.1.mlp.down_proj.weight'.*NaN"):
        list(quantize.for_sync(model, cfg, 1).named(export.iter_params(model)))
    assert quantize.for_sync(model, SyncConfig(), 1) is None


def test_verl_rollout_quantization_maps():
    assert SyncConfig.from_verl({"rollout": {"quantization": "fp8"}}).quantization == "fp8"
    assert SyncConfig.from_verl({"rollout": {"quantization": None}}).quantization is None
    with pytest.raises(ValueError, match="rollout.quantization.*'torchao'"):
        SyncConfig.from_verl({"rollout": {"quantization": "torchao"}})
