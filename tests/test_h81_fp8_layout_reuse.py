"""What a run's syncs work out once and reuse: the TP layout map (`layout.layout_for`, one entry)
and an FP8 sync's quantizer layout, ignored layers and quantized names (`weights.quantize`).

H81: every FP8 sync asked `quantize.quantized_hf_names` (the manager's coverage check, verify,
the tensor method's metas), which took `layout_for(config, 1)` and so evicted the run's TP layout
and its reverse maps: the sync then built its TP layout again, and its `FP8Layout` and the
config's ignored layers too (qwen3-235b-a22b at TP 8, EP 8: 1.4 s of every sync on this host,
on every rank). Now each is kept, keyed by what it depends on, so a changed
``quantization_config`` or ``SGLANG_FP8_IGNORED_LAYERS`` is read again (not a stale answer), and
a sync cut for another TP is planned for that TP (an engine restarted at another TP is never fed
the old split's slices)."""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.models import build_model, load_config
from fsdp_sync.weights import fp8_config, quantize, reshard
from fsdp_sync.weights.bucket import unflatten
from fsdp_sync.weights.experts import hub_views
from fsdp_sync.weights.layout import layout_for, shard_state_dict


class _Module:
    def __init__(self, cfg):
        self.config = cfg


class _FP8:
    quantization = "fp8"


def test_an_fp8_syncs_names_leave_the_runs_tp_layout_and_quantizer_in_place():
    cfg = load_config("tiny-fp8")
    m = _Module(cfg)
    tp2 = layout_for(cfg, 2)
    names = quantize.quantized_hf_names(m)
    assert "model.layers.0.self_attn.q_proj.weight" in names and "model.norm.weight" not in names
    assert layout_for(cfg, 2) is tp2          # before: rebuilt after every FP8 sync's names
    q1, q2 = quantize.for_sync(m, _FP8, 2), quantize.for_sync(m, _FP8, 2)
    assert q1.layout is q2.layout and q1.layout.tp == 2
    assert quantize.for_sync(m, _FP8, 1).layout.tp == 1      # another split: its own layout


