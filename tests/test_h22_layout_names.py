"""The layout map's Hub names and shapes are the trainer's, for every family and bias switch.

`layout.ModelSpec.from_config` decides which biases a family carries from its config (Qwen3 and
Qwen3-MoE: ``attention_bias`` on q/k/v AND o_proj, as transformers' ``Qwen3Attention`` builds
them and SGLang's ``qwen3.py`` / ``qwen3_moe.py`` load them; Qwen2-MoE: ``qkv_bias``; Llama:
``attention_bias`` and ``mlp_bias``). A switch read wrongly leaves a trainer tensor the engine
has no place for (or a place no tensor fills): here the names and shapes of the export of a
transformers model, the Hub checkpoint's, are compared with the map's, and the owners' pieces of
`shard_state_dict` put back together give every tensor bit for bit, with the vocab padding rows
zero (SGLang's ``VocabParallelEmbedding`` fills them with 0). In process, no engine.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.models import build_model, load_config
from fsdp_sync.weights import export
from fsdp_sync.weights.layout import layout_for, shard_state_dict

CASES = [
    ("tiny-qwen3", {"attention_bias": True}),
    ("tiny-qwen3-moe", {"attention_bias": True}),
    ("tiny-qwen2-moe", {"qkv_bias": False}),
    ("tiny-mixtral", {}),
    ("tiny", {"model_type": "llama", "attention_bias": True, "mlp_bias": False}),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("recipe,overrides", CASES, ids=[f"{r}-{'-'.join(o) or 'plain'}" for r, o in CASES])
def test_the_maps_names_and_shapes_are_the_exports_and_shards_round_trip(recipe, overrides):
    cfg = load_config(recipe, vocab_size=999, **overrides)     # 999: padding rows at every TP
    model = build_model(cfg, seed=3)
    named = dict(export.iter_params(model))
    tp = 2
    lay = layout_for(cfg, tp)
    assert set(lay.hf_shapes) == set(named), set(lay.hf_shapes) ^ set(named)
    assert {n: tuple(t.shape) for n, t in named.items()} == lay.hf_shapes
    shards = [shard_state_dict(named, lay, r) for r in range(tp)]
    for name, t in named.items():
        full = torch.full_like(t, float("nan"))
        for r in range(tp):
            for pl in lay.placements(name, r):
                if pl.owner:
                    full[pl.src] = shards[r][pl.engine][pl.dst]
        assert torch.equal(full, t), name
    for r in range(tp):
        for engine in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = lay.padding(engine, r)
            if engine in shards[r] and rows is not None:
                assert not shards[r][engine][rows].any(), (engine, r)
    assert any(lay.padding("model.embed_tokens.weight", r) for r in range(tp))