def test_a_changed_ignored_list_or_sglang_variable_is_read_again(monkeypatch):
    cfg = load_config("tiny-fp8")
    m = _Module(cfg)
    before = quantize.quantized_hf_names(m)
    monkeypatch.setenv(fp8_config.ENV, "model.layers.0.mlp")
    with pytest.raises(ValueError, match=fp8_config.ENV):
        quantize.quantized_hf_names(m)
    with pytest.raises(ValueError, match=fp8_config.ENV):
        quantize.for_sync(m, _FP8, 2)
    monkeypatch.delenv(fp8_config.ENV)
    cfg.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128],
                               "activation_scheme": "dynamic", "ignored_layers": ["model.layers.0.mlp"]}
    after = quantize.quantized_hf_names(m)
    gone = {f"model.layers.0.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
    assert before - after == gone and not after - before
    assert not gone & quantize.for_sync(m, _FP8, 2).layout.quantized


@torch.no_grad()
def test_per_rank_buckets_cut_again_for_an_engine_restarted_at_another_tp():
    """The same module cut at TP 2, then 4 (KV heads replicated, a vocab that TP 4 pads), then 2
    again: each engine rank's shard is the layout map's (`shard_state_dict`) and, independently,
    o_proj's column slice and the embedding's rows with zeroed padding."""
    cfg = load_config("tiny", vocab_size=500, num_hidden_layers=1)
    model = build_model(cfg, seed=2, dtype=torch.bfloat16)
    full = {n: t.detach().clone() for n, t in hub_views(model).items()}
    o = full["model.layers.0.self_attn.o_proj.weight"]
    emb = full["model.embed_tokens.weight"]
    for tp in (2, 4, 2):
        layout = layout_for(cfg, tp)
        got: dict[int, dict] = {r: {} for r in range(tp)}
        for rb in reshard.iter_rank_buckets(model, layout, 4096, alloc=lambda n: torch.empty(n, dtype=torch.uint8)):
            for r, flat in rb.buffers.items():
                got[r].update((n, t.clone()) for n, t in unflatten(flat, rb.bucket.entries))
        rows = -(-500 // 64) * 64 // tp
        for r in range(tp):
            want = shard_state_dict(full, layout, r)
            assert set(got[r]) == set(want), (tp, r)
            for n, t in want.items():
                assert torch.equal(got[r][n].view(torch.int16), t.view(torch.int16)), (tp, r, n)
            w = o.shape[1] // tp
            assert torch.equal(got[r]["model.layers.0.self_attn.o_proj.weight"], o[:, r * w:(r + 1) * w])
            e = got[r]["model.embed_tokens.weight"]
            real = max(0, min(500, (r + 1) * rows) - r * rows)
            assert e.shape[0] == rows and torch.equal(e[:real], emb[r * rows:r * rows + real])
            assert not e[real:].any(), (tp, r)


@pytest.mark.parametrize("over,tp,ep,want", [
    ({}, 3, 1, "at a tp_size this model splits at: 1, 2, 4"),                     # 4 heads
    ({"num_attention_heads": 6, "num_key_value_heads": 3}, 2, 1, "splits at: 1"),  # 3 KV heads, I 128
    ({"recipe": "tiny-qwen2-moe", "moe_intermediate_size": 34}, 4, 1, "at tp_size 4 use ep_size 2, 4"),
])
def test_a_split_sglang_refuses_says_which_splits_work(over, tp, ep, want):
    """The layout map's refusal of a TP/EP split names the field and its value (as before) and
    what to do: the TP sizes (or EP sizes) this model splits at (before: the field alone)."""
    over = dict(over)
    cfg = load_config(over.pop("recipe", "tiny"), **over)
    with pytest.raises(ValueError, match=r"must be divisible by") as info:
        layout_for(cfg, tp, ep)
    assert want in str(info.value) and "SGLang refuses this split too" in str(info.value), info.value


@pytest.mark.parametrize("ignored", [5, {"model.layers.0.mlp": True}])
def test_the_reference_engine_refuses_an_ignored_list_that_is_no_list(ignored):
    """A dict was read as its keys (the sync refuses it: the two would differ), a number raised a
    bare TypeError naming no field; both are now refused naming the field, as the sync does."""
    from fsdp_sync.engines.reference.quant import resolve

    cfg = load_config("tiny-fp8")
    cfg.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128], "ignored_layers": ignored}
    with pytest.raises(ValueError, match="ignored_layers / modules_to_not_convert"):
        resolve(cfg, None)
    with pytest.raises(ValueError, match="quantization_config.ignored_layers"):
        quantize.quantized_hf_names(_Module(cfg))


def test_a_block_fp8_split_sglang_refuses_says_which_splits_fit():
    """An MoE (moe_intermediate_size 384) at TP 4, EP 1: each expert's slice (96 rows) cuts a 128 block;
    the refusal names it (as before) and what to do: the EP sizes at TP 16, or the TP sizes at
    EP 1, whose slices are whole blocks; a model no split fits says so (before: the misfits alone)."""
    from fsdp_sync.weights import fp8
    from fsdp_sync.weights.layout import ModelSpec, TPLayout

    moe = ModelSpec.from_config(load_config("tiny-fp8-moe", moe_intermediate_size=384))
    with pytest.raises(ValueError, match=r"expert rows per rank .* = 96 is not a multiple of block 128") as info:
        fp8.check_block_shapes(TPLayout(moe, 4, 1))
    assert "at tp_size 4 use ep_size 4, or a tp_size whose slices are whole blocks: 1;" in str(info.value), info.value
    fp8.check_block_shapes(TPLayout(moe, 4, 4))       # the split it names fits
    fp8.check_block_shapes(TPLayout(moe, 1, 1))
    with pytest.raises(ValueError) as info:
        fp8.check_block_shapes(TPLayout(ModelSpec.from_config(load_config("tiny")), 2))
    assert "SGLang refuses it too, and every tp_size up to 64" in str(info.value), info.value
    assert str(info.value).count("ignored_layers") == 1
